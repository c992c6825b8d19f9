"""Which grammar library the engine's structured output uses: llguidance, xgrammar, outlines-core.

For every library importable here, over the SmolLM2 (49,152-token) and Qwen2.5 (151,936-token)
tokenizers, the engine's own pattern of use: each library's view of the tokenizer (once per
engine); compiling the QA record schema (question / answer / difficulty) to a matcher that has
given its first mask; filling the token masks of 8 rows at once while each row walks one of 8
reference records token by token (ms per step: what the engine adds to every decode step);
the speculative round (fill K + 1 masks while consuming K drafted tokens, roll all K back,
consume the kept ones, as `generation.grammar.masks_after` does); how far back a matcher rolls;
and correctness checks (every reference token allowed, an invalid token refused, the tokenizer's
special tokens and the converted Qwen tokenizer's `[PADn]` filler tokens inside a string).

One torch thread, one process, libraries interleaved within each repetition, medians. Needs only
torch, transformers and the libraries (the project's own packages are not required by the
libraries, so this runs in a separate venv that has all three):

    PYTHONPATH=. /tmp/grammar-venv/bin/python bench/grammar_libraries.py [--repeats 5]

Prints JSON; `--out FILE` writes it too (bench/results/grammar_libraries-DATE.json).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "question": {"type": "string"},
        "answer": {"type": "string"},
        "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]},
    },
    "required": ["question", "answer", "difficulty"],
    "additionalProperties": False,
}
RECORDS = [
    ("What is the capital of France and why is it historically important?",
     "Paris; it has been a center of politics, art and culture for centuries.", "easy"),
    ("How many bones are in the adult human body?",
     "There are 206 bones in the adult human skeleton.", "medium"),
    ("Explain the difference between TCP and UDP.",
     "TCP is connection-oriented and reliable; UDP is connectionless and faster.", "hard"),
    ("Who wrote 'Pride and Prejudice'?", "Jane Austen wrote it, and it was published in 1813.",
     "easy"),
    ('What does the "GIL" do in CPython?',
     "It lets only one thread execute Python bytecode at a time.", "medium"),
    ("Why is the sky blue during the day?",
     "Rayleigh scattering scatters shorter blue wavelengths more strongly.", "medium"),
    ("What is 17 multiplied by 23?",
     "17 times 23 equals 391, which you can verify by long multiplication.", "easy"),
    ("Describe how a hash table resolves collisions.",
     "With chaining (linked buckets) or open addressing such as linear probing.", "hard"),
]
# The engine's layout (schemas.engine.JSON_LAYOUT): compact JSON, ", " and ": " separators.
TEXTS = [json.dumps({"question": q, "answer": a, "difficulty": d}) for q, a, d in RECORDS]
MODELS = {  # name: (packaged model, model_type and vocab_size of its converted config)
    "smollm2": ("packaged:smollm2-135m-instruct", ("llama", 49152)),
    "qwen2.5": ("packaged:qwen2.5-coder-1.5b-instruct", ("qwen2", 151936)),
}
BATCH = 8
K, KEPT = 5, 4  # a speculative round: K drafted, 4 accepted + the verifier's own token
PAD_NAME = re.compile(r"\[PAD\d+\]")


def ms_since(started: float) -> float:
    return 1000 * (time.perf_counter() - started)


def allowed(bits: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bits[row, token // 32]) >> (token % 32)) & 1)


def variant(schema: dict, tag: str) -> dict:
    """The schema with its property names changed, so no library's cache can serve it."""
    def rename(name: str) -> str:
        return f"{name}_{tag}"
    return {**schema, "properties": {rename(k): v for k, v in schema["properties"].items()},
            "required": [rename(k) for k in schema["required"]]}


# --- the three libraries behind one interface -------------------------------------------------

class Llguidance:
    name, package = "llguidance", "llguidance"

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lg, self.lgt = llguidance, llguidance.torch
        started = time.perf_counter()
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.view_ms = ms_since(started)

    def compile(self, schema: dict):
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return self.lg.LLMatcher.grammar_from_json_schema(schema, defaults=layout)

    def matcher(self, compiled):
        return self.lg.LLMatcher(self.info, compiled)

    def fill(self, matcher, bits, row):
        self.lgt.fill_next_token_bitmask(matcher, bits, row)

    def consume(self, matcher, token) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, tokens) -> bool:
        return matcher.rollback(tokens)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name, package = "xgrammar", "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar

        self.xg = xgrammar
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.view_ms = ms_since(started)

    def compile(self, schema: dict):
        # any_whitespace=False: the same compact ", " / ": " layout as the engine's
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def fill(self, matcher, bits, row):
        matcher.fill_next_token_bitmask(bits, row)

    def consume(self, matcher, token) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, tokens) -> bool:
        matcher.rollback(tokens)  # raises past what it has consumed
        return True

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class OutlinesCore:
    """outlines-core builds its vocabulary from the Hub (`Vocabulary.from_pretrained`), which
    is offline here: the byte-level map is built in Python from the tokenizer, leaving out the
    tokenizer's special tokens as `from_pretrained` does."""

    name, package = "outlines_core", "outlines-core"

    def __init__(self, tokenizer, vocab: int):
        import outlines_core

        self.oc = outlines_core
        started = time.perf_counter()
        decode = {char: byte for byte, char in _bytes_to_unicode().items()}
        special = special_ids(tokenizer)
        tokens: dict[bytes, list[int]] = {}
        for text, token in tokenizer.get_vocab().items():
            if token not in special and token < vocab:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(token)
        self.eos = tokenizer.eos_token_id
        self.vocabulary = outlines_core.Vocabulary(self.eos, tokens)
        self.view_ms = ms_since(started)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled, max_rollback: int = 32):
        return self.oc.Guide(compiled, max_rollback=max_rollback)

    def fill(self, matcher, bits, row):
        view = bits[row]
        matcher.write_mask_into(view.data_ptr(), view.numel(), view.element_size())

    def consume(self, matcher, token) -> bool:
        if token == self.eos and matcher.is_finished():
            return True  # its final state has no EOS transition: EOS is the end, not a token
        try:
            matcher.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def rollback(self, matcher, tokens) -> bool:
        try:
            matcher.rollback_state(tokens)
            return True
        except ValueError:
            return False

    def done(self, matcher) -> bool:
        return matcher.is_finished()


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: its added tokens marked special, and what it names."""
    added = {token for token, added in tokenizer.added_tokens_decoder.items() if added.special}
    return added | set(tokenizer.all_special_ids)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (both tokenizers are byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


LIBRARIES = [Llguidance, Xgrammar, OutlinesCore]


def importable() -> list[type]:
    found = []
    for library in LIBRARIES:
        try:
            __import__(library.name)
            found.append(library)
        except ImportError:
            pass
    return found


# --- measurements -----------------------------------------------------------------------------

def compile_ms(lib, schema: dict) -> dict:
    """Schema to a matcher that has given its first mask (llguidance compiles lazily, at the
    first mask), and its parts."""
    bits = torch.zeros(1, (lib.vocab + 31) // 32, dtype=torch.int32)
    started = time.perf_counter()
    compiled = lib.compile(schema)
    compiled_at = time.perf_counter()
    matcher = lib.matcher(compiled)
    made_at = time.perf_counter()
    lib.fill(matcher, bits, 0)
    done = time.perf_counter()
    return {"total": 1000 * (done - started), "compile": 1000 * (compiled_at - started),
            "matcher": 1000 * (made_at - compiled_at), "first_mask": 1000 * (done - made_at)}


def walk(lib, compiled, rows: list[list[int]]) -> tuple[list[float], list[float]]:
    """8 rows walking the reference records: each step fills every live row's mask, checks the
    row's next token is allowed, consumes it. Returns per-step fill ms and consume ms."""
    matchers = [lib.matcher(compiled) for _ in rows]
    bits = torch.zeros(len(rows), (lib.vocab + 31) // 32, dtype=torch.int32)
    fills, consumes = [], []
    for step in range(max(len(r) for r in rows)):
        live = [i for i, r in enumerate(rows) if step < len(r)]
        started = time.perf_counter()
        for i in live:
            lib.fill(matchers[i], bits, i)
        fills.append(ms_since(started))
        for i in live:
            if not allowed(bits, i, rows[i][step]):
                raise AssertionError(f"{lib.name}: row {i} token {step} refused by its mask")
        started = time.perf_counter()
        for i in live:
            if not lib.consume(matchers[i], rows[i][step]):
                raise AssertionError(f"{lib.name}: row {i} token {step} not consumed")
        consumes.append(ms_since(started))
    if not all(lib.done(m) for m in matchers):
        raise AssertionError(f"{lib.name}: a row's matcher did not end accepting")
    return fills, consumes


def speculative_rounds(lib, compiled, rows: list[list[int]]) -> list[float]:
    """ms per round for 8 rows, the engine's pattern (`masks_after` then `_append`): per row,
    fill the mask, then K times consume a drafted token and fill the next mask (K + 1 masks);
    roll the K back; consume the KEPT + 1 tokens the verifier kept."""
    matchers = [lib.matcher(compiled) for _ in rows]
    if isinstance(lib, OutlinesCore):
        matchers = [lib.matcher(compiled, max_rollback=K + 1) for _ in rows]
    bits = torch.zeros(len(rows) * (K + 1), (lib.vocab + 31) // 32, dtype=torch.int32)
    position = [0] * len(rows)
    rounds = []
    while True:
        live = [i for i, r in enumerate(rows) if position[i] + K + 1 <= len(r)]
        if not live:
            return rounds
        started = time.perf_counter()
        for i in live:
            matcher, draft = matchers[i], rows[i][position[i]:position[i] + K]
            lib.fill(matcher, bits, i * (K + 1))
            for j, token in enumerate(draft):
                lib.consume(matcher, token)
                lib.fill(matcher, bits, i * (K + 1) + j + 1)
            lib.rollback(matcher, K)
            for token in rows[i][position[i]:position[i] + KEPT + 1]:
                lib.consume(matcher, token)
            position[i] += KEPT + 1
        rounds.append(ms_since(started))


def rollback_limits(lib, compiled, row: list[int]) -> dict:
    """How far back a matcher can go: a whole record consumed (EOS left out), rolled back to
    its start, then consumed again; and one token rolled back on a fresh matcher."""
    record = row[:-1]
    matcher = lib.matcher(compiled)
    for token in record:
        lib.consume(matcher, token)
    to_start = _try(lambda: lib.rollback(matcher, len(record)))
    again = to_start and all(lib.consume(matcher, token) for token in record)
    out = {"tokens_consumed": len(record), "rollback_to_start": to_start,
           "consumes_again_after_rollback": again,
           "rollback_beyond_history": _try(lambda: lib.rollback(lib.matcher(compiled), 1))}
    if isinstance(lib, OutlinesCore):
        out["note"] = ("Guide(index, max_rollback=N) keeps the last N states (default 32); "
                       "a longer rollback needs N set up front")
        deep = lib.matcher(compiled, max_rollback=len(record))
        for token in record:
            lib.consume(deep, token)
        out["rollback_to_start_with_max_rollback_set"] = _try(
            lambda: lib.rollback(deep, len(record)))
    return out


def _try(fn) -> bool:
    try:
        return bool(fn())
    except Exception:  # xgrammar raises RuntimeError, outlines-core ValueError
        return False


def checks(lib, compiled, tokenizer, rows: list[list[int]]) -> dict:
    """Correctness: an invalid first token refused; inside a JSON string, the tokenizer's
    special tokens (EOS aside) and the converted tokenizer's [PADn] filler tokens."""
    bits = torch.zeros(1, (lib.vocab + 31) // 32, dtype=torch.int32)
    matcher = lib.matcher(compiled)
    lib.fill(matcher, bits, 0)
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    first_invalid_refused = not allowed(bits, 0, x) and not lib.consume(lib.matcher(compiled), x)
    matcher = lib.matcher(compiled)
    for token in tokenizer.encode('{"question": "What', add_special_tokens=False):
        lib.consume(matcher, token)
    lib.fill(matcher, bits, 0)
    special = sorted(special_ids(tokenizer) - {tokenizer.eos_token_id})
    pads = [t for text, t in tokenizer.get_vocab().items() if PAD_NAME.fullmatch(text)]
    every = sum(allowed(bits, 0, t) for t in range(lib.vocab))
    return {
        "every_reference_token_allowed_and_records_end_accepting": True,  # walk() asserts it
        "invalid_first_token_refused": first_invalid_refused,
        "in_string_special_tokens_allowed": f"{sum(allowed(bits, 0, t) for t in special)} of "
                                            f"{len(special)}",
        "in_string_pad_tokens_allowed": f"{sum(allowed(bits, 0, t) for t in pads)} of {len(pads)}",
        "in_string_eos_allowed": allowed(bits, 0, tokenizer.eos_token_id),
        "in_string_tokens_allowed": every,
    }


def import_ms(module: str) -> float:
    """A fresh interpreter's `import module` (its own dependencies included), from -X importtime."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                            capture_output=True, text=True, check=True)
    rows = [line for line in result.stderr.splitlines() if line.rstrip().endswith(f" {module}")]
    return int(rows[-1].split("|")[1]) / 1000


def tokenizer_dir(name: str, given: dict[str, str]) -> Path:
    """The converted model directory holding the tokenizer: --tokenizer-dir, else the project's
    resolver, else the conversion cache (a venv without the model's package)."""
    if name in given:
        return Path(given[name])
    packaged, (model_type, vocab) = MODELS[name]
    try:
        from generation.loading import resolve_model_dir
        from schemas import ModelSpec

        return Path(resolve_model_dir(ModelSpec(path=packaged)))
    except (ImportError, FileNotFoundError):
        from generation.loading import cache_root

        for config in sorted((cache_root() / "gguf").glob("*/config.json")):
            seen = json.loads(config.read_text())
            if (seen.get("model_type"), seen.get("vocab_size")) == (model_type, vocab):
                return config.parent
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--tokenizer-dir", nargs="*", default=[], metavar="NAME=DIR")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from bench._common import machine

    libraries = importable()
    given = dict(item.split("=", 1) for item in args.tokenizer_dir)
    result = {
        "machine": machine(),
        "python": sys.version.split()[0],
        "versions": {lib.name: importlib.metadata.version(lib.package) for lib in libraries}
        | {"torch": torch.__version__,
           "transformers": importlib.metadata.version("transformers")},
        "requires": {lib.name: [r for r in importlib.metadata.requires(lib.package) or []
                                if "extra ==" not in r] for lib in libraries},
        "import_ms": {lib.name: round(import_ms(lib.name), 1) for lib in libraries},
        "schema": SCHEMA, "batch": BATCH, "speculative_round": {"K": K, "kept": KEPT + 1},
        "repeats": args.repeats, "models": {},
    }
    for model in args.models:
        directory = tokenizer_dir(model, given)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        rows = [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id]
                for t in TEXTS]
        libs = []
        for library in libraries:
            lib = library(tokenizer, vocab)
            lib.vocab = vocab
            libs.append(lib)
        first = {lib.name: compile_ms(lib, SCHEMA) for lib in libs}  # cold: first grammar
        compiled = {lib.name: lib.compile(SCHEMA) for lib in libs}
        for lib in libs:  # warm each up once
            walk(lib, compiled[lib.name], rows)
        again, fills, consumes, rounds = ({lib.name: [] for lib in libs} for _ in range(4))
        for repeat in range(args.repeats):  # interleaved: every library once per repetition
            for lib in libs:
                again[lib.name].append(compile_ms(lib, variant(SCHEMA, f"r{repeat}")))
                fill, consume = walk(lib, compiled[lib.name], rows)
                fills[lib.name] += fill
                consumes[lib.name] += consume
                rounds[lib.name] += speculative_rounds(lib, compiled[lib.name], rows)
        out = {"tokenizer_dir": str(directory), "vocab": vocab,
               "reference_tokens": [len(r) for r in rows], "libraries": {}}
        for lib in libs:
            name = lib.name
            out["libraries"][name] = {
                "tokenizer_view_ms_once": round(lib.view_ms, 1),
                "compile_first_grammar_ms": {k: round(v, 2) for k, v in first[name].items()},
                "compile_ms_median": {k: round(statistics.median(r[k] for r in again[name]), 2)
                                      for k in again[name][0]},
                "fill_8_rows_ms_per_step": _summary(fills[name]),
                "consume_8_rows_ms_per_step": _summary(consumes[name]),
                f"speculative_round_8_rows_ms_K{K}": _summary(rounds[name]),
                "rollback": rollback_limits(lib, compiled[name], rows[0]),
                "checks": checks(lib, compiled[name], tokenizer, rows),
            }
        result["models"][model] = out
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4),
            "mean": round(statistics.mean(values), 4),
            "p90": round(statistics.quantiles(values, n=10)[-1], 4), "steps": len(values)}


if __name__ == "__main__":
    main()

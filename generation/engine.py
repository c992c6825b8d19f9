"""The engine: continuous batching over static shapes, with optional speculative decoding.

Host side decides (which row is live, how many tokens it keeps, when to refill or compact);
the device side runs only grid-shaped forwards. Each batch row is a cache row ("slot"); a
finished row's slot is refilled with the next waiting prompt so the batch stays full.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from generation import kernels, loading
from generation.device import resolve_device
from generation.draft_stop import DraftStopper, RoundPrices
from generation.metrics import DraftLengthChooser, EngineStats
from generation.model import CausalLM, DecoderConfig
from generation.proposers import CATCH_UP_WIDTHS, ModelProposer, PromptLookupProposer
from generation.quantize import ExactInt8Linear, int8_weights, quantized_copy
from generation.rejection import verify
from generation.runner import WARM_CALLS, ModelRunner
from generation.sampling import RowRandom, choose, step_draws
from generation.schedule import (
    batch_capacity,
    plain_decode_steps,
    rows_to_compact,
    slots_to_fill,
    step_width,
)
from generation.types import Completion, GenerationStopped
from schemas import EngineConfig, ModelSpec, SamplingParams

ENGINE_VERSION = "0.1.0"
Prompt = str | list[dict] | list[int] | torch.Tensor  # a tensor: 1-D integer token ids
PROMPT_KINDS = "a prompt is a string, a list of chat messages, a list of token ids or a 1-D tensor"
REPLACEMENT = "\ufffd"  # what a tokenizer decodes incomplete UTF-8 bytes to
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Row:
    """One prompt in flight. `tokens` = prompt + generated; its last token is in no cache yet."""

    index: int
    tokens: list[int]
    prompt_len: int
    rng: RowRandom
    draft_seen: int = 0  # context tokens whose K/V the draft cache holds
    finish: str | None = None
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: object
    directory: Path
    weights_sha256: str
    eos_ids: frozenset[int]


def load_model(spec: ModelSpec, max_positions: int, device: torch.device) -> LoadedModel:
    directory = loading.resolve_model_dir(spec)
    config = loading.read_config(directory)
    model = CausalLM(DecoderConfig.from_hf(config), max_positions)
    model.load_hf_weights(loading.load_state_dict(directory))
    model = model.to_dtype(DTYPES[spec.dtype]).to(device).eval()
    if spec.quantize == "int8":
        model = int8_weights(model, ExactInt8Linear)
    tokenizer = loading.load_tokenizer(directory)
    eos = loading.eos_token_ids(directory, config) | {tokenizer.eos_token_id} - {None}
    return LoadedModel(
        model, tokenizer, directory, loading.weights_sha256(directory), frozenset(eos)
    )


def _check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    t, d = target.tokenizer, draft.tokenizer
    problems = []
    if t.get_vocab() != d.get_vocab():
        problems.append("vocabularies differ")
    if t.all_special_tokens != d.all_special_tokens:
        problems.append(f"special tokens differ ({t.all_special_tokens} vs {d.all_special_tokens})")
    if target.model.config.vocab_size != draft.model.config.vocab_size:
        problems.append("embedding sizes differ")
    if problems:
        raise ValueError(
            f"draft model {draft.directory} cannot draft for {target.directory}: "
            + "; ".join(problems)
            + ". A draft must share the target's tokenizer; "
            "use kind='quantized' or 'prompt_lookup'."
        )


def _tensor_token_ids(prompt: torch.Tensor) -> list[int]:
    """A tensor prompt is read as token ids: 1-D and of an integer dtype, or it is refused."""
    dtype = prompt.dtype
    if prompt.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"a tensor prompt must hold token ids: 1-D, integer dtype; got shape "
            f"{tuple(prompt.shape)} and dtype {prompt.dtype}"
        )
    return prompt.tolist()


def _check_seeds(seeds: Sequence[int] | None, prompts: int) -> None:
    if seeds is None:
        return
    if len(seeds) != prompts:
        raise ValueError(
            f"seeds has {len(seeds)} entries for {prompts} prompts; pass one seed per prompt, "
            "or none (every prompt then uses params.seed)"
        )
    bad = next((i for i, seed in enumerate(seeds) if not isinstance(seed, int)), None)
    if bad is not None:
        raise TypeError(f"seeds[{bad}] is {seeds[bad]!r}; a seed is an int")


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        target: LoadedModel,
        device: torch.device,
        proposer=None,
        draft: LoadedModel | None = None,
    ):
        self.config, self.grid, self.device = config, config.bucket_grid, device
        self.target_loaded, self.draft_loaded = target, draft
        self.tokenizer = target.tokenizer
        dtype = DTYPES[config.target.dtype]
        self.target = ModelRunner(
            target.model, self.grid, device, dtype, config.compile, config.hpu_graphs,
            config.cuda_graphs,
        )
        self.proposer = proposer
        fixed = None if config.num_draft_tokens == "auto" else config.num_draft_tokens
        self.chooser = DraftLengthChooser(self.grid.draft_lengths, fixed)
        early = config.stop_drafting_early and proposer is not None
        self.stopper = DraftStopper() if early else None  # used while K is auto
        self.max_draft = self.grid.draft_lengths[-1]
        self._stop_ids = target.eos_ids  # plus the call's stop_token_ids, set per generate()
        self.reset_stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        device = resolve_device(config.device)
        if device.type == "cpu" and config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        grid = config.bucket_grid
        target = load_model(config.target, grid.max_cache, device)
        draft_spec, draft, proposer = config.draft, None, None
        if draft_spec is not None and draft_spec.kind == "prompt_lookup":
            proposer = PromptLookupProposer(draft_spec.ngram_max, draft_spec.ngram_min)
        elif draft_spec is not None:
            if draft_spec.kind == "model":
                draft = load_model(draft_spec.model, grid.max_cache, device)
                _check_same_tokenizer(target, draft)
                draft_model, draft_dtype = draft.model, DTYPES[draft_spec.model.dtype]
                if draft_spec.dtype == "int8":
                    draft_model = int8_weights(draft_model)
            else:
                weights = draft_spec.dtype or "int8"
                draft_model = quantized_copy(target.model, weights)
                draft_dtype = (
                    DTYPES[config.target.dtype] if weights == "int8" else torch.bfloat16
                )
            compile_draft = config.compile if draft_spec.compile is None else draft_spec.compile
            runner = ModelRunner(
                draft_model, grid, device, draft_dtype, compile_draft, config.hpu_graphs,
                config.cuda_graphs,
            )
            proposer = ModelProposer(runner)
        return cls(config, target, device, proposer, draft)

    # ---- public helpers -------------------------------------------------------------------
    @property
    def max_prompt_tokens(self) -> int:
        return self.grid.max_prompt

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def draft_kind(self) -> str:
        return self.config.draft.kind if self.config.draft else "none"

    @property
    def model_info(self) -> dict:
        """Names and weight hashes for the metrics; a target-derived draft is `target#kind`."""
        return {
            "target_model": self.config.target.name,
            "target_weights_sha256": self.target_loaded.weights_sha256,
            "draft_model": self.config.draft_model_name(),
            "draft_weights_sha256": self.draft_loaded.weights_sha256 if self.draft_loaded else None,
        }

    @property
    def hardware_info(self) -> dict:
        """For the metrics: the linear kernels each model runs (on CPU), and the CPU."""
        roles = [("target", self.target)] + (
            [("draft", self._draft_runner)] if self._draft_runner else []
        )
        on_cpu = self.device.type == "cpu"
        return {
            "cpu_kernels": " ".join(f"{role}={r.kernels}" for role, r in roles) if on_cpu else None,
            "cpu_model": kernels.cpu_model(),
            "cpu_isa": kernels.cpu_isa(),
        }

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, torch.Tensor):
            return _tensor_token_ids(prompt)
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"{PROMPT_KINDS}; got a {type(prompt).__name__}")
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False).input_ids
        raise TypeError(PROMPT_KINDS)

    def count_prompt_tokens(self, prompt: Prompt) -> int:
        return len(self.encode(prompt))

    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self._base = self._runner_totals()

    @property
    def stats(self) -> EngineStats:
        """Counters since the last reset_stats(); shape counts are the models' lifetime totals."""
        stats = self._stats
        now = self._runner_totals()
        stats.target_forwards = now["target_forwards"] - self._base["target_forwards"]
        stats.draft_forwards = now["draft_forwards"] - self._base["draft_forwards"]
        computed = now["computed"] - self._base["computed"]
        useful = now["useful"] - self._base["useful"]
        stats.padding_waste = (computed - useful) / computed if computed else None
        stats.target_shapes = len(self.target.shapes)
        stats.draft_shapes = len(self._draft_runner.shapes) if self._draft_runner else 0
        stats.distinct_shapes = stats.target_shapes + stats.draft_shapes
        stats.compiles = sum(runner.compiles for runner in self._runners)
        stats.graph_captures = sum(runner.graph_captures for runner in self._runners)
        return stats

    @property
    def _draft_runner(self) -> ModelRunner | None:
        return self.proposer.runner if isinstance(self.proposer, ModelProposer) else None

    @property
    def _runners(self) -> list[ModelRunner]:
        return [self.target] + ([self._draft_runner] if self._draft_runner else [])

    def _runner_totals(self) -> dict:
        runners = self._runners
        return {
            "target_forwards": self.target.forwards,
            "draft_forwards": self.proposer.forwards if self.proposer else 0,
            "computed": sum(r.computed_slots for r in runners),
            "useful": sum(r.useful_slots for r in runners),
        }

    def warmup(self) -> None:
        """Run every grid shape: prefills once, decodes WARM_CALLS times (their timings price
        each K until it runs)."""
        grid = self.grid
        verify_lengths = [k + 1 for k in grid.draft_lengths] if self.proposer else []
        runners = [(self.target, [1, *verify_lengths], False)]
        if self._draft_runner:  # catch-up widths beyond 2 only follow plain steps (K auto)
            widths = [2] if self.chooser.fixed else CATCH_UP_WIDTHS
            runners.append((self._draft_runner, sorted({1, *widths}), True))
        for runner, lengths, last_logit_only in runners:
            # A prefill runs once in use per prompt, so one warm call prices it; where that
            # call built a graph, a second one prices the shape without the build (else a
            # compiled draft's prefill looks like seconds and never pays back).
            prefill_calls = 2 if runner.first_call_builds else 1
            for b, t, _ in itertools.product(
                grid.batch_sizes, grid.prompt_lengths, range(prefill_calls)
            ):
                runner.prefill([[0] * t] * b, list(range(b)))
            # Decode shapes take turns, so a busy spell of the host slows one call of each
            # shape rather than all calls of one: their fastest calls compare fairly.
            for _, b, t, s in itertools.product(
                range(WARM_CALLS), grid.batch_sizes, lengths, grid.cache_lengths
            ):
                tokens, starts = torch.zeros(b, t, dtype=torch.long), torch.full((b,), s - t)
                # A draft reads one logit per row: warm that shape, or compile meets it later.
                last = torch.zeros(b, 1, dtype=torch.long) if last_logit_only else None
                runner.decode(tokens, starts, b, logit_index=last)
            runner.warm_seconds = dict(runner.recent_seconds)
        self.reset_stats()

    # ---- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in order. `should_stop` is asked before every step:
        True abandons the call (GenerationStopped), e.g. on Ctrl-C."""
        started = time.perf_counter()
        _check_seeds(seeds, len(prompts))
        self._stop_ids = self.target_loaded.eos_ids | set(params.stop_token_ids)
        results: list[Completion | None] = [None] * len(prompts)
        waiting: deque[_Row] = deque()
        for index, prompt in enumerate(prompts):
            row, error = self._admit_row(
                index, prompt, params, params.seed if seeds is None else seeds[index]
            )
            if error:
                results[index] = Completion(
                    [], "", "error", len(row.tokens) if row else 0, error=error
                )
            else:
                waiting.append(row)
        self.chooser.new_prompts()
        admitted, load_mark = list(waiting), self.target.load_mark()
        capacity = batch_capacity(self.grid.batch_sizes, len(waiting))
        slots: list[_Row | None] = [None] * capacity
        self._stats.batch_bucket_max = max(self._stats.batch_bucket_max, capacity if waiting else 0)
        while waiting or any(slots):
            if should_stop is not None and should_stop():
                raise GenerationStopped(f"stopped with {len(waiting)} prompts not started")
            self._refill(slots, waiting, params)
            self._collect(slots, results, params)
            if not any(slots):
                continue
            if not waiting:
                self._compact(slots)
            width = step_width(slots, self.grid.batch_sizes)
            k, switch_seconds = (
                self._choose_k(slots[:width], params) if self.proposer else (0, 0.0)
            )
            forwards_before, step_started = self._forward_seconds(), time.perf_counter()
            if k:
                k = self._speculative_step(slots[:width], k, params)
            else:
                self._decode_step(slots[:width], params)
            self._stats.record_step(k)
            if not (k and switch_seconds):  # a catch-up round prices the switch, not K
                self.chooser.observe_step(
                    width,
                    k,
                    time.perf_counter() - step_started,
                    self._forward_seconds() - forwards_before,
                )
            self._collect(slots, results, params)
        if self.proposer:
            self._record_plain_estimate(admitted, load_mark)
        self._stats.wall_seconds += time.perf_counter() - started
        s = self._stats
        s.host_seconds = (
            s.wall_seconds
            - s.prefill_seconds
            - s.decode_seconds
            - s.draft_seconds
            - s.verify_seconds
        )
        return results

    def _admit_row(self, index: int, prompt: Prompt, params: SamplingParams, seed: int):
        try:
            ids = self.encode(prompt)
        except Exception as exc:  # e.g. a chat template failing on a message: this record only
            return None, f"unusable prompt: {exc}"
        row = _Row(index, ids, len(ids), RowRandom(seed))
        if not ids:
            return row, "empty prompt (0 tokens)"
        if len(ids) > self.grid.max_prompt:
            return row, (
                f"prompt has {len(ids)} tokens, more than the largest prompt bucket "
                f"({self.grid.max_prompt}); raise bucket_grid.prompt_lengths or shorten it"
            )
        if max(ids) >= self.target.model.config.vocab_size or min(ids) < 0:
            return (
                row,
                f"token ids outside the vocabulary (0..{self.target.model.config.vocab_size - 1})",
            )
        return row, None

    def _refill(
        self, slots: list[_Row | None], waiting: deque[_Row], params: SamplingParams
    ) -> None:
        admitted = [(slot, waiting.popleft()) for slot in slots_to_fill(slots, len(waiting))]
        if not admitted:
            return
        started = time.perf_counter()
        prompts = [row.tokens for _, row in admitted]
        rows = [slot for slot, _ in admitted]
        logits = self.target.prefill(prompts, rows)
        # A model draft is prefilled only while speculation pays at this batch, its prefill
        # included: where plain decoding wins, that prefill is pure loss. A later K round
        # catches a skipped draft up.
        with_draft = self.proposer is not None and self.chooser.wants_draft(
            len(slots),
            *self._forward_prices(len(slots)),
            self.proposer.prefill_seconds([len(p) for p in prompts]),
            params.max_new_tokens - 1,
        )
        if with_draft:
            draft_started = time.perf_counter()
            self.proposer.prefill(prompts, rows)
            self._stats.draft_prefill_seconds += time.perf_counter() - draft_started
        draws = self._draws([row for _, row in admitted], 1, params)
        first = choose(logits, params, draws.at(0) if draws else None).tolist()
        for (slot, row), token in zip(admitted, first, strict=True):
            slots[slot] = row
            row.draft_seen = row.prompt_len if with_draft else 0
            self._stats.prompt_tokens += row.prompt_len
            self._append(row, [token], params)
        self._stats.prefill_seconds += time.perf_counter() - started

    def _decode_step(self, batch: list[_Row | None], params: SamplingParams) -> None:
        started = time.perf_counter()
        tokens = torch.tensor([[row.tokens[-1] if row else 0] for row in batch])
        starts = torch.tensor([len(row.tokens) - 1 if row else 0 for row in batch])
        logits = self.target.decode(tokens, starts, sum(1 for row in batch if row))[:, 0]
        draws = self._draws(batch, 1, params)
        chosen = choose(logits, params, draws.at(0) if draws else None).tolist()
        for row, token in zip(batch, chosen, strict=True):
            if row:
                self._append(row, [token], params)
        self._stats.decode_seconds += time.perf_counter() - started

    def _speculative_step(self, batch: list[_Row | None], k: int, params: SamplingParams) -> int:
        """One round: draft K per row, verify [b, K+1] in one target forward, keep per row.
        With a stopper, K is the largest grid K and drafting may end at a smaller one: the K
        drafted is returned."""
        live = [row for row in batch if row]
        stopper = self.stopper if self.chooser.fixed is None else None
        if stopper:
            k = self.max_draft
            stopper.start_round(self._round_prices(batch, params))
        draws = self._draws(batch, k + 1, params)  # the K + 1 positions this round may fill
        started = time.perf_counter()
        contexts = [row.tokens if row else None for row in batch]
        seen = [row.draft_seen if row else 0 for row in batch]
        draft_tokens, draft_probs = self.proposer.propose(
            contexts, seen, k, params, draws, stopper
        )
        k = draft_tokens.shape[1]
        draws = draws.head(k + 1) if draws else None
        drafted = time.perf_counter()
        draft_tokens = draft_tokens.to(self.device)
        last = torch.tensor([[row.tokens[-1] if row else 0] for row in batch], device=self.device)
        starts = torch.tensor([len(row.tokens) - 1 if row else 0 for row in batch])
        logits = self.target.decode(torch.cat([last, draft_tokens], 1), starts, len(live))
        accepted, next_token = verify(logits, draft_tokens, draft_probs, params, draws)
        accepted, next_token = accepted.tolist(), next_token.tolist()
        draft_tokens = draft_tokens.tolist()
        self._stats.draft_seconds += drafted - started
        self._stats.verify_seconds += time.perf_counter() - drafted
        counts = []
        for i, row in enumerate(batch):
            if row is None:
                continue
            kept = accepted[i]
            counts.append(kept)
            row.rounds += 1
            row.draft_seen = len(row.tokens) + min(kept, k - 1)  # fed: context + d1..d(K-1)
            row.proposed += k
            row.accepted += kept
            row.accepted_per_position += [0] * (k - len(row.accepted_per_position))
            for position in range(kept):
                row.accepted_per_position[position] += 1
            self._append(row, [*draft_tokens[i][:kept], next_token[i]], params)
        self._stats.record_round(k, counts)
        self.chooser.observe(k, counts)
        if stopper:
            stopper.observe(accepted)
        return k

    def _record_plain_estimate(self, admitted: list[_Row], load_mark: tuple[float, float]):
        """What this call's rows would have cost decoded plain: the plain schedule's steps at
        their warm-up [b, 1] times, scaled by how much slower this call's forwards ran than in
        warm-up (the machine's load now). None before a warm-up."""
        steps = plain_decode_steps(
            [(row.prompt_len, len(row.generated)) for row in admitted],
            self.grid.batch_sizes,
            self.grid.cache_lengths,
        )
        self._stats.plain_decode_steps += steps.total()
        self._stats.record_plain_estimate(
            self.target.warm_priced_seconds(steps, self.target.load_since(load_mark))
        )

    def _round_prices(self, batch: list[_Row | None], params: SamplingParams) -> RoundPrices:
        """From each grid K to the next: the draft steps and wider verify it costs; what a
        token is worth now (the chosen step's cost per token); each row's tokens left."""
        target, draft = self._forward_prices(len(batch))
        ks = self.grid.draft_lengths
        onward = {
            i: (j - i, draft(j) - draft(i) + target(j + 1) - target(i + 1))
            for i, j in itertools.pairwise(ks)
        }
        left = [params.max_new_tokens - len(row.generated) if row else 0 for row in batch]
        live = sum(1 for row in batch if row)
        return RoundPrices(onward, self.chooser.row_token_seconds / live, left)

    def _choose_k(self, batch: list[_Row | None], params: SamplingParams) -> tuple[int, float]:
        """K for this step, and the draft catch-up seconds a K round would pay first."""
        if self.chooser.fixed is not None:  # a fixed K ignores the price of switching
            return self.chooser.fixed, 0.0
        live = [row for row in batch if row]
        switch = self.proposer.catch_up_seconds(
            [row.tokens if row else None for row in batch],
            [row.draft_seen if row else 0 for row in batch],
        )
        generated = sum(len(row.tokens) - row.prompt_len for row in live) / len(live)
        horizon = params.max_new_tokens - generated
        prices = self._forward_prices(len(batch))
        return self.chooser.choose(len(batch), *prices, switch, horizon), switch

    def _forward_prices(self, width: int):
        """Measured forward times at batch bucket `width`: target [b, t] and the draft's K."""
        return (
            lambda t: self.target.recent_seconds_for(width, t),
            lambda k: self.proposer.seconds_for(width, k),
        )

    def _forward_seconds(self) -> float:
        """Seconds spent inside model forwards so far, target and draft."""
        draft = self._draft_runner.busy_seconds if self._draft_runner else 0.0
        return self.target.busy_seconds + draft

    def _draws(self, batch: list[_Row | None], positions: int, params: SamplingParams):
        """The randomness for the next `positions` tokens of each row (None when greedy)."""
        rows = [(row.rng, len(row.tokens)) if row else None for row in batch]
        return step_draws(rows, positions, params, self.device)

    def _append(self, row: _Row, new_tokens: list[int], params: SamplingParams) -> None:
        """Commit tokens to a row, stopping at EOS / stop ids / stop strings / length limits."""
        for token in new_tokens:
            row.tokens.append(token)
            self._stats.tokens_generated += 1
            if token in self._stop_ids or (params.stop and self._hit_stop_string(row, params.stop)):
                row.finish = "stop"
            elif len(row.generated) >= params.max_new_tokens:
                row.finish = "length"
            elif len(row.tokens) >= self.grid.max_context:
                row.finish = "cache_full"
            if row.finish:
                return

    def _hit_stop_string(self, row: _Row, stops: list[str]) -> bool:
        window = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(row.generated[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _collect(
        self, slots: list[_Row | None], results: list[Completion | None], params: SamplingParams
    ) -> None:
        for slot, row in enumerate(slots):
            if row and row.finish:
                results[row.index] = self._completion(row, params.stop)
                slots[slot] = None

    def _completion(self, row: _Row, stops: list[str]) -> Completion:
        text = self.tokenizer.decode(row.generated, skip_special_tokens=True)
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:  # like vLLM, the stop string itself is not part of the text
            text = text[: min(cuts)]
        # A row cut by a limit may end inside a multi-byte character, which decodes to U+FFFD:
        # drop that partial character rather than publish a replacement mark.
        trimmed = row.finish in ("length", "cache_full") and text.endswith(REPLACEMENT)
        return Completion(
            token_ids=list(row.generated),
            text=text.rstrip(REPLACEMENT) if trimmed else text,
            trimmed_partial_character=trimmed,
            finish_reason=row.finish,
            prompt_tokens=row.prompt_len,
            rounds=row.rounds,
            proposed=row.proposed,
            accepted=row.accepted,
            accepted_per_position=row.accepted_per_position,
        )

    def _compact(self, slots: list[_Row | None]) -> None:
        """With no prompt waiting, move live rows to the front when a smaller bucket fits them."""
        live = rows_to_compact(slots, self.grid.batch_sizes)
        if not live:
            return
        destinations = list(range(len(live)))
        moves = [(s, d) for s, d in zip(live, destinations, strict=True) if s != d]
        sources, targets = [s for s, _ in moves], [d for _, d in moves]
        for runner in self._runners:
            runner.cache.move_rows(sources, targets)
        rows = [slots[i] for i in live]
        for i in range(len(slots)):
            slots[i] = rows[i] if i < len(rows) else None

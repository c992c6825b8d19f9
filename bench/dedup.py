"""The dedup filter step over 100k, 300k and 1M short records, printed as JSON and saved.

Each size runs the real step (`apply_filters`: read the committed generated/ shards, MinHash
keys, clusters against the output's index, write data/ + filtered/ + the index segment, commit,
publish, verify) on a local output, in its own process, after a separate process wrote the
records: the figures hold the step alone. Records are short synthetic completions, a third of
them exact or near repeats. Peak memory is the step's process plus its hashing workers, sampled.
With --datatrove, datatrove's four MinHash stages run on the first size's records too (the
library not chosen; it is not a dependency: `pip install datatrove` first).

    python bench/dedup.py [--sizes 100000 300000 1000000] [--method minhash] [--datatrove]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
RECORDS_PER_SHARD = 10_000
SYLLABLES = [a + b for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]


def records(count: int, seed: int = 0) -> list[str]:
    """Short completions (12 to 60 words of a 10k-word vocabulary); about a third repeat an
    earlier one: as is, re-cased and punctuated, or with a word more at the end."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array(["".join(rng.choice(SYLLABLES, rng.integers(1, 4)))
                           for _ in range(10_000)])
    texts: list[str] = []
    for _ in range(count):
        if texts and rng.random() < 0.33:
            source = texts[rng.integers(len(texts))]
            texts.append([source, source.capitalize() + ".", source + " indeed"][rng.integers(3)])
        else:
            texts.append(" ".join(rng.choice(vocabulary, rng.integers(12, 61))))
    return texts


def prepare(count: int, output: str) -> None:
    """Commit the records as a run's generated/ shards and its plan (what the step finds)."""
    import fsspec
    import pyarrow as pa

    from schemas.arrow import DATA_SCHEMA
    from tasks.commit import commit_shard, new_attempt_id
    from tasks.layout import RunLayout
    from tasks.planning import Plan, Shard, write_plan

    layout = RunLayout.locate(fsspec.filesystem("file"), output, "bench")
    texts, shards = records(count), []
    for start in range(0, count, RECORDS_PER_SHARD):
        shard_id = f"s{start // RECORDS_PER_SHARD:05d}"
        rows = [{"id": f"rec-{(i * 7919) % count:08d}", "shard_id": shard_id, "prompt": "p",
                 "completion": texts[i], "finish_reason": "stop", "sample_index": 0}
                for i in range(start, min(start + RECORDS_PER_SHARD, count))]
        commit_shard(layout, shard_id, new_attempt_id(),
                     {"generated": pa.Table.from_pylist(rows, DATA_SCHEMA)}, {})
        shards.append(Shard(shard_id, "in", "in", "jsonl", start, start + 1, 0, len(rows), "f"))
    write_plan(layout, Plan("bench", layout.run_date, "bench", shards))


class PeakMemory:
    """Peak RSS of this process and its children together, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._done.wait(0.02):
            rss = me.memory_info().rss
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # it ended meanwhile
                    rss += child.memory_info().rss
            self.peak = max(self.peak, rss)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _cpu_seconds() -> float:
    """User + system time of this process and its finished children (the hashing workers):
    what the step cost whatever else kept the shared cores busy."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(output: str, method: str) -> dict:
    """Time the step and its parts on the prepared output."""
    import fsspec

    from schemas.run import parse_run_config
    from tasks import filtering
    from tasks.dedup import worker_count
    from tasks.layout import RunLayout
    from tasks.planning import Plan

    parts: dict[str, float] = {}
    for name in ("record_keys", "decide", "_stage", "publish_filters", "verify_filters"):
        original = getattr(filtering, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                parts[_name] = parts.get(_name, 0.0) + time.perf_counter() - started

        setattr(filtering, name, timed)
    layout = RunLayout.locate(fsspec.filesystem("file"), output, "bench")
    plan = Plan.from_json(layout.fs.cat_file(layout.plan_path).decode())
    config = parse_run_config({
        "input": {"uri": "unused.jsonl", "prompt_field": "prompt"},
        "generation": {"engine": {"target": {"path": "packaged:smollm2-135m-instruct"}}},
        "output": output, "run_id": "bench",
        "filters": [{"kind": "dedup", "method": method, "scope": "output"}],
    })
    baseline = psutil.Process().memory_info().rss
    cpu_before = _cpu_seconds()
    with PeakMemory() as memory:
        started = time.perf_counter()
        entry = filtering.apply_filters(config, layout, plan)
        seconds = time.perf_counter() - started
    return {
        "records": entry["input_rows"],
        "kept": entry["kept_rows"],
        "filtered": entry["filtered_rows"],
        "seconds": round(seconds, 2),
        "records_per_second": round(entry["input_rows"] / seconds),
        "cpu_seconds": round(_cpu_seconds() - cpu_before, 2),
        "peak_memory_mib": round(memory.peak / 2**20),
        "memory_before_mib": round(baseline / 2**20),
        "hashing_workers": worker_count(),
        "seconds_by_part": {
            "read_and_keys": round(parts["record_keys"], 2),
            "clusters": round(parts["decide"], 2),
            "write_data_filtered_index": round(parts["_stage"], 2),
            "publish_and_verify": round(parts["publish_filters"] + parts["verify_filters"], 2),
        },
    }


def datatrove_minhash(count: int, workdir: Path) -> dict:
    """datatrove's signature, buckets, cluster and filter stages on the same records: 3-word
    shingles, 8 bands of 16 32-bit hashes (the bands datasketch picks for 0.85), whitespace
    words (its English tokenizer needs spaCy). Stages run one after another in this process."""
    from datatrove.data import Document
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    documents = [Document(text=text, id=str(i)) for i, text in enumerate(records(count))]
    config = MinhashConfig(n_grams=3, num_buckets=8, hashes_per_bucket=16,
                           hash_config=HashConfig(precision=32))
    seconds = {}
    started = time.perf_counter()
    MinhashDedupSignature(f"{workdir}/sigs", config=config, language=Whitespace()).run(
        iter(documents))  # datatrove 0.10: writes the signatures, yields nothing
    seconds["signatures"] = time.perf_counter() - started
    buckets = MinhashDedupBuckets(f"{workdir}/sigs", f"{workdir}/buckets", config=config)
    for bucket in range(config.num_buckets):
        buckets.run(None, rank=bucket, world_size=config.num_buckets)
    seconds["buckets"] = time.perf_counter() - started - sum(seconds.values())
    MinhashDedupCluster(f"{workdir}/buckets", f"{workdir}/remove", config=config).run(None)
    seconds["cluster"] = time.perf_counter() - started - sum(seconds.values())
    kept = sum(1 for _ in MinhashDedupFilter(f"{workdir}/remove").run(iter(documents)))
    seconds["filter"] = time.perf_counter() - started - sum(seconds.values())
    total = sum(seconds.values())
    return {"records": count, "kept": kept, "seconds": round(total, 2),
            "records_per_second": round(count / total),
            "seconds_by_stage": {name: round(value, 2) for name, value in seconds.items()},
            "note": "no reading or writing of Parquet, no index, no commit: stages only"}


def _child(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                            text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"bench child {args} failed:\n{result.stderr}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--method", choices=["exact", "minhash"], default="minhash")
    parser.add_argument("--datatrove", action="store_true")
    parser.add_argument("--out", type=Path, help="results file (default bench/results/dedup-DATE)")
    parser.add_argument("--prepare", nargs=2, metavar=("COUNT", "OUTPUT"), help=argparse.SUPPRESS)
    parser.add_argument("--measure", metavar="OUTPUT", help=argparse.SUPPRESS)
    parser.add_argument("--datatrove-only", metavar="COUNT", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        return prepare(int(args.prepare[0]), args.prepare[1])
    if args.measure:
        return print(json.dumps(measure(args.measure, args.method)))
    if args.datatrove_only:
        with tempfile.TemporaryDirectory() as tmp:
            return print(json.dumps(datatrove_minhash(args.datatrove_only, Path(tmp))))

    from bench._common import machine

    runs = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            _child("--prepare", str(size), tmp)
            runs.append(json.loads(_child("--measure", tmp, "--method", args.method)))
    first = runs[0]
    result = {
        "machine": {**machine(), "cpus": len(os.sched_getaffinity(0)),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "method": args.method,
        "records_per_shard": RECORDS_PER_SHARD,
        "runs": runs,
        "scaling": {  # seconds per record relative to the smallest size: 1.0 is linear
            str(run["records"]): round(run["seconds"] / run["records"]
                                       / (first["seconds"] / first["records"]), 2)
            for run in runs},
    }
    if args.datatrove:
        result["datatrove"] = json.loads(_child("--datatrove-only", str(args.sizes[0])))
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or ROOT / "bench" / "results" / f"dedup-{dt.date.today().isoformat()}.json"
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()

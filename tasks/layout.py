"""Where a run's files live. Hive partitions (`run_date=.../run_id=...`) let pyarrow.dataset and
DuckDB read `data/`, `errors/` and `metrics/` across runs; `_attempts/` (skipped by readers
because of its leading underscore) holds files not yet committed.

    {root}/plan/run_date=D/run_id=R/plan.json
    {root}/manifests/{run_id}.{shard_id}.json      <- the commit point; lists the files below
    {root}/leases/{run_id}.{shard_id}.{n}.json     <- who generates the shard now (leases.py)
    {root}/_attempts/run_date=D/run_id=R/{shard_id}/{attempt}/{kind}.parquet
    {root}/{data,errors,metrics}/run_date=D/run_id=R/{shard_id}.parquet

A run with `filters` commits its shards' records to generated/ instead; its filter step
(filtering.py) then commits data/ (kept) and filtered/ (dropped) in one entry of the output's
filter log, and, for a dedup with scope output, the run's segment of the dedup index:

    {root}/generated/run_date=D/run_id=R/{shard_id}.parquet
    {root}/filter_log/{n}.json                     <- the commit point of one run's filter step
    {root}/_attempts/run_date=D/run_id=R/_filters/{attempt}/{kind}/{shard_id}.parquet
    {root}/filtered/run_date=D/run_id=R/{shard_id}.parquet
    {root}/dedup_index/{rule key}/{run_id}.parquet
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from fsspec import AbstractFileSystem

from schemas.run import RunConfig

PUBLISHED_KINDS = ("data", "generated", "errors", "metrics", "filtered")


@dataclass(frozen=True)
class RunLayout:
    fs: AbstractFileSystem
    root: str
    run_id: str
    run_date: str

    @classmethod
    def locate(cls, fs: AbstractFileSystem, root: str, run_id: str) -> RunLayout:
        """The layout of `run_id`: the date it was first planned on, else today (UTC)."""
        existing = sorted(fs.glob(f"{root}/plan/run_date=*/run_id={run_id}/plan.json"))
        if existing:
            run_date = existing[0].split("run_date=")[-1].split("/")[0]
        else:
            run_date = dt.datetime.now(dt.UTC).date().isoformat()
        return cls(fs=fs, root=root, run_id=run_id, run_date=run_date)

    def _partition(self, kind: str) -> str:
        return f"{self.root}/{kind}/run_date={self.run_date}/run_id={self.run_id}"

    @property
    def plan_path(self) -> str:
        return f"{self._partition('plan')}/plan.json"

    @property
    def manifests_glob(self) -> str:
        return f"{self.root}/manifests/{self.run_id}.*.json"

    def manifest(self, shard_id: str) -> str:
        return f"{self.root}/manifests/{self.run_id}.{shard_id}.json"

    def lease(self, shard_id: str, generation: int | str) -> str:
        return f"{self.root}/leases/{self.run_id}.{shard_id}.{generation}.json"

    def shard_id_of_manifest(self, path: str) -> str:
        return path.rsplit("/", 1)[-1].removeprefix(f"{self.run_id}.").removesuffix(".json")

    def attempt_dir(self, shard_id: str, attempt_id: str) -> str:
        return f"{self._partition('_attempts')}/{shard_id}/{attempt_id}"

    def published(self, kind: str, shard_id: str) -> str:
        return f"{self.root}/{self.relative_published(kind, shard_id)}"

    def relative_published(self, kind: str, shard_id: str) -> str:
        """What manifests list (relative to the root, so the output can be moved or mirrored)."""
        return f"{kind}/run_date={self.run_date}/run_id={self.run_id}/{shard_id}.parquet"

    def published_dir(self, kind: str) -> str:
        return self._partition(kind)

    @property
    def filter_log_glob(self) -> str:
        return f"{self.root}/filter_log/*.json"

    def filter_log_entry(self, number: int) -> str:
        return f"{self.root}/filter_log/{number:08d}.json"

    def filter_attempt_dir(self, attempt_id: str) -> str:
        return f"{self._partition('_attempts')}/_filters/{attempt_id}"

    def relative_index_segment(self, rule_key: str) -> str:
        return f"dedup_index/{rule_key}/{self.run_id}.parquet"


def run_layout(config: RunConfig) -> RunLayout:
    """Where the run that `config` determines keeps its files."""
    from tasks.storage import filesystem

    fs, root = filesystem(config.output, config.storage)
    return RunLayout.locate(fs, root, config.resolved_run_id())

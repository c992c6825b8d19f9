"""A run's filter step: once every shard is committed, split the run's generated records into
data/ (kept) and filtered/ (dropped, with the rule, the reason and what they duplicate), once.
The rules apply in `filters` order, each to the records the earlier ones kept: a keep rule
drops the records its comparison fails (tasks/filters.py), a dedup the duplicates among the
rest (tasks/dedup.py).

With filters, shards commit their records to generated/ (layout.py), which is never rewritten:
after the step, data/ and filtered/ hold each generated record exactly once between them. The
step is one commit for the whole run. It stages its files (and, for a dedup with scope output,
the run's segment of the output's dedup index) under _attempts/, then creates the next entry of
the output's filter log, filter_log/<n>.json, by conditional create. Each entry is created by
one run, so runs deduplicating against one index are applied one after the other: a run that
finds entry n taken reads it, decides again if it added to the run's index, and tries n + 1.
A run an entry names is applied: a rerun only finishes moving its staged files to their names
(idempotent), so a step killed anywhere and rerun never applies twice and never loses a record.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from schemas.arrow import DATA_SCHEMA, DEDUP_INDEX_SCHEMA, FILTERED_SCHEMA
from schemas.run import DedupFilter, KeepFilter, RunConfig
from tasks.commit import (
    CommittedFilesMissing,
    create_exclusive,
    move_staged,
    new_attempt_id,
    remove_dir,
    write_parquet,
)
from tasks.dedup import first_of_cluster, keys_of, rule_key, worker_count
from tasks.failures import RunFailed, is_io_error
from tasks.filters import drop_reason, parse, rule_json, upstream_of
from tasks.layout import RunLayout
from tasks.planning import Plan

IO_THREADS = 16  # files read, written and moved at once (S3 round trips overlap)
INDEX_BATCH_ROWS = 1 << 20  # index rows read at a time while looking for matching keys


def rule_name(number: int, rule: DedupFilter | KeepFilter) -> str:
    """How the log and `corpusgen plan` name a rule: its place in `filters` and its settings."""
    if isinstance(rule, KeepFilter):
        return f"filters[{number}] {rule.describe()}"
    threshold = f" threshold={rule.threshold:g}" if rule.method == "minhash" else ""
    return f"filters[{number}] dedup {rule.method}{threshold} scope={rule.scope}"


def read_log(layout: RunLayout) -> list[dict[str, Any]]:
    """The output's filter log, in entry order (one concurrent read on S3)."""
    layout.fs.invalidate_cache(layout.filter_log_entry(0).rsplit("/", 1)[0])
    paths = sorted(layout.fs.glob(layout.filter_log_glob))
    contents = layout.fs.cat(paths) if paths else {}
    return [json.loads(contents[path]) for path in paths]


def entry_of(log: list[dict[str, Any]], run_id: str) -> dict[str, Any] | None:
    return next((entry for entry in log if entry["run_id"] == run_id), None)


@dataclass(frozen=True)
class Drops:
    """What one rule dropped: positions in the run's records (plan order), for each why and,
    for a dedup, the record it duplicates (null for a keep rule)."""

    rule: str  # rule_name: the log's
    rule_json: str  # filtered/'s filter_rule
    kind: str  # keep or dedup
    positions: np.ndarray
    reasons: pa.Array
    duplicate_of: pa.Table  # duplicate_of_run_id, duplicate_of_id, duplicate_of_sample_index


@dataclass(frozen=True)
class Decision:
    drops: list[Drops]
    index: pa.Table | None  # the run's dedup index segment (scope output), else None
    index_rule_key: str | None


def _read_generated(layout: RunLayout, plan: Plan, chained: bool) -> list[pa.Table]:
    """Each shard's committed (id, sample_index, completion; a chain step's parent_id), in plan
    order."""
    columns = ["id", "sample_index", "completion", *(["parent_id"] if chained else [])]

    def read(shard_id: str) -> pa.Table:
        with layout.fs.open(layout.published("generated", shard_id), "rb") as file:
            return pq.read_table(file, columns=columns)

    with ThreadPoolExecutor(IO_THREADS) as pool:
        return list(pool.map(read, [shard.shard_id for shard in plan.shards]))


def _earlier_index(
    layout: RunLayout, log: list[dict[str, Any]], key: str, keys: np.ndarray
) -> tuple[np.ndarray, np.ndarray, pa.Table]:
    """The index rows of earlier runs that share a key with this run's records: their keys,
    node numbers (earlier runs in log order, records in their canonical order) and, per node,
    the record (run, id, sample_index)."""
    lows = pa.array(np.unique(keys[:, :, 1]))
    found = []
    for number, entry in enumerate(e for e in log if e["index_rule_key"] == key):
        path = f"{layout.root}/dedup_index/{key}/{entry['run_id']}.parquet"
        with layout.fs.open(path, "rb") as file:
            for batch in pq.ParquetFile(file).iter_batches(INDEX_BATCH_ROWS):
                matching = pa.Table.from_batches([batch]).filter(pc.is_in(batch["key_low"], lows))
                found.append(matching.append_column(
                    "segment", pa.array(np.full(matching.num_rows, number, np.int64)))
                    .append_column("run_id", pa.array([entry["run_id"]] * matching.num_rows)))
    if not found:
        empty = pa.table({"duplicate_of_run_id": pa.array([], pa.string()),
                          "duplicate_of_id": pa.array([], pa.string()),
                          "duplicate_of_sample_index": pa.array([], pa.int32())})
        return np.zeros((0, 2), np.uint64), np.zeros(0, np.int64), empty
    rows = pa.concat_tables(found)
    record = (rows["segment"].to_numpy() << 40) | rows["record"].to_numpy()
    _, first, nodes = np.unique(record, return_index=True, return_inverse=True)
    refs = rows.take(pa.array(first)).select(["run_id", "id", "sample_index"]).rename_columns(
        ["duplicate_of_run_id", "duplicate_of_id", "duplicate_of_sample_index"])
    keys_found = np.stack([rows["key_high"].to_numpy(), rows["key_low"].to_numpy()], axis=1)
    return keys_found, nodes, refs


def _dedup(
    layout: RunLayout, log: list[dict[str, Any]], number: int, rule: DedupFilter,
    records: pa.Table, order: np.ndarray, keys: np.ndarray,
) -> tuple[Drops, np.ndarray]:
    """One dedup rule over the records (`order`: their canonical order; `keys`: in that order).
    Returns what it drops and the canonical positions it keeps."""
    key = rule_key(rule.method, rule.threshold)
    earlier = log if rule.scope == "output" else []
    earlier_keys, earlier_nodes, refs = _earlier_index(layout, earlier, key, keys)
    first = first_of_cluster(keys, earlier_keys, earlier_nodes, refs.num_rows)
    own = refs.num_rows + np.arange(len(order))
    dropped = np.flatnonzero(first != own)
    ours = records.select(["id", "sample_index"]).take(pa.array(order))
    this_run = pa.table({
        "duplicate_of_run_id": pa.array([layout.run_id] * len(order), pa.string()),
        "duplicate_of_id": ours["id"], "duplicate_of_sample_index": ours["sample_index"]})
    targets = pa.concat_tables([refs.cast(this_run.schema), this_run])
    reason = "duplicate" if rule.method == "exact" else "near_duplicate"
    drops = Drops(rule_name(number, rule), rule_json(rule), "dedup", order[dropped],
                  pa.array([reason] * len(dropped), pa.string()),
                  targets.take(pa.array(first[dropped])))
    return drops, np.flatnonzero(first == own)


def _index_segment(records: pa.Table, order: np.ndarray, keys: np.ndarray,
                   kept: np.ndarray) -> pa.Table:
    """The keys of the records this run keeps, in canonical order: what later runs match."""
    per_record = keys.shape[1]
    ours = records.select(["id", "sample_index"]).take(pa.array(order[kept]))
    repeat = pa.array(np.repeat(np.arange(len(kept)), per_record))
    flat = keys[kept].reshape(-1, 2)
    return pa.table({
        "record": repeat,
        "id": ours["id"].take(repeat), "sample_index": ours["sample_index"].take(repeat),
        "key_high": flat[:, 0], "key_low": flat[:, 1],
    }, schema=DEDUP_INDEX_SCHEMA)


def canonical_order(records: pa.Table) -> np.ndarray:
    """Positions of the records sorted by (id, sample_index): the order that decides which
    record of a cluster is kept, whatever order the shards came in."""
    order = pc.sort_indices(records, [("id", "ascending"), ("sample_index", "ascending")])
    return order.to_numpy().astype(np.int64)


def record_keys(config: RunConfig, records: pa.Table, order: np.ndarray) -> dict[int, np.ndarray]:
    """Each dedup rule's keys for the records, in canonical order: the costly part, done once."""
    dedups = {number: rule for number, rule in enumerate(config.filters)
              if isinstance(rule, DedupFilter)}
    if not dedups:
        return {}
    texts = records["completion"].take(pa.array(order)).fill_null("").to_pylist()
    return {number: keys_of(texts, rule.method, rule.threshold, worker_count())
            for number, rule in dedups.items()}


def keep_reasons(config: RunConfig, records: pa.Table) -> dict[int, list[str | None]]:
    """Each keep rule's verdict on every record (plan order): why it drops it, or None. A rule
    judges each record alone, so this is done once, whatever the log holds."""
    keeps = {number: rule for number, rule in enumerate(config.filters)
             if isinstance(rule, KeepFilter)}
    if not keeps:
        return {}
    parsed = [parse(text) for text in records["completion"].to_pylist()]
    upstream = upstream_of(config, records)
    return {number: [drop_reason(rule, value, fields)
                     for value, fields in zip(parsed, upstream, strict=True)]
            for number, rule in keeps.items()}


def _keep(number: int, rule: KeepFilter, reasons: list[str | None],
          alive: np.ndarray) -> Drops:
    dropped = np.flatnonzero(alive & np.array([reason is not None for reason in reasons], bool))
    nulls = pa.nulls(len(dropped))
    return Drops(rule_name(number, rule), rule_json(rule), "keep", dropped,
                 pa.array([reasons[i] for i in dropped], pa.string()),
                 pa.table({"duplicate_of_run_id": nulls.cast(pa.string()),
                           "duplicate_of_id": nulls.cast(pa.string()),
                           "duplicate_of_sample_index": nulls.cast(pa.int32())}))


def decide(
    config: RunConfig, layout: RunLayout, log: list[dict[str, Any]], records: pa.Table,
    order: np.ndarray, keys: dict[int, np.ndarray],
    reasons: dict[int, list[str | None]] | None = None,
) -> Decision:
    """What each rule drops, in `filters` order, each seeing only the records the earlier
    rules kept, given the log so far. `records`: the run's (id, sample_index) in plan order;
    `order`: canonical_order; `keys[i]`: dedup rule i's keys in canonical order; `reasons[i]`:
    keep rule i's keep_reasons."""
    drops, index, index_rule_key = [], None, None
    alive = np.ones(records.num_rows, bool)  # plan order: kept by every rule so far
    for number, rule in enumerate(config.filters):
        if isinstance(rule, KeepFilter):
            dropped = _keep(number, rule, (reasons or {})[number], alive)
        else:
            seen = np.flatnonzero(alive[order])  # canonical positions still kept
            dropped, kept = _dedup(layout, log, number, rule, records, order[seen],
                                   keys[number][seen])
            if rule.scope == "output":
                index_rule_key = rule_key(rule.method, rule.threshold)
                index = _index_segment(records, order[seen], keys[number][seen], kept)
        alive[dropped.positions] = False
        drops.append(dropped)
    return Decision(drops, index, index_rule_key)


def _stage(layout: RunLayout, plan: Plan, starts: np.ndarray, attempt_id: str,
           decision: Decision) -> list[dict]:
    """Write every file of the decision under the attempt's folder, a shard at a time
    (`starts[i]`: shard i's first position). Returns the files as the log entry lists them:
    kind, published path (relative to the root), rows, bytes."""
    fs, attempt_dir = layout.fs, layout.filter_attempt_dir(attempt_id)
    shards = [shard.shard_id for shard in plan.shards]
    orders = [np.argsort(drops.positions) for drops in decision.drops]  # to find a shard's
    positions = [drops.positions[order] for drops, order in zip(decision.drops, orders,
                                                                strict=True)]  # by bisection

    def write(i: int) -> list[dict]:
        with fs.open(layout.published("generated", shards[i]), "rb") as file:
            generated = pq.read_table(file, schema=DATA_SCHEMA)
        dropped, parts = np.zeros(generated.num_rows, bool), []
        for drops, ordered, sorted_positions in zip(decision.drops, orders, positions,
                                                    strict=True):
            low, high = np.searchsorted(sorted_positions, starts[i : i + 2])
            mine = ordered[low:high]
            dropped[drops.positions[mine] - starts[i]] = True
            rows = generated.take(pa.array(drops.positions[mine] - starts[i]))
            parts.append(pa.table({
                **{name: rows[name] for name in DATA_SCHEMA.names},
                "filter_rule": pa.array([drops.rule_json] * len(mine), pa.string()),
                "filter_reason": drops.reasons.take(pa.array(mine)),
                **_columns(drops.duplicate_of.take(pa.array(mine))),
            }, schema=FILTERED_SCHEMA))
        kept = generated.filter(pa.array(~dropped))
        filtered = pa.concat_tables(parts) if parts else FILTERED_SCHEMA.empty_table()
        return [_write(fs, attempt_dir, kind, layout.relative_published(kind, shards[i]), table)
                for kind, table in (("data", kept), ("filtered", filtered))]

    with ThreadPoolExecutor(IO_THREADS) as pool:
        files = [file for pair in pool.map(write, range(len(shards))) for file in pair]
    if decision.index is not None:
        files.append(_write(fs, attempt_dir, "index",
                            layout.relative_index_segment(decision.index_rule_key),
                            decision.index))
    return files


def _columns(table: pa.Table) -> dict[str, pa.ChunkedArray]:
    return dict(zip(table.column_names, table.columns, strict=True))


def _staged_path(attempt_dir: str, kind: str, path: str) -> str:
    return f"{attempt_dir}/{kind}/{path.rsplit('/', 1)[-1]}"


def _write(fs, attempt_dir: str, kind: str, path: str, table: pa.Table) -> dict[str, Any]:
    size = write_parquet(fs, _staged_path(attempt_dir, kind, path), table)
    return {"kind": kind, "path": path, "rows": table.num_rows, "bytes": size}


def _entry(layout: RunLayout, number: int, attempt_id: str, config: RunConfig,
           decision: Decision, files: list[dict], records: int, seconds: float) -> dict:
    filtered = sum(len(drops.positions) for drops in decision.drops)
    return {
        "number": number,
        "run_id": layout.run_id,
        "run_date": layout.run_date,
        "attempt_id": attempt_id,
        "filters": [rule.model_dump(mode="json") for rule in config.filters],
        "index_rule_key": decision.index_rule_key,
        "input_rows": records,
        "kept_rows": records - filtered,
        "filtered_rows": filtered,
        "duplicate_rows": sum(len(d.positions) for d in decision.drops if d.kind == "dedup"),
        "dropped": [{"rule": d.rule, "kind": d.kind, "rows": len(d.positions)}
                    for d in decision.drops],
        "seconds": round(seconds, 3),
        "committed_at": dt.datetime.now(dt.UTC).isoformat(),
        "files": files,
    }


def _commit(config: RunConfig, layout: RunLayout, plan: Plan,
            log: list[dict[str, Any]]) -> dict[str, Any]:
    """Decide, stage and create the next log entry; on a lost race, decide again only when the
    winner added to this run's index."""
    started = time.monotonic()
    from tasks.chains import is_chained

    shards = _read_generated(layout, plan, is_chained(config))
    starts = np.cumsum([0] + [table.num_rows for table in shards])
    records = pa.concat_tables(shards)
    order = canonical_order(records)
    keys = record_keys(config, records, order)
    reasons = keep_reasons(config, records)
    records = records.select(["id", "sample_index"])
    number = log[-1]["number"] + 1 if log else 0
    attempt_id = None
    while True:
        if attempt_id is None:
            attempt_id = new_attempt_id()
            decision = decide(config, layout, log, records, order, keys, reasons)
            files = _stage(layout, plan, starts, attempt_id, decision)
        entry = _entry(layout, number, attempt_id, config, decision, files, records.num_rows,
                       time.monotonic() - started)
        if create_exclusive(layout.fs, layout.filter_log_entry(number), json.dumps(entry).encode()):
            return entry
        winner = json.loads(layout.fs.cat_file(layout.filter_log_entry(number)))
        if winner["run_id"] == layout.run_id:  # another process of this run got there first
            remove_dir(layout.fs, layout.filter_attempt_dir(attempt_id))
            return winner
        log, number = [*log, winner], number + 1
        if decision.index_rule_key is not None and winner["index_rule_key"] == (
                decision.index_rule_key):
            remove_dir(layout.fs, layout.filter_attempt_dir(attempt_id))
            attempt_id = None


def publish_filters(layout: RunLayout, entry: dict[str, Any]) -> None:
    """Move the entry's staged files to their names, then drop the run's other filter attempts
    (they can never commit). Safe to repeat, and beside another process doing the same."""
    fs, attempt_dir = layout.fs, layout.filter_attempt_dir(entry["attempt_id"])

    def move(file: dict[str, Any]) -> bool:
        return move_staged(fs, _staged_path(attempt_dir, file["kind"], file["path"]),
                           f"{layout.root}/{file['path']}")

    with ThreadPoolExecutor(IO_THREADS) as pool:
        moved = list(pool.map(move, entry["files"]))
    missing = [file["path"] for file, ok in zip(entry["files"], moved, strict=True) if not ok]
    if missing:
        raise CommittedFilesMissing(
            f"run {layout.run_id}'s filters are committed (filter_log entry {entry['number']}) "
            f"but {len(missing)} file(s) are neither staged nor published, e.g. {missing[0]}"
        )
    remove_dir(fs, attempt_dir.rsplit("/", 1)[0])


def verify_filters(layout: RunLayout, entry: dict[str, Any]) -> list[str]:
    """Each published file of the entry has the bytes the entry records."""
    fs = layout.fs
    folders = {f"{layout.root}/{file['path']}".rsplit("/", 1)[0] for file in entry["files"]}
    fs.invalidate_cache()
    sizes = {path: info["size"] for folder in folders
             for path, info in fs.find(folder, detail=True).items()}
    problems = []
    for file in entry["files"]:
        path = f"{layout.root}/{file['path']}"
        if sizes.get(path) != file["bytes"]:
            problems.append(f"{path} has {sizes.get(path, 'no')} bytes, the filter log "
                            f"{file['bytes']}")
    return problems


def apply_filters(config: RunConfig, layout: RunLayout, plan: Plan) -> dict[str, Any]:
    """The run's filter log entry, committed now or by an earlier attempt, and published."""
    log = read_log(layout)
    entry = entry_of(log, layout.run_id) or _commit(config, layout, plan, log)
    publish_filters(layout, entry)
    problems = verify_filters(layout, entry)
    if problems:
        raise RunFailed(f"run {layout.run_id}: its filtered files are not intact: "
                        + "; ".join(problems[:3]))
    return entry


@task(name="filter-run", cache_policy=NO_CACHE, retry_condition_fn=is_io_error)
def filter_run(config: RunConfig, layout: RunLayout, plan: Plan) -> dict[str, Any]:
    """Apply the run's filters once every shard is committed (see apply_filters); a retry
    after a storage hiccup resumes where the attempt stopped."""
    return apply_filters(config, layout, plan)


def describe_filters(config: RunConfig, layout: RunLayout) -> list[str]:
    """What `corpusgen plan` says about the filters: what each drops, against what, and what a
    committed filter step kept."""
    log = read_log(layout)
    lines = []
    for number, rule in enumerate(config.filters):
        if isinstance(rule, KeepFilter):
            lines.append(f"{rule_name(number, rule)}: keeps the records the comparison holds for "
                         "(this run's structured record first, then the upstream record)")
            continue
        what = ("identical normalised completions" if rule.method == "exact" else
                f"near-duplicate completions (Jaccard of 3-word shingles >= ~{rule.threshold:g})")
        against = "within the run"
        if rule.scope == "output":
            key = rule_key(rule.method, rule.threshold)
            earlier = [e for e in log if e["index_rule_key"] == key and
                       e["run_id"] != layout.run_id]
            against = (f"within the run and against the {sum(e['kept_rows'] for e in earlier):,}"
                       f" records {len(earlier)} earlier run(s) kept (dedup_index/{key}/)")
        lines.append(f"{rule_name(number, rule)}: drops {what} {against}, keeping the smallest "
                     "(id, sample_index) of each cluster")
    lines.append("each rule sees the records the earlier ones kept; kept records go to data/, "
                 "dropped ones to filtered/ with the rule and why (a duplicate: the record it "
                 "duplicates); generated/ holds every record as generated")
    if (entry := entry_of(log, layout.run_id)) is not None:
        lines.append(f"filters already applied (filter_log entry {entry['number']}): kept "
                     f"{entry['kept_rows']:,} of {entry['input_rows']:,}, filtered "
                     f"{entry['filtered_rows']:,}")
    return lines

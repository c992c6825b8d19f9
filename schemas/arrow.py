"""Arrow schemas of the datasets corpusgen writes. The metrics schema is the stable contract
that reports and BI tools read; add columns at the end, never rename or retype one.
"""

from __future__ import annotations

import pyarrow as pa

INPUT_OFFSET_DOC = (
    "where the record starts in its input file (the shard's source): byte offset of its JSONL "
    "line (in the decompressed text for .gz), or row number (Parquet)"
)

DATA_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("shard_id", pa.string(), nullable=False),
        pa.field("prompt", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("proposed", pa.int32()),
        pa.field("accepted", pa.int32()),
        pa.field("seed", pa.int64()),
        pa.field("sample_index", pa.int32(), metadata={"doc": "0..samples_per_prompt-1"}),
        pa.field(
            "token_logprobs",
            pa.list_(pa.float32()),
            metadata={"doc": "with sampling.logprobs: each kept token's log-probability under "
                             "the distribution sampled (temperature, top-k/p, mask applied)"},
        ),
        pa.field("mean_logprob", pa.float64(), metadata={"doc": "mean of token_logprobs"}),
        pa.field("input_offset", pa.int64(), metadata={"doc": INPUT_OFFSET_DOC}),
        pa.field("input_prompt", pa.string(), metadata={
            "doc": "the prompt as the input record made it, before the chat template (a chat: "
                   "its messages as JSON); a chain step's {prompt}"}),
        pa.field("parent_id", pa.string(), metadata={
            "doc": "a chain step: the upstream record's id (join on the upstream data's id)"}),
        pa.field("parent_run_id", pa.string(), metadata={
            "doc": "a chain step: the upstream run the record came from"}),
    ]
)

# What a run's filters dropped (filtered/): the record as generated, then which rule dropped it,
# why, and for a duplicate the record it duplicates (the one its cluster kept).
FILTERED_SCHEMA = pa.schema(
    [
        *DATA_SCHEMA,
        pa.field(
            "filter_rule", pa.string(), nullable=False,
            metadata={"doc": "the filters entry that dropped it, as JSON, e.g. {\"field\": "
                             "\"score\", \"kind\": \"keep\", \"op\": \">=\", \"value\": 3}"},
        ),
        pa.field(
            "filter_reason", pa.string(), nullable=False,
            metadata={"doc": "dedup: duplicate (exact) or near_duplicate (minhash); keep: the "
                             "value it saw, e.g. score is 2, not >= 3"},
        ),
        pa.field(
            "duplicate_of_run_id", pa.string(),
            metadata={"doc": "dedup: run of the kept record it duplicates (this run or an "
                             "earlier one); null for keep"},
        ),
        pa.field("duplicate_of_id", pa.string(), metadata={"doc": "id of that kept record"}),
        pa.field("duplicate_of_sample_index", pa.int32(), metadata={"doc": "its sample_index"}),
    ]
)

# One run's segment of a dedup index (scope output): a key row per key of each record it kept.
DEDUP_INDEX_SCHEMA = pa.schema(
    [
        pa.field("record", pa.int64(), nullable=False),  # canonical position among kept records
        pa.field("id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("key_high", pa.uint64(), nullable=False),
        pa.field("key_low", pa.uint64(), nullable=False),
    ]
)

ERRORS_SCHEMA = pa.schema(
    [
        pa.field("shard_id", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False, metadata={"doc": "row index within the shard"}),
        pa.field("id", pa.string()),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("raw", pa.string(), metadata={"doc": "the offending value, truncated"}),
        pa.field("input_offset", pa.int64(), metadata={"doc": INPUT_OFFSET_DOC}),
    ]
)

METRICS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("shard_id", pa.string(), nullable=False),
        pa.field("worker_id", pa.string(), metadata={"doc": "host:pid of the process"}),
        pa.field("input_rows", pa.int64()),
        pa.field("ok_rows", pa.int64()),
        pa.field("error_rows", pa.int64()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("generated_tokens", pa.int64()),
        pa.field("padding_waste", pa.float64(), metadata={"doc": "padded / computed token slots"}),
        pa.field("prefill_padding_waste", pa.float64(),
                 metadata={"doc": "padding_waste of prefills (prompts run packed)"}),
        pa.field("decode_padding_waste", pa.float64(),
                 metadata={"doc": "padding_waste of decode and verify forwards (idle rows)"}),
        pa.field("batch_bucket", pa.int32(), metadata={"doc": "largest batch bucket used"}),
        pa.field("draft_kind", pa.string(), metadata={"doc": "none|model|quantized|prompt_lookup"}),
        pa.field("rounds", pa.int64(), metadata={"doc": "speculation rounds (row-rounds)"}),
        pa.field("proposed", pa.int64(), metadata={"doc": "draft tokens proposed"}),
        pa.field("accepted", pa.int64(), metadata={"doc": "draft tokens accepted"}),
        pa.field("acceptance_rate", pa.float64(), metadata={"doc": "accepted / proposed"}),
        pa.field("mean_accepted_length", pa.float64(), metadata={"doc": "1 + accepted / rounds"}),
        pa.field(
            "accepted_per_position",
            pa.list_(pa.int64()),
            metadata={"doc": "accepted count at draft position i (i=0..K-1)"},
        ),
        pa.field(
            "proposed_per_position",
            pa.list_(pa.int64()),
            metadata={"doc": "proposed count at draft position i; ratio = per-position rate"},
        ),
        pa.field("target_forwards", pa.int64()),
        pa.field("draft_forwards", pa.int64()),
        pa.field("distinct_shapes", pa.int64()),
        pa.field("prefill_seconds", pa.float64()),
        pa.field("decode_seconds", pa.float64()),
        pa.field("draft_seconds", pa.float64()),
        pa.field("verify_seconds", pa.float64()),
        pa.field(
            "wall_seconds",
            pa.float64(),
            metadata={"doc": "seconds the shard held the engine, its load excluded"},
        ),
        pa.field("tokens_per_second", pa.float64(), metadata={"doc": "generated / wall seconds"}),
        pa.field("device_type", pa.string(), metadata={"doc": "pricing key, e.g. gaudi2, cpu"}),
        pa.field("device_count", pa.int32()),
        pa.field("device_seconds", pa.float64(), metadata={"doc": "wall_seconds x device_count"}),
        pa.field("price_per_device_hour", pa.float64()),
        pa.field("cost", pa.float64(), metadata={"doc": "device_seconds / 3600 x price"}),
        pa.field(
            "cost_per_1m_tokens", pa.float64(), metadata={"doc": "cost / generated_tokens x 1e6"}
        ),
        pa.field("engine_version", pa.string()),
        pa.field("target_model", pa.string()),
        pa.field("target_weights_sha256", pa.string()),
        pa.field("draft_model", pa.string()),
        pa.field("draft_weights_sha256", pa.string()),
        pa.field("config_hash", pa.string()),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
        pa.field(
            "empty_completions", pa.int64(), metadata={"doc": "ok rows whose completion is blank"}
        ),
        pa.field(
            "looping_completions", pa.int64(),
            metadata={"doc": "ok rows whose completion ends in a loop (max_looping_fraction)"},
        ),
        pa.field(
            "error_reasons",
            pa.list_(pa.struct([("reason", pa.string()), ("rows", pa.int64())])),
            metadata={"doc": "error rows per reason class (the reason up to its first colon)"},
        ),
        pa.field(
            "engine_load_seconds",
            pa.float64(),
            metadata={"doc": "engine load + warm-up, on the shard that loaded it (else 0)"},
        ),
        pa.field(
            "engine_load_cost",
            pa.float64(),
            metadata={"doc": "engine_load_seconds x device_count / 3600 x price"},
        ),
        pa.field("worker_name", pa.string(), metadata={"doc": "Prefect worker, else host name"}),
        pa.field(
            "device_card",
            pa.string(),
            metadata={"doc": "HABANA_VISIBLE_MODULES / CUDA_VISIBLE_DEVICES of the worker"},
        ),
        pa.field("flow_run_id", pa.string(), metadata={"doc": "Prefect flow run of the shard"}),
        pa.field(
            "sampling_params",
            pa.string(),
            metadata={"doc": "JSON: generation.sampling + samples_per_prompt"},
        ),
        pa.field(
            "chat_template",
            pa.string(),
            metadata={"doc": "chat: prompts sent through the chat template; raw: as text"},
        ),
        pa.field(
            "plain_seconds_estimate",
            pa.float64(),
            metadata={"doc": "wall_seconds had the shard decoded plain (estimate; null: unknown)"},
        ),
        pa.field(
            "plain_cost_estimate",
            pa.float64(),
            metadata={"doc": "plain_seconds_estimate x device_count / 3600 x price"},
        ),
        pa.field(
            "cpu_kernels",
            pa.string(),
            metadata={"doc": "linear kernels each model ran on CPU, e.g. "
                             "target=onednn-packed-bf16 draft=fbgemm-int8; null off CPU"},
        ),
        pa.field("cpu_model", pa.string(), metadata={"doc": "the worker's CPU model name"}),
        pa.field(
            "cpu_isa",
            pa.string(),
            metadata={"doc": "torch's vector ISA level and extensions, e.g. AVX2 avx2"},
        ),
        pa.field(
            "cache_full_rows",
            pa.int64(),
            metadata={"doc": "ok rows cut by the largest cache bucket (finish_reason cache_full)"},
        ),
        pa.field(
            "partial_character_rows",
            pa.int64(),
            metadata={"doc": "ok rows cut mid multi-byte character: that character was dropped"},
        ),
        pa.field(
            "structured_rows",
            pa.int64(),
            metadata={"doc": "data rows validated under generation.response_format (else null)"},
        ),
        pa.field(
            "structured_incomplete",
            pa.int64(),
            metadata={"doc": "error rows cut before their structured value closed"},
        ),
    ]
)

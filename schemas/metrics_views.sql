-- corpusgen metrics views: the SQL a BI tool (Grafana, Superset, Metabase, a DuckDB shell) can
-- point at. `corpusgen report OUTPUT_URI --views` prints this file with {output_uri} filled in.
-- Only committed shards count: a shard is committed when <output_uri>/manifests/<run_id>.<shard_id>.json
-- exists, and only the metrics files that manifest lists are its metrics (a retried attempt's
-- leftover files are ignored).

-- @section source
CREATE OR REPLACE VIEW committed_manifests AS
SELECT shard_id, run_id, attempt_id, unnest(files.metrics) AS metrics_file
FROM read_json('{output_uri}/manifests/*.json', union_by_name = true);

CREATE OR REPLACE VIEW committed_metrics AS
SELECT m.* EXCLUDE (filename),
       CAST(regexp_extract(m.filename, 'run_date=(\d{4}-\d{2}-\d{2})', 1) AS DATE) AS run_date
FROM read_parquet('{output_uri}/metrics/*/*/*.parquet', filename = true, union_by_name = true) AS m
WHERE m.filename IN (SELECT '{output_uri}/' || metrics_file FROM committed_manifests);

-- What the derived views read; a report narrows it to the runs/dates asked for.
CREATE OR REPLACE VIEW metrics AS SELECT * FROM committed_metrics;

-- @section filters
-- What each run's filters kept and dropped, from the output's filter log (one entry per run whose
-- filters were applied; a report over an output without one gets an empty table instead).
CREATE OR REPLACE TABLE filter_stats AS
SELECT * FROM read_json('{output_uri}/filter_log/*.json', columns = {
    run_id: 'VARCHAR', input_rows: 'BIGINT', kept_rows: 'BIGINT', filtered_rows: 'BIGINT',
    duplicate_rows: 'BIGINT'});

-- @section derived
-- The one cost formula, schemas/pricing.py's device_cost (a test pins the two together).
CREATE OR REPLACE MACRO device_cost(seconds, devices, usd_per_hour) AS
    seconds * devices / 3600 * usd_per_hour;

-- Report-time prices ($ per device-hour) that replace the price recorded at run time.
CREATE TABLE IF NOT EXISTS price_overrides (device_type VARCHAR PRIMARY KEY, usd_per_hour DOUBLE NOT NULL);

-- Empty unless the filters section read a filter log.
CREATE TABLE IF NOT EXISTS filter_stats (
    run_id VARCHAR, input_rows BIGINT, kept_rows BIGINT, filtered_rows BIGINT,
    duplicate_rows BIGINT);

-- One row per committed shard, with cost recomputed at the report's prices.
CREATE OR REPLACE VIEW shard_costs AS
SELECT m.*,
       coalesce(o.usd_per_hour, m.price_per_device_hour) AS report_price_per_device_hour,
       device_cost(m.device_seconds, 1, coalesce(o.usd_per_hour, m.price_per_device_hour))
           AS report_cost,
       device_cost(m.device_seconds, 1, coalesce(o.usd_per_hour, m.price_per_device_hour))
           / nullif(m.generated_tokens, 0) * 1e6 AS report_cost_per_1m_tokens,
       -- what plain decoding would have cost (null where the run could not estimate it)
       device_cost(m.plain_seconds_estimate, m.device_count,
                   coalesce(o.usd_per_hour, m.price_per_device_hour)) AS report_plain_cost,
       o.usd_per_hour IS NOT NULL AS repriced,
       -- engine load + warm-up, billed apart from the shard that happened to load the engine
       device_cost(m.engine_load_seconds, m.device_count,
                   coalesce(o.usd_per_hour, m.price_per_device_hour)) AS report_engine_load_cost,
       -- "target <- draft" by file name (the draft model for kind=model, else the kind), for legends
       regexp_extract(m.target_model, '[^/]+$') || ' <- '
           || CASE WHEN m.draft_kind = 'model' THEN regexp_extract(m.draft_model, '[^/]+$')
                   ELSE m.draft_kind END AS model_pair
FROM metrics AS m LEFT JOIN price_overrides AS o ON o.device_type = m.device_type;

-- Totals per run, per model pair x draft kind x device type, and overall (level column says which).
-- Ratios are ratios of sums (token-weighted), never means of shard ratios.
CREATE OR REPLACE VIEW cost_rollup AS
SELECT CASE WHEN grouping(run_id) = 0 THEN 'run'
            WHEN grouping(target_model) = 0 THEN 'model_pair'
            ELSE 'total' END AS level,
       run_id, target_model, draft_model, draft_kind, device_type,
       min(run_date) AS run_date,
       min(started_at) AS started_at,
       max(finished_at) AS finished_at,
       count(*) AS shards,
       sum(input_rows) AS input_rows,
       sum(ok_rows) AS ok_rows,
       sum(error_rows) AS error_rows,
       sum(prompt_tokens) AS prompt_tokens,
       sum(generated_tokens) AS generated_tokens,
       sum(wall_seconds) AS wall_seconds,
       sum(device_seconds) AS device_seconds,
       sum(report_cost) AS cost,
       sum(report_cost) / nullif(sum(generated_tokens), 0) * 1e6 AS cost_per_1m_tokens,
       sum(generated_tokens) / nullif(sum(wall_seconds), 0) AS tokens_per_second,
       sum(proposed) AS proposed,
       sum(accepted) AS accepted,
       sum(accepted) / nullif(sum(proposed), 0) AS acceptance_rate,
       1 + sum(accepted) / nullif(sum(rounds), 0) AS mean_accepted_length,
       sum(padding_waste * (prompt_tokens + generated_tokens))
           / nullif(sum(prompt_tokens + generated_tokens), 0) AS padding_waste,
       -- speculation payoff, over the shards that have a plain estimate
       count(plain_seconds_estimate) AS estimated_shards,
       sum(report_plain_cost) AS plain_cost_estimate,
       sum(report_plain_cost) - sum(report_cost) FILTER (WHERE report_plain_cost IS NOT NULL) AS cost_saved,
       sum(plain_seconds_estimate * device_count)
           / nullif(sum(device_seconds) FILTER (WHERE plain_seconds_estimate IS NOT NULL), 0)
           AS speedup_vs_plain,
       string_agg(DISTINCT device_type, ',' ORDER BY device_type) AS device_types,
       string_agg(DISTINCT draft_kind, ',' ORDER BY draft_kind) AS draft_kinds,
       string_agg(DISTINCT model_pair, ', ' ORDER BY model_pair) AS model_pairs,
       sum(empty_completions) AS empty_completions,
       sum(looping_completions) AS looping_completions,
       coalesce(sum(engine_load_seconds), 0) AS engine_load_seconds,
       coalesce(sum(report_engine_load_cost), 0) AS engine_load_cost,
       -- generation (shard) cost + engine load cost: what the run spent in all
       sum(report_cost) + coalesce(sum(report_engine_load_cost), 0) AS total_cost,
       (sum(report_cost) + coalesce(sum(report_engine_load_cost), 0))
           / nullif(sum(generated_tokens), 0) * 1e6 AS total_cost_per_1m_tokens
FROM shard_costs
GROUP BY GROUPING SETS ((run_id), (target_model, draft_model, draft_kind, device_type), ());

-- Each filtered run's outcome: rates are of the generated records the filters judged.
CREATE OR REPLACE VIEW filter_outcome AS
SELECT run_id, kept_rows, filtered_rows, duplicate_rows,
       kept_rows / nullif(input_rows, 0) AS kept_rate,
       filtered_rows / nullif(input_rows, 0) AS filtered_rate,
       duplicate_rows / nullif(input_rows, 0) AS duplicate_rate
FROM filter_stats;

-- The rollup with each run row's filter outcome (NULL for runs without filters): `--format csv`.
CREATE OR REPLACE VIEW rollup_with_filters AS
SELECT r.*, f.* EXCLUDE (run_id)
FROM cost_rollup AS r LEFT JOIN filter_outcome AS f ON r.level = 'run' AND f.run_id = r.run_id;

CREATE OR REPLACE VIEW run_summary AS
SELECT * EXCLUDE (level, target_model, draft_model, draft_kind, device_type)
FROM rollup_with_filters WHERE level = 'run' ORDER BY started_at, run_id;

CREATE OR REPLACE VIEW model_pair_summary AS
SELECT * EXCLUDE (level, run_id, device_types, draft_kinds, model_pairs)
FROM cost_rollup WHERE level = 'model_pair' ORDER BY cost_per_1m_tokens;

-- Acceptance by draft position (0 = first drafted token), per run and over all runs (run_id NULL).
CREATE OR REPLACE VIEW position_acceptance AS
WITH positions AS (
    SELECT run_id,
           generate_subscripts(proposed_per_position, 1) - 1 AS position,
           unnest(accepted_per_position) AS accepted,
           unnest(proposed_per_position) AS proposed
    FROM metrics
)
SELECT CASE WHEN grouping(run_id) = 0 THEN 'run' ELSE 'total' END AS level,
       run_id, position, sum(accepted) AS accepted, sum(proposed) AS proposed,
       sum(accepted) / nullif(sum(proposed), 0) AS acceptance_rate
FROM positions
GROUP BY GROUPING SETS ((run_id, position), (position))
ORDER BY level, run_id, position;

-- Throughput by the largest batch bucket a shard used (per shard task, i.e. per worker).
CREATE OR REPLACE VIEW bucket_throughput AS
SELECT device_type, draft_kind, batch_bucket, count(*) AS shards,
       sum(generated_tokens) AS generated_tokens, sum(wall_seconds) AS wall_seconds,
       sum(generated_tokens) / nullif(sum(wall_seconds), 0) AS tokens_per_second
FROM metrics
GROUP BY device_type, draft_kind, batch_bucket
ORDER BY device_type, draft_kind, batch_bucket;

-- Error rows by reason class, per run and over all runs (run_id NULL), most frequent first.
CREATE OR REPLACE VIEW error_reasons AS
WITH reasons AS (
    SELECT run_id, unnest(error_reasons) AS item FROM metrics
)
SELECT CASE WHEN grouping(run_id) = 0 THEN 'run' ELSE 'total' END AS level,
       run_id, item.reason AS reason, sum(item.rows) AS rows
FROM reasons
GROUP BY GROUPING SETS ((run_id, item.reason), (item.reason))
ORDER BY level, run_id, rows DESC, reason;

-- Every committed shard, costliest first.
CREATE OR REPLACE VIEW costliest_shards AS
SELECT run_id, shard_id, device_type, draft_kind, model_pair, generated_tokens, error_rows,
       wall_seconds, tokens_per_second, proposed, accepted / nullif(proposed, 0) AS acceptance_rate,
       padding_waste,
       report_cost AS cost, report_cost_per_1m_tokens AS cost_per_1m_tokens,
       report_plain_cost AS plain_cost_estimate, report_plain_cost - report_cost AS cost_saved,
       plain_seconds_estimate / nullif(wall_seconds, 0) AS speedup_vs_plain
FROM shard_costs
ORDER BY report_cost DESC NULLS LAST, run_id, shard_id;

-- Trends: one row per run x series (target x draft x draft kind x device type), oldest first,
-- against the median of the same series' previous (up to) 7 runs. A run is a regression when,
-- with at least 3 previous runs, it is more than 20 % worse than that median on cost per 1M
-- tokens (higher), tokens/s (lower) or acceptance (lower); `regression` says which and by how much.
CREATE OR REPLACE VIEW run_trends AS
WITH per_run AS (
    SELECT run_id, target_model, draft_model, draft_kind, device_type,
           any_value(model_pair) AS model_pair,
           any_value(model_pair) || ' · ' || device_type AS series,
           min(run_date) AS run_date, min(started_at) AS started_at,
           count(*) AS shards, sum(generated_tokens) AS generated_tokens,
           sum(report_cost) AS cost,
           sum(report_cost) / nullif(sum(generated_tokens), 0) * 1e6 AS cost_per_1m_tokens,
           sum(generated_tokens) / nullif(sum(wall_seconds), 0) AS tokens_per_second,
           sum(accepted) / nullif(sum(proposed), 0) AS acceptance_rate,
           sum(report_plain_cost) - sum(report_cost) FILTER (WHERE report_plain_cost IS NOT NULL)
               AS cost_saved,
           sum(plain_seconds_estimate * device_count)
               / nullif(sum(device_seconds) FILTER (WHERE plain_seconds_estimate IS NOT NULL), 0)
               AS speedup_vs_plain
    FROM shard_costs
    GROUP BY run_id, target_model, draft_model, draft_kind, device_type
), baselines AS (
    SELECT *,
           count(*) OVER previous AS baseline_runs,
           median(cost_per_1m_tokens) OVER previous AS baseline_cost_per_1m_tokens,
           median(tokens_per_second) OVER previous AS baseline_tokens_per_second,
           median(acceptance_rate) OVER previous AS baseline_acceptance_rate
    FROM per_run
    WINDOW previous AS (
        PARTITION BY target_model, draft_model, draft_kind, device_type
        ORDER BY started_at, run_id ROWS BETWEEN 7 PRECEDING AND 1 PRECEDING)
), changes AS (
    SELECT *,
           cost_per_1m_tokens / nullif(baseline_cost_per_1m_tokens, 0) - 1 AS cost_change,
           tokens_per_second / nullif(baseline_tokens_per_second, 0) - 1 AS throughput_change,
           acceptance_rate / nullif(baseline_acceptance_rate, 0) - 1 AS acceptance_change
    FROM baselines
)
SELECT *,
       nullif(concat_ws('; ',
           CASE WHEN baseline_runs >= 3 AND cost_change > 0.2
                THEN printf('cost/1M tokens %+.0f%%', 100 * cost_change) END,
           CASE WHEN baseline_runs >= 3 AND throughput_change < -0.2
                THEN printf('tokens/s %+.0f%%', 100 * throughput_change) END,
           CASE WHEN baseline_runs >= 3 AND acceptance_change < -0.2
                THEN printf('acceptance %+.0f%%', 100 * acceptance_change) END
       ), '') AS regression
FROM changes
ORDER BY started_at, run_id, series;

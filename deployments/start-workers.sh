#!/usr/bin/env bash
# Start one Prefect worker per card (or group of cards) on this Gaudi host, in the foreground.
# Each worker takes one flow run at a time (--limit 1) and its flow-run processes inherit its
# HABANA_VISIBLE_MODULES, so every shard batch owns its card(s). Ctrl-C / SIGTERM stops them all.
#
#   deployments/start-workers.sh [CARDS=8] [CARDS_PER_WORKER=1]
#   env: CORPUSGEN_POOL (default gaudi), CORPUSGEN_WORKER_PREFIX (default: hostname)
set -euo pipefail
cards=${1:-8}
per_worker=${2:-1}
pool=${CORPUSGEN_POOL:-gaudi}
prefix=${CORPUSGEN_WORKER_PREFIX:-$(hostname)}
if ((cards < 1 || per_worker < 1 || cards % per_worker)); then
  echo "CARDS ($cards) must be a positive multiple of CARDS_PER_WORKER ($per_worker)" >&2
  exit 2
fi

set -m  # background workers keep SIGINT (Prefect's SIGTERM handler turns into a SIGINT to itself)
pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait; }
trap 'stop; exit 0' INT TERM
for ((first = 0; first < cards; first += per_worker)); do
  modules=$(seq -s, "$first" $((first + per_worker - 1)))
  HABANA_VISIBLE_MODULES=$modules prefect worker start --pool "$pool" --limit 1 \
    --name "$prefix-card${modules//,/-}" &
  pids+=($!)
done
wait

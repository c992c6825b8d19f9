#!/usr/bin/env bash
# Run corpusgen from CI: validate the config here (a bad field fails the job before anything is
# queued), start `generate-corpus/ci` with it, wait, and exit non-zero unless the run Completed.
#
#   PREFECT_API_URL=http://prefect.internal:4200/api \
#     deployments/ci/trigger.sh configs/corpus.yaml [a.b=value ...]
#
# env: CORPUSGEN_WATCH_TIMEOUT (seconds, default 21600): after it the job stops watching and
# fails (exit 124) with one line naming the flow run, which goes on: cancel it as that line says.
# Storage credentials are not passed here: the workers take them from their own environment.
set -euo pipefail
config=${1:?usage: $0 CONFIG.yaml|CONFIG.json [KEY=VALUE overrides ...]}
shift
config_json=$(python - "$config" "$@" <<'PY'
import json
import sys

from schemas.run import ConfigError, parse_run_config

try:
    run_config = parse_run_config(sys.argv[1], sys.argv[2:])
except ConfigError as error:
    sys.exit(str(error))
print(json.dumps(run_config.model_dump(mode="json", exclude_unset=True)))
PY
)
watch_timeout=${CORPUSGEN_WATCH_TIMEOUT:-21600}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
timeout "$watch_timeout" prefect deployment run 'generate-corpus/ci' --param "config=$config_json" \
  --watch 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -eq 124 ]; then
  run_id=$(grep -oE 'UUID: [0-9a-f-]{36}' "$log" | head -n 1 | cut -d ' ' -f 2)
  echo "corpusgen: stopped watching after ${watch_timeout} s; flow run ${run_id:-?} was not" \
    "cancelled and is still scheduled or running: cancel it with" \
    "\`prefect flow-run cancel ${run_id:-<id>}\`, or watch it with" \
    "\`prefect flow-run logs ${run_id:-<id>}\`" >&2
fi
exit "$status"

#!/usr/bin/env bash
# Run corpusgen from CI: validate the config here (a bad field fails the job before anything is
# queued), start `generate-corpus/ci` with it, wait, and exit non-zero unless the run Completed.
#
#   PREFECT_API_URL=http://prefect.internal:4200/api \
#     deployments/ci/trigger.sh configs/corpus.yaml [a.b=value ...]
#
# env: CORPUSGEN_WATCH_TIMEOUT (seconds, default 21600): the job fails after it; the run goes on.
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
exec prefect deployment run 'generate-corpus/ci' --param "config=$config_json" \
  --watch --watch-timeout "${CORPUSGEN_WATCH_TIMEOUT:-21600}"

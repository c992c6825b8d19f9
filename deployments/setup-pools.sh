#!/usr/bin/env bash
# Create (or update) the work pools and the card-slot limit that deployments/prefect.yaml uses.
# Idempotent: rerun with the new total after adding cards or hosts.
#
#   PREFECT_API_URL=http://prefect.internal:4200/api deployments/setup-pools.sh TOTAL_CARDS
#
# corpusgen-control  process pool for parent flows (planning, dispatch, summary; no accelerator)
# gaudi              process pool for shard batches; one worker per card, see start-workers.sh;
#                    its concurrency limit = TOTAL_CARDS, so no card ever runs two shard batches
# gaudi-k8s          kubernetes pool for shard batches, one pod per batch (gaudi_cards per pod)
# corpusgen-accelerators  global concurrency limit the shard tasks hold while generating
set -euo pipefail
cards=${1:?usage: $0 TOTAL_CARDS  (Gaudi cards over every host and pod that takes shards)}
pools=$(cd "$(dirname "$0")/pools" && pwd)

prefect work-pool create corpusgen-control --type process --overwrite
prefect work-pool create gaudi --type process --base-job-template "$pools/process.json" --overwrite
prefect work-pool set-concurrency-limit gaudi "$cards"
prefect work-pool create gaudi-k8s --type kubernetes \
  --base-job-template "$pools/kubernetes-gaudi.json" --overwrite
prefect gcl update corpusgen-accelerators --limit "$cards" 2>/dev/null \
  || prefect gcl create corpusgen-accelerators --limit "$cards"

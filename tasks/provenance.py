"""Who generated a shard and how: worker, card, flow run, sampling settings (metrics columns).

host:pid alone does not say which pod or card a bad shard came from; these do.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from schemas.engine import SamplingParams

CARD_VARIABLES = ("HABANA_VISIBLE_MODULES", "CUDA_VISIBLE_DEVICES")


def worker_name() -> str:
    """The Prefect worker that started this flow run (it sets PREFECT__WORKER_NAME), else host."""
    return os.environ.get("PREFECT__WORKER_NAME") or socket.gethostname()


def device_card() -> str | None:
    """The cards this process may use, e.g. `HABANA_VISIBLE_MODULES=3`; None when unrestricted."""
    for variable in CARD_VARIABLES:
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    return None


def flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


def provenance(
    sampling: SamplingParams, samples_per_prompt: int, chat_template: str
) -> dict[str, Any]:
    """The shard's sampling (a batch file's: its group's) and samples_per_prompt."""
    described = {**sampling.model_dump(mode="json"), "samples_per_prompt": samples_per_prompt}
    return {
        "worker_name": worker_name(),
        "device_card": device_card(),
        "flow_run_id": flow_run_id(),
        "sampling_params": json.dumps(described, sort_keys=True),
        "chat_template": chat_template,
    }

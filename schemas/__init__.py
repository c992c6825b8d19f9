"""Configs and Arrow schemas: data only, importing nothing else of the project."""

from schemas.engine import BucketGrid, DraftSpec, EngineConfig, ModelSpec, SamplingParams
from schemas.run import ConfigError, RunConfig, parse_run_config

__all__ = ["BucketGrid", "DraftSpec", "EngineConfig", "ModelSpec", "SamplingParams"]
__all__ += ["ConfigError", "RunConfig", "parse_run_config"]

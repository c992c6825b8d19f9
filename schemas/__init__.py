"""Configs and Arrow schemas: data only, importing nothing else of the project."""

from schemas.engine import BucketGrid, DraftSpec, EngineConfig, ModelSpec, SamplingParams

__all__ = ["BucketGrid", "DraftSpec", "EngineConfig", "ModelSpec", "SamplingParams"]

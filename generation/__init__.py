"""The generation engine: static-shape, batched, speculative. No Prefect imports here."""

from generation.engine import ENGINE_VERSION, Engine
from generation.metrics import EngineStats
from generation.types import Completion, GenerationStopped

__all__ = ["ENGINE_VERSION", "Completion", "Engine", "EngineStats", "GenerationStopped"]

"""The model runtime both front doors use: :class:`Runtime` and what it hands back."""

from worker.runtime.results import Result, Timing
from worker.runtime.runtime import EnsureResult, LoadedModel, Runtime

__all__ = ["EnsureResult", "LoadedModel", "Result", "Runtime", "Timing"]

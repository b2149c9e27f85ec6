"""The model runtime both front doors use: :class:`Runtime` and what it hands back."""

from worker.runtime.runtime import EnsureResult, LoadedModel, Result, Runtime, Timing

__all__ = ["EnsureResult", "LoadedModel", "Result", "Runtime", "Timing"]

"""The model runtime: a plain Python API over loaded models, used by both front doors.

``encode``/``score``/``extract`` take decoded request pieces and return response pieces; with
``direct=False`` (standalone HTTP) items go through the model's BatchFormer and share forward
passes with concurrent requests; with ``direct=True`` (sidecar path, which has already batched)
they run at once. ``run_work_items`` executes a batch of NATS work items for the IPC front door.

The runtime is built in layers, one job per module; see :mod:`worker.models.registry` for the map.
"""

from __future__ import annotations

from worker.models.loaded import LoadedModel
from worker.runtime.control_config import ControlConfig
from worker.runtime.results import EnsureResult, Result, Timing
from worker.runtime.work_items import WorkItemRunner


class Runtime(ControlConfig, WorkItemRunner):
    """Models, batching and execution for both front doors (``sie serve`` and the IPC server)."""


__all__ = ["EnsureResult", "LoadedModel", "Result", "Runtime", "Timing"]

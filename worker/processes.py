"""How many whole workers share this worker's device, and the siblings the first of them starts.

``sie serve`` (HTTP, the siblings sharing the port) and a pod's worker container (``python -m
worker.ipc``, each sibling on its own IPC socket to its own sidecar) start them alike:
:mod:`protocol.siblings` says how they are named, started, restarted and stopped.
"""

from __future__ import annotations

from protocol.siblings import Siblings
from worker import CUDA_PROCESSES
from worker.models.placement import pick_device
from worker.settings import WorkerSettings


def resolve_processes(settings: WorkerSettings) -> WorkerSettings:
    """``settings`` with ``model_processes`` decided: 0 (auto) is CUDA_PROCESSES on CUDA, else 1."""
    if settings.model_processes:
        return settings
    on_cuda = pick_device(settings.device).startswith("cuda")
    return settings.model_copy(update={"model_processes": CUDA_PROCESSES if on_cuda else 1})


def sibling_env(settings: WorkerSettings) -> dict[str, str]:
    """Every setting of this process (command-line overrides included) as environment variables,
    so the siblings serve exactly what this one serves."""
    return {f"SIE_{name.upper()}": str(value) for name, value in settings.model_dump().items()}


def start_siblings(settings: WorkerSettings, module: str) -> Siblings | None:
    """Processes 1..N-1 of ``python -m module`` when this is process 0 of N > 1; else None."""
    if settings.process_index != 0 or settings.model_processes <= 1:
        return None
    return Siblings(module, settings.model_processes, sibling_env(settings)).start()

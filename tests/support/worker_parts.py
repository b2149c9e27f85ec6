"""Building the runtime's parts one at a time, over the fake adapter (``worker.adapters.fake``), for
the unit tests of each part alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from protocol.catalog import Catalog, Resolved
from protocol.errors import SIEError
from protocol.model_config import ModelConfig
from worker.adapters.base import Adapter, LoadSpec
from worker.adapters.fake import FakeAdapter
from worker.metrics import WorkerMetrics
from worker.models.loaded import ForwardFn, LoadedModel, ModelEnv, load_signature
from worker.models.placement import Placement
from worker.settings import WorkerSettings

FAKE = "worker.adapters.fake:FakeAdapter"
CPU = Placement("cpu", 1)


def fake_config(sie_id: str, *, tasks: dict[str, Any] | None = None, **loadtime: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "sie_id": sie_id,
            "package_backed": True,
            "inputs": {"text": True},
            "tasks": tasks or {"encode": {"dense": {"dim": 8}}},
            "profiles": {
                "default": {
                    "adapter_path": FAKE,
                    "max_batch_tokens": 4096,
                    "adapter_options": {"loadtime": loadtime},
                }
            },
        }
    )


def settings(**kw: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "device": "cpu",
        "cpu_workers": 1,
        "hf_offline": True,
        "memory_monitor_interval_s": 0,
        "torch_threads": 1,
    }
    return WorkerSettings(**{**base, **kw})


def no_lora(config: ModelConfig, name: str) -> Path:
    raise AssertionError(f"no LoRA expected, got {name} of {config.sie_id}")


def direct_forward(lm: LoadedModel, ctx: Any, units: list[Any]) -> list[Any]:
    """A forward without OOM recovery: the adapter's own."""
    return lm.adapter.forward(ctx, units)


async def loaded_fake(
    config: ModelConfig,
    *,
    worker_settings: WorkerSettings | None = None,
    forward: ForwardFn = direct_forward,
    metrics: WorkerMetrics | None = None,
) -> LoadedModel:
    """A LoadedModel of ``config``'s default profile over a loaded FakeAdapter (in a running loop:
    its BatchFormer starts a task)."""
    resolved = Catalog([config]).resolve(config.sie_id)
    adapter = FakeAdapter(
        LoadSpec(config, resolved.profile_name, None, "cpu", "float32", resolved.loadtime_options)
    )
    adapter.load()
    return loaded_model(resolved, adapter, worker_settings=worker_settings, forward=forward, metrics=metrics)


def loaded_model(
    resolved: Resolved,
    adapter: Adapter,
    *,
    worker_settings: WorkerSettings | None = None,
    forward: ForwardFn = direct_forward,
    metrics: WorkerMetrics | None = None,
) -> LoadedModel:
    """A LoadedModel of a loaded ``adapter`` (in a running loop)."""
    env = ModelEnv(
        worker_settings or settings(),
        CPU,
        metrics or WorkerMetrics(),
        forward,
        no_lora,
        ThreadPoolExecutor(1),
    )
    return LoadedModel(load_signature(resolved), resolved, adapter, env)


#: a fake model of every operation
TASKS = {"encode": {"dense": {"dim": 8}, "sparse": {}}, "score": {}, "extract": {}}


class Models:
    """A ModelSource: every model loaded already, or every request answered ``error``."""

    def __init__(self, error: SIEError | None = None) -> None:
        self.error = error
        self.loaded: dict[str, LoadedModel] = {}

    async def ready_model(self, resolved: Resolved) -> LoadedModel:
        if self.error is not None:
            raise self.error
        lm = self.loaded.get(resolved.model_id)
        if lm is None:
            lm = self.loaded[resolved.model_id] = await loaded_fake(resolved.config)
        return lm

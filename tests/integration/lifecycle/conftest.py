"""Runtimes over fake or MiniLM models, and a helper that waits out MODEL_LOADING / LORA_LOADING."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.api import EncodeParams, Item
from protocol.catalog import Catalog
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig
from worker.runtime import Result, Runtime
from worker.settings import WorkerSettings

FAKE = "worker.adapters.fake:FakeAdapter"


def fake_config(sie_id: str, **loadtime: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "sie_id": sie_id,
            "package_backed": True,
            "inputs": {"text": True},
            "tasks": {"encode": {"dense": {"dim": 8}}},
            "profiles": {
                "default": {
                    "adapter_path": FAKE,
                    "max_batch_tokens": 4096,
                    "adapter_options": {"loadtime": loadtime},
                }
            },
        }
    )


def settings(tmp_path, **kw: Any) -> WorkerSettings:
    base = {
        "device": "cpu",
        "hf_offline": True,
        "disk_cache_dir": str(tmp_path / "disk-cache"),
        "memory_monitor_interval_s": 0,
        "torch_threads": 1,
    }
    return WorkerSettings(**{**base, **kw})


async def settle(rt: Runtime, spec: str, exc: SIEError, params: EncodeParams | None) -> None:
    """Wait for whatever a MODEL_LOADING or LORA_LOADING answer said was in progress."""
    resolved = rt.catalog.resolve(spec)
    entry = rt.models.entry(resolved)
    if exc.code == ErrorCode.MODEL_LOADING and entry.task is not None:
        await entry.task
    elif exc.code == ErrorCode.LORA_LOADING and entry.loaded is not None:
        await entry.loaded.loras.wait(((params.options if params else None) or {}).get("lora"))
    else:
        raise exc


async def encode_ready(
    rt: Runtime, spec: str, items: list[Item], params: EncodeParams | None = None, *, direct: bool = True
) -> Result:
    """encode, waiting out (at most a few) loading answers the way a client's retries would."""
    for _ in range(5):
        try:
            return await rt.encode(spec, items, params, direct=direct)
        except SIEError as exc:
            if exc.code not in (ErrorCode.MODEL_LOADING, ErrorCode.LORA_LOADING):
                raise
            await settle(rt, spec, exc, params)
    raise AssertionError(f"{spec} never became ready")


@pytest.fixture
async def make_runtime(tmp_path):
    made: list[Runtime] = []

    async def make(models: list[ModelConfig] | None = None, **kw: Any) -> Runtime:
        catalog = Catalog(models) if models is not None else None
        rt = Runtime(settings(tmp_path, **kw), catalog)
        await rt.start()
        made.append(rt)
        return rt

    yield make
    for rt in made:
        await rt.close()

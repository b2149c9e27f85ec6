"""The declared load-time options of our adapters: the table, every catalog file against it, and
the worker refusing a profile the table refuses before it fetches any weights."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from pathlib import Path

import pytest

from config_service.checks import check_adapter_options
from config_service.rules import ConfigError
from protocol.adapter_options import LOADTIME, loadtime_problems
from protocol.catalog import Catalog
from protocol.errors import ErrorCode
from protocol.model_config import parse_model_yaml
from worker.adapters.base import Adapter
from worker.adapters.hf import HFTextAdapter
from worker.models.loaded import import_adapter
from worker.runtime import Runtime
from worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[3]
CATALOG = sorted((REPO / "worker" / "catalog" / "models").glob("*.yaml"))


def test_every_declared_adapter_is_an_adapter_class():
    for path in LOADTIME:
        assert issubclass(import_adapter(path), Adapter), path


def test_every_shipped_adapter_class_is_declared():
    """A new adapter in worker/adapters must say which load-time options it reads."""
    shipped = set()
    for file in (REPO / "worker" / "adapters").glob("*.py"):
        module = importlib.import_module(f"worker.adapters.{file.stem}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            concrete = issubclass(cls, Adapter) and cls.__module__ == module.__name__
            if concrete and not inspect.isabstract(cls) and cls not in (Adapter, HFTextAdapter):
                shipped.add(f"{module.__name__}:{name}")
    assert shipped == set(LOADTIME)


@pytest.mark.parametrize("path", CATALOG, ids=lambda p: p.stem)
def test_catalog_files_use_only_options_their_adapters_read(path):
    config = parse_model_yaml(path.read_text(encoding="utf-8"))
    check_adapter_options(config)  # raises ConfigError (422) naming the option otherwise
    for name in config.profiles:
        profile = config.resolved_profile(name)
        assert profile.adapter_path in LOADTIME, (path.name, name, profile.adapter_path)


def test_problems_name_the_option_and_what_is_wrong():
    dense = "worker.adapters.dense:DenseAdapter"
    assert loadtime_problems(dense, {"packed": True}) == []
    [(key, message)] = loadtime_problems(dense, {"pakced": True})
    assert key == "pakced" and "no load-time option 'pakced'" in message and "packed" in message
    [(key, message)] = loadtime_problems(dense, {"packed": "yes"})
    assert key == "packed" and "must be a bool" in message
    [(key, message)] = loadtime_problems("worker.adapters.dense:Dense", {})
    assert key is None and "unknown adapter" in message
    assert (
        loadtime_problems("worker.adapters.fake:FakeAdapter", {"batch_delay_ms": 2.5, "oom_on_batch": 3})
        == []
    )
    assert (
        loadtime_problems("worker.adapters.fake:FakeAdapter", {"oom_on_batch": True}) != []
    )  # a bool is no int
    # a bundle's own adapter module: only the adapter can judge its options
    assert loadtime_problems("acme_adapters.custom:Mine", {"anything": 1}) == []


def test_config_service_check_lists_every_problem():
    config = parse_model_yaml(
        "sie_id: acme/m\nprofiles:\n  default:\n    adapter_path: worker.adapters.clip:CLIPAdapter\n"
        "    max_batch_tokens: 512\n    adapter_options: {loadtime: {max_image_bytes: big, colour: true}}\n"
    )
    with pytest.raises(ConfigError) as info:
        check_adapter_options(config)
    assert info.value.status == 422
    locs = [d["loc"][-1] for d in info.value.extra["details"]]
    assert locs == ["colour", "max_image_bytes"]


async def test_worker_refuses_an_unknown_option_as_a_permanent_load_failure():
    yaml = (
        "sie_id: test/bad-option\npackage_backed: true\ntasks:\n  encode:\n    dense: {dim: 8}\n"
        "profiles:\n  default:\n    adapter_path: worker.adapters.fake:FakeAdapter\n    max_batch_tokens: 64\n"
        "    adapter_options: {loadtime: {batch_dealy_ms: 5}}\n"
    )
    runtime = Runtime(WorkerSettings(device="cpu", cpu_workers=1), catalog=Catalog([parse_model_yaml(yaml)]))
    await runtime.start()
    try:
        for _ in range(200):
            result = await runtime.ensure_ready("test/bad-option")
            if result.state == "failed":
                break
            await asyncio.sleep(0.02)
    finally:
        await runtime.close()
    assert result.state == "failed" and result.error is not None
    assert result.error.code == ErrorCode.MODEL_LOAD_FAILED
    assert "batch_dealy_ms" in result.error.message and result.error.extra["permanent"] is True

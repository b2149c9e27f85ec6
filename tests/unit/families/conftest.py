"""Session fixtures: small local checkpoints of each family and a Runtime serving them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig
from tests.support.typed import runtime_args
from tests.unit.families import checkpoints as ck
from worker import DEFAULT_BUNDLES_DIR
from worker.adapters.base import LoadSpec


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """Built (two of them trained) once per run and shared with every worker and module that needs
    them (checkpoints.shared)."""
    paths = {name: ck.shared(tmp_path_factory, name) for name in ck.BUILDERS}
    paths["models_dir"] = ck.write_models_dir(tmp_path_factory.mktemp("family-models"), paths)
    return paths


def loaded_adapter(cls, path, loadtime: dict | None = None, max_len: int | None = None):
    """An adapter of class ``cls`` loaded from ``path`` on the CPU in float32: the ``default``
    profile of a model ``t`` (``max_len``: its max_sequence_length, when it has one)."""
    limit = {"max_sequence_length": max_len} if max_len is not None else {}
    profile = {"adapter_path": f"{cls.__module__}:{cls.__name__}", "max_batch_tokens": 4096}
    config = ModelConfig(sie_id="t", **limit, profiles={"default": profile})
    spec = LoadSpec(config=config, profile_name="default", weights_dir=str(path), device="cpu",
                    precision="float32", loadtime=loadtime or {})  # fmt: skip
    a = cls(spec)
    a.load()
    return a


class RuntimeThread:
    """A Runtime on its own event loop thread; ``call`` runs a coroutine and waits out model loads."""

    def __init__(self, settings) -> None:
        from worker.runtime import Runtime

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runtime = self._submit(self._make(Runtime, settings))

    @staticmethod
    async def _make(cls, settings):
        rt = cls(settings)
        await rt.start()
        return rt

    def _submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def call(self, method: str, *args, **kwargs):
        """``method`` with its items and params written as a request's maps (tests.support.typed)."""
        score = {k: kwargs.pop(k) for k in ("instruction", "options") if k in kwargs}
        typed = runtime_args(method, *args, **score)
        deadline = time.monotonic() + 120
        while True:
            try:
                return self._submit(getattr(self.runtime, method)(*typed, direct=True, **kwargs))
            except SIEError as exc:
                if exc.code != ErrorCode.MODEL_LOADING or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self._submit(self.runtime.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def runtime_serving(models_dir, *model_yamls: str) -> RuntimeThread:
    """A RuntimeThread whose catalog is ``model_yamls`` (written to ``models_dir``); close it after."""
    from worker.settings import WorkerSettings

    models_dir.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(model_yamls):
        (models_dir / f"model-{i}.yaml").write_text(text)
    return RuntimeThread(
        WorkerSettings(
            models_dir=str(models_dir),
            bundles_dir=str(DEFAULT_BUNDLES_DIR),
            device="cpu",
            hf_offline=True,
            memory_monitor_interval_s=0,
        )
    )


@pytest.fixture(scope="session")
def family_runtime(family_checkpoints):
    from worker.settings import WorkerSettings

    settings = WorkerSettings(
        models_dir=str(family_checkpoints["models_dir"]),
        bundles_dir=str(DEFAULT_BUNDLES_DIR),
        device="cpu",
        hf_offline=True,
        memory_monitor_interval_s=0,
    )
    rt = RuntimeThread(settings)
    yield rt
    rt.close()

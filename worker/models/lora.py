"""LoRA adapters of one loaded model: an LRU of at most ``max_loras`` (``SIE_MAX_LORAS_PER_MODEL``).

A request selects a LoRA by the NAME its model's config declares (``loras:``; the front doors
refuse anything else, and the executor checks again). A LoRA that is not loaded starts its load and
the request is answered ``503 LORA_LOADING`` with ``Retry-After`` (``SIE_LORA_LOADING_RETRY_AFTER_S``);
concurrent requests for it share that one load. A load resolves the declared entry on a loader
thread (:func:`resolve_declared`: the operator's directory, or the hub id through the weight cache
tiers, adapter files only, at most ``SIE_MAX_LORA_BYTES``; the declared sha256 checked), then
injects the adapter on one of the model's forward threads while no forward runs, so it never races
a forward pass. A failed load answers ``500 INFERENCE_ERROR`` (naming the adapter and the model,
never a path: the worker log has the details) until ``SIE_LOAD_FAILURE_COOLDOWN_S`` has passed,
then the next request tries again.

Past ``max_loras`` the least recently used LoRA that no queued request is using is unloaded (if
every one is in use, the set stays over the cap until the next load).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig
from worker.adapters.base import Adapter
from worker.models.weights import Source, WeightCache, WeightsError, resolve_path

log = logging.getLogger(__name__)

ResolveFn = Callable[[str], Path]
OnInferenceThread = Callable[..., Awaitable[Any]]

#: what a LoRA's hub download takes (``snapshot_download``'s ``allow_patterns``): peft reads these two
ADAPTER_FILES = ("adapter_config.json", "*.safetensors")
#: the file a declared ``sha256`` is of (what peft loads first)
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# what a client is told when a declared hub adapter cannot be had (the worker log has the details)
_WHY = {
    "NOT_FOUND": "not found on the hub or in the caches",
    "GATED": "gated on the hub (the worker's HF_TOKEN has no access)",
    "NETWORK": "the hub is unreachable and the adapter is not cached",
    "INTEGRITY": "the cluster cache's copy failed its integrity check",
    "TOO_LARGE": "larger than SIE_MAX_LORA_BYTES",
}


def resolve_declared(
    config: ModelConfig,
    name: str,
    weights: WeightCache,
    *,
    max_bytes: int,
    protect: Iterable[str] = (),
) -> Path:
    """The local directory of the LoRA ``name`` that ``config`` declares (loader thread).

    ``path``: that directory (or ``pkg://`` directory), as the operator wrote it. ``hf_id``: through
    the weight cache tiers at the pinned ``revision``, only :data:`ADAPTER_FILES`, refused above
    ``max_bytes`` (the hub's reported sizes before the download, the bytes on disk after). A declared
    ``sha256`` is checked against ``adapter_model.safetensors`` before anything loads it. Every
    WeightsError raised names the adapter and the model, never a filesystem path.
    """
    entry = config.lora(name)
    if entry is None:  # the name is not repeated: it is only ever compared to declared names
        raise WeightsError(f"model '{config.sie_id}' declares no LoRA of that name; it is not loaded")
    what = f"LoRA '{name}' of model '{config.sie_id}'"
    if entry.path is not None:
        try:
            path = resolve_path(entry.path)
        except WeightsError as exc:
            log.warning("%s: %s", what, exc)
            raise WeightsError(
                f"{what} failed to load: the package of its declared directory is not installed"
            ) from exc
        if not path.is_dir():
            log.warning("%s: the declared directory %s does not exist", what, path)
            raise WeightsError(f"{what} failed to load: its declared directory does not exist")
    else:
        hub_id = entry.hf_id or ""
        source = Source(
            # its own cache entry, apart from a model of the same hub id (whose entry holds every file)
            ident=f"lora/{hub_id}",
            revision=entry.revision,
            hub_id=hub_id,
            files=ADAPTER_FILES,
            max_bytes=max_bytes,
        )
        try:
            path = weights.resolve(source, protect)
        except WeightsError as exc:
            log.warning("%s (%s): %s", what, hub_id, exc)
            why = _WHY.get(exc.error_class, "its weights could not be had")
            raise WeightsError(
                f"{what} failed to load ({hub_id}): {why}", exc.error_class, exc.permanent
            ) from exc
        size = adapter_bytes(path)
        if size > max_bytes:
            log.warning("%s (%s): %d bytes of adapter files at %s", what, hub_id, size, path)
            raise WeightsError(
                f"{what} failed to load ({hub_id}): {size} bytes, larger than SIE_MAX_LORA_BYTES ({max_bytes})",
                "TOO_LARGE",
            )
    if entry.sha256 is not None:
        check_sha256(path, entry.sha256, what)
    return path


def adapter_bytes(path: Path) -> int:
    """Bytes of the files a LoRA load reads in ``path``: ``adapter_config.json`` and ``*.safetensors``."""
    files = [path / ADAPTER_FILES[0], *path.rglob(ADAPTER_FILES[1])]
    return sum(f.stat().st_size for f in files if f.is_file())


def check_sha256(path: Path, want: str, what: str) -> None:
    """Raise WeightsError (INTEGRITY) unless ``path/adapter_model.safetensors`` hashes to ``want``."""
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise WeightsError(
            f"{what} failed to load: it declares a sha256 but has no {ADAPTER_WEIGHTS}", "INTEGRITY"
        )
    digest = hashlib.sha256()
    with weights_file.open("rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            digest.update(chunk)
    if digest.hexdigest() != want:
        log.warning("%s: %s hashes to %s, not the declared %s", what, weights_file, digest.hexdigest(), want)
        raise WeightsError(
            f"{what} failed to load: {ADAPTER_WEIGHTS} does not match its declared sha256", "INTEGRITY"
        )


class LoraSet:
    def __init__(
        self,
        model_id: str,
        adapter: Adapter,
        *,
        max_loras: int,
        resolve: ResolveFn,
        resolve_pool: Executor,
        on_inference_thread: OnInferenceThread,
        retry_after_s: float = 1.0,
        failure_cooldown_s: float = 30.0,
    ) -> None:
        self.model_id = model_id
        self.adapter = adapter
        self.max_loras = max_loras
        self.resolve = resolve
        self.resolve_pool = resolve_pool
        self.on_inference_thread = on_inference_thread
        self.retry_after_s = retry_after_s
        self.failure_cooldown_s = failure_cooldown_s
        self.loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.loading: dict[str, asyncio.Task[None]] = {}
        self.failed: dict[str, tuple[SIEError, float]] = {}
        self.evicted: list[str] = []
        self._in_use: Counter[str] = Counter()

    def ensure(self, name: str) -> None:
        """Return when ``name`` is loaded (and mark it used); else start its load and raise."""
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return
        failure = self.failed.get(name)
        if failure is not None:
            error, failed_at = failure
            if time.monotonic() - failed_at < self.failure_cooldown_s:
                raise error
            del self.failed[name]
        if name not in self.loading:
            self.loading[name] = asyncio.get_running_loop().create_task(self._load(name), name=f"lora:{name}")
        raise SIEError(
            ErrorCode.LORA_LOADING,
            f"LoRA '{name}' is loading for model '{self.model_id}'; retry shortly",
            retry_after=self.retry_after_s,
        )

    @contextlib.contextmanager
    def use(self, name: str | None) -> Iterator[None]:
        """Hold ``name`` while a request's batches are queued or running: it is not evicted meanwhile."""
        if name is None:
            yield
            return
        self._in_use[name] += 1
        try:
            yield
        finally:
            self._in_use[name] -= 1
            if not self._in_use[name]:
                del self._in_use[name]

    async def wait(self, name: str) -> None:
        """Until a load of ``name`` in progress has finished (tests, preloading)."""
        task = self.loading.get(name)
        if task is not None:
            await asyncio.shield(task)

    def close(self) -> None:
        for task in self.loading.values():
            task.cancel()
        self.loading.clear()
        self.loaded.clear()

    async def _load(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            path = await loop.run_in_executor(self.resolve_pool, self.resolve, name)
            await self.on_inference_thread(self.adapter.load_lora, name, str(path))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # a WeightsError of resolve_declared names the adapter and the model only; anything else
            # (peft's errors quote the directory) stays in the worker log
            message = (
                str(exc)
                if isinstance(exc, WeightsError)
                else f"LoRA '{name}' of model '{self.model_id}' failed to load: {type(exc).__name__} "
                "(the worker log has the details)"
            )
            error = SIEError(ErrorCode.INFERENCE_ERROR, message)
            self.failed[name] = (error, time.monotonic())
            log.error("LoRA %s failed to load for model %s: %s", name, self.model_id, exc)
            return
        finally:
            self.loading.pop(name, None)
        self.loaded[name] = None
        log.info("loaded LoRA %s on %s in %.1f s", name, self.model_id, time.monotonic() - started)
        await self._trim(keep=name)

    async def _trim(self, keep: str) -> None:
        while len(self.loaded) > self.max_loras:
            victim = next((n for n in self.loaded if n != keep and not self._in_use.get(n)), None)
            if victim is None:
                return
            del self.loaded[victim]
            self.evicted.append(victim)
            await self.on_inference_thread(self.adapter.unload_lora, victim)
            log.info("unloaded LoRA %s from %s (more than %d loaded)", victim, self.model_id, self.max_loras)

"""The config service core: reads from the store, the single-writer write path, delta publication.

Dependencies come in as arguments (store, writer lock, publisher, bundles, baseline models), so
tests run it in-process against a real nats-server and a real database.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from config_service.checks import check_adapter_options, check_weights_path
from config_service.lock import NotWriter, WriterLock
from config_service.metrics import ConfigMetrics
from config_service.publisher import DeltaPublisher
from config_service.rules import (
    ConfigError,
    ConfigState,
    ModelEntry,
    ReplacePlan,
    WritePlan,
    entry_from_yaml,
    plan_add,
    plan_replace,
)
from config_service.store import Store, StoreError
from protocol.config_delta import ConfigDelta, encode_config_delta
from protocol.model_config import Bundle
from protocol.subjects import CONFIG_ALL, config_subject

log = logging.getLogger(__name__)

MAX_IDEMPOTENCY_KEY_LEN = 256


class ConfigService:
    def __init__(
        self,
        *,
        store: Store,
        lock: WriterLock,
        publisher: DeltaPublisher | None,
        bundles: dict[str, Bundle],
        baseline: dict[str, ModelEntry],
        router_id: str,
        metrics: ConfigMetrics | None = None,
        catalog_error: str | None = None,
        threshold_routing_enabled: bool = False,
        idempotency_ttl_s: float = 86400.0,
    ) -> None:
        self.store = store
        self.lock = lock
        self.publisher = publisher
        self.bundles = bundles
        self.baseline = baseline
        self.router_id = router_id
        self.metrics = metrics or ConfigMetrics()
        self.catalog_error = catalog_error
        self.threshold_routing_enabled = threshold_routing_enabled
        self.idempotency_ttl_s = idempotency_ttl_s
        self._write_lock = asyncio.Lock()
        self._state: ConfigState | None = None
        self._state_lock = asyncio.Lock()
        self.metrics.bundles.set(len(bundles))
        lock.on_change = lambda held: self.metrics.writer.set(1 if held else 0)
        self.metrics.writer.set(1 if lock.held else 0)

    # ---- reads -------------------------------------------------------------------------
    def require_catalog(self) -> None:
        if self.catalog_error is not None:
            raise ConfigError(
                503, "registry_unavailable", f"model registry failed to initialise: {self.catalog_error}"
            )

    async def _run(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreError as exc:
            raise ConfigError(503, "store_unavailable", str(exc)) from exc

    async def epoch(self) -> int:
        epoch: int = await self._run(self.store.epoch)
        return epoch

    async def state(self) -> ConfigState:
        """The state at the store's current epoch (reloaded only when the epoch moved)."""
        self.require_catalog()
        epoch = await self.epoch()
        if self._state is not None and self._state.epoch == epoch:
            return self._state
        async with self._state_lock:
            if self._state is not None and self._state.epoch == epoch:
                return self._state
            return await self._load_state()

    async def _load_state(self) -> ConfigState:
        epoch, rows = await self._run(self.store.snapshot)
        api: dict[str, ModelEntry] = {}
        for row in rows:
            try:
                api[row.model_id] = entry_from_yaml(row.raw_yaml, source="api")
            except Exception as exc:  # a row written by a newer schema, or damaged by hand
                log.error("stored model %s is not loadable: %s", row.model_id, exc)
        state = ConfigState(epoch=epoch, bundles=self.bundles, baseline=self.baseline, api=api)
        self._set_state(state)
        return state

    def _set_state(self, state: ConfigState) -> None:
        if self._state is None or state.epoch >= self._state.epoch:
            self._state = state
        self.metrics.epoch.set(state.epoch)
        sources = {"api": 0, "filesystem": 0}
        for entry in state.models.values():
            sources[entry.source] += 1
        for source, n in sources.items():
            self.metrics.models.labels(source).set(n)

    async def export(self) -> dict[str, Any]:
        """A consistent snapshot: epoch and models come from one store transaction."""
        self.require_catalog()
        return (await self._load_state()).export()

    async def epoch_info(self) -> dict[str, Any]:
        if self.catalog_error is not None:  # keeps answering without a catalog
            return {"epoch": await self.epoch(), "bundles_hash": "", "bundle_config_hashes_hash": ""}
        return (await self.state()).epoch_info()

    async def model_yaml(self, model_id: str) -> str:
        state = await self.state()
        entry = state.models.get(model_id)
        if entry is None:
            raise ConfigError(
                404, "model_not_found", f"model {model_id!r} is not configured", model_id=model_id
            )
        return entry.raw_yaml

    # ---- write path --------------------------------------------------------------------
    async def check_writable(self) -> None:
        """Step 1 of a write (after auth): registry, writer lock, NATS reachable."""
        self.require_catalog()
        if not self.lock.held:
            raise ConfigError(
                503,
                "not_writer",
                "this replica is a standby: another replica holds the config writer lock; "
                "retry, or send writes to the active replica",
            )
        if self.publisher is not None and not await self.publisher.ready():
            raise ConfigError(
                503,
                "nats_unavailable",
                "NATS is unreachable: the write was refused so that no change is applied without its delta",
            )

    def _check_key(self, key: str | None) -> str | None:
        if key is None:
            return None
        key = key.strip()
        if not key or len(key) > MAX_IDEMPOTENCY_KEY_LEN:
            raise ConfigError(
                400,
                "invalid_idempotency_key",
                f"Idempotency-Key must be 1..{MAX_IDEMPOTENCY_KEY_LEN} characters",
            )
        return key

    async def _replay(self, key: str | None, body_sha: str) -> tuple[int, dict[str, Any]] | None:
        """The stored answer of an earlier request with this Idempotency-Key (422 for another body)."""
        if key is None:
            return None
        record = await self._run(self.store.get_idempotency, key, self.idempotency_ttl_s)
        if record is None:
            return None
        if record.body_sha256 != body_sha:
            raise ConfigError(
                422, "idempotency_mismatch", "Idempotency-Key was already used with a different request body"
            )
        return record.status, record.response

    async def _remember(self, key: str | None, body_sha: str, status: int, response: dict[str, Any]) -> None:
        if key is not None:
            await self._write(
                "idempotency",
                lambda conn: self.store.put_idempotency(
                    conn, key, body_sha, status, response, self.idempotency_ttl_s
                ),
            )

    def _write_checks(self, entry: ModelEntry, weights_changed: bool) -> list[str]:
        """What can be checked here before a write: runtime options; a new or changed weights_path."""
        check_adapter_options(entry.config)
        return check_weights_path(entry.config, entry.data) if weights_changed else []

    async def add_model(self, body: bytes, idempotency_key: str | None = None) -> tuple[int, dict[str, Any]]:
        """POST /v1/configs/models after auth and the size check. Returns (status, body)."""
        idempotency_key = self._check_key(idempotency_key)
        body_sha = hashlib.sha256(body).hexdigest()
        async with self._write_lock:  # one write at a time; same-key requests wait here
            await self.check_writable()
            replay = await self._replay(idempotency_key, body_sha)
            if replay is not None:
                return replay
            state = await self.state()
            plan = plan_add(state, body, threshold_routing_enabled=self.threshold_routing_enabled)
            check_warnings = self._write_checks(
                plan.entry, plan.is_new_model or "weights_path" in plan.added_fields
            )
            if not plan.changed:
                response = self._response(plan, state, state.epoch)
                await self._remember(idempotency_key, body_sha, 200, response)
                return 200, response
            status = 201 if plan.created_profiles else 200

            def tx(conn: Any) -> tuple[int, dict[str, Any]]:
                epoch = self.store.bump_epoch(conn)
                self.store.upsert_model(conn, plan.model_id, plan.entry.raw_yaml, plan.entry.pool, epoch)
                resp = self._response(plan, state, epoch)
                resp["warnings"] += check_warnings
                if idempotency_key is not None:
                    self.store.put_idempotency(
                        conn, idempotency_key, body_sha, status, resp, self.idempotency_ttl_s
                    )
                return epoch, resp

            epoch, response = await self._write("put_model", tx)
            new_state = state.with_model(epoch, plan.entry)
            self._set_state(new_state)
            warnings = await self._publish(
                self.model_deltas(new_state, plan.model_id, plan.entry, profiles_added=plan.created_profiles)
            )
            if warnings:
                response = {**response, "warnings": response["warnings"] + warnings}
            log.info("model %s: created profiles %s, epoch %d", plan.model_id, plan.created_profiles, epoch)
            return status, response

    async def replace_model(
        self, model_id: str, body: bytes, idempotency_key: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """PUT /v1/configs/models/{id}: the body is the model's whole new config (same content = no-op)."""
        idempotency_key = self._check_key(idempotency_key)
        body_sha = hashlib.sha256(b"PUT " + model_id.encode("utf-8") + b"\n" + body).hexdigest()
        async with self._write_lock:
            await self.check_writable()
            replay = await self._replay(idempotency_key, body_sha)
            if replay is not None:
                return replay
            state = await self.state()
            plan = plan_replace(
                state, model_id, body, threshold_routing_enabled=self.threshold_routing_enabled
            )
            previous = plan.previous
            weights_changed = (
                previous is None or previous.config.weights_path != plan.entry.config.weights_path
            )
            check_warnings = self._write_checks(plan.entry, weights_changed)
            if plan.unchanged:
                response = self._replace_response(plan, state, state.epoch, check_warnings)
                await self._remember(idempotency_key, body_sha, 200, response)
                return 200, response

            def tx(conn: Any) -> tuple[int, dict[str, Any]]:
                epoch = self.store.bump_epoch(conn)
                self.store.upsert_model(conn, model_id, plan.entry.raw_yaml, plan.entry.pool, epoch)
                resp = self._replace_response(plan, state, epoch, check_warnings)
                if idempotency_key is not None:
                    self.store.put_idempotency(
                        conn, idempotency_key, body_sha, 200, resp, self.idempotency_ttl_s
                    )
                return epoch, resp

            epoch, response = await self._write("replace_model", tx)
            new_state = state.with_model(epoch, plan.entry)
            self._set_state(new_state)
            before = state.affected_bundles(previous.config) if previous is not None else []
            warnings = await self._publish(
                self.model_deltas(
                    new_state,
                    model_id,
                    plan.entry,
                    profiles_added=sorted(plan.entry.config.profiles),
                    previous_bundles=before,
                    previous_pool=plan.entry.pool,
                )
            )
            if warnings:
                response = {**response, "warnings": response["warnings"] + warnings}
            log.info("model %s replaced, epoch %d", model_id, epoch)
            return 200, response

    def _replace_response(
        self, plan: ReplacePlan, state: ConfigState, epoch: int, warnings: list[str]
    ) -> dict[str, Any]:
        return {
            "model_id": plan.model_id,
            "replaced": not plan.unchanged,
            "unchanged": plan.unchanged,
            "created": plan.previous is None,
            "affected_bundles": state.affected_bundles(plan.entry.config),
            "warnings": list(warnings),
            "epoch": epoch,
            "router_id": self.router_id,
        }

    async def delete_model(self, model_id: str) -> dict[str, Any]:
        """DELETE /v1/configs/models/{id}: removes an API-added config; idempotent.

        A filesystem (image) config of the same id reappears and is published as a replace; the
        bundles that no longer serve the id get a tombstone delta. Deleting an id that has no API
        config is a success that changes nothing (``unchanged: true``).
        """
        async with self._write_lock:
            await self.check_writable()
            state = await self.state()
            entry = state.api.get(model_id)
            baseline = state.baseline.get(model_id)
            fallback = "filesystem" if baseline is not None else None
            if entry is None:
                return {
                    "model_id": model_id,
                    "deleted": False,
                    "unchanged": True,
                    "fallback": fallback,
                    "affected_bundles": [],
                    "epoch": state.epoch,
                    "distribution": "epoch_export",
                }

            def tx(conn: Any) -> int:
                epoch = self.store.bump_epoch(conn)
                self.store.delete_model(conn, model_id)
                return epoch

            epoch = await self._write("delete_model", tx)
            new_state = state.without_model(epoch, model_id)
            self._set_state(new_state)
            before = state.affected_bundles(entry.config)
            response: dict[str, Any] = {
                "model_id": model_id,
                "deleted": True,
                "unchanged": False,
                "fallback": fallback,
                "affected_bundles": before,
                "epoch": epoch,
                "distribution": "epoch_export",
            }
            warnings = await self._publish(
                self.model_deltas(
                    new_state,
                    model_id,
                    baseline,
                    profiles_added=sorted(baseline.config.profiles) if baseline else [],
                    previous_bundles=before,
                    previous_pool=entry.pool,
                )
            )
            if warnings:
                response["warnings"] = warnings
            log.info("model %s deleted, epoch %d (fallback: %s)", model_id, epoch, fallback)
            return response

    async def writer_address(self) -> tuple[str, str] | None:
        """(URL, router id) of the replica holding the writer lock, as it recorded them."""
        address: tuple[str, str] | None = await self._run(self.store.writer)
        return address

    async def announce_writer(self, url: str) -> None:
        """Record, as the writer, where this replica takes writes (standbys forward there)."""
        await self._write("writer", lambda conn: self.store.put_writer(conn, url, self.router_id))
        log.info("writer %s announced at %s", self.router_id, url)

    async def _write(self, op: str, fn: Any) -> Any:
        try:
            result = await asyncio.to_thread(self.lock.write, fn)
        except NotWriter as exc:
            self.metrics.store_writes.labels(op, "not_writer").inc()
            raise ConfigError(503, "not_writer", f"write refused: {exc}") from exc
        except Exception as exc:
            self.metrics.store_writes.labels(op, "failure").inc()
            log.exception("store write %s failed", op)
            raise ConfigError(
                503, "store_unavailable", f"config store write failed: {exc.__class__.__name__}"
            ) from exc
        self.metrics.store_writes.labels(op, "success").inc()
        return result

    def _response(self, plan: WritePlan, state: ConfigState, epoch: int) -> dict[str, Any]:
        return {
            "model_id": plan.model_id,
            "created_profiles": plan.created_profiles,
            "existing_profiles_skipped": plan.existing_profiles_skipped,
            "added_fields": plan.added_fields,
            "warnings": list(plan.warnings),
            "routable_bundles_by_profile": state.routable_bundles_by_profile(plan.entry.config),
            "epoch": epoch,
            "router_id": self.router_id,
        }

    def model_deltas(
        self,
        state: ConfigState,
        model_id: str,
        entry: ModelEntry | None,
        *,
        profiles_added: list[str],
        previous_bundles: list[str] | None = None,
        previous_pool: str | None = None,
    ) -> list[ConfigDelta]:
        """One delta per bundle that serves ``entry`` (its full config) and a tombstone for every
        bundle in ``previous_bundles`` that no longer does (``entry`` None: the model is gone)."""
        affected = state.affected_bundles(entry.config) if entry is not None else []
        hashes = state.bundle_config_hashes()
        pool_hashes = state.bundle_pool_config_hashes()
        adapters = state.bundle_adapters()
        deltas = [
            ConfigDelta(
                router_id=self.router_id,
                bundle_id=bundle,
                epoch=state.epoch,
                bundle_config_hash=hashes.get(bundle, ""),
                model_id=model_id,
                profiles_added=profiles_added,
                model_config=entry.raw_yaml,
                affected_bundles=affected,
                pool=entry.pool,
                bundle_pool_config_hashes={b: pool_hashes[b] for b in affected},
                bundle_adapters={b: adapters[b] for b in affected},
            )
            for bundle in affected
            if entry is not None
        ]
        deltas += [
            ConfigDelta(
                router_id=self.router_id,
                bundle_id=bundle,
                epoch=state.epoch,
                bundle_config_hash=hashes.get(bundle, ""),
                model_id=model_id,
                deleted=True,
                affected_bundles=affected,
                pool=previous_pool or "default",
                bundle_pool_config_hashes={bundle: pool_hashes.get(bundle, {})},
                bundle_adapters={bundle: adapters.get(bundle, [])},
            )
            for bundle in previous_bundles or []
            if bundle not in affected
        ]
        return deltas

    async def _publish(self, deltas: list[ConfigDelta]) -> list[str]:
        if self.publisher is None or not deltas:
            return []
        epoch = deltas[0].epoch
        messages: list[tuple[str, bytes]] = []
        for delta in deltas:
            payload = encode_config_delta(delta)
            messages.append((config_subject(delta.bundle_id), payload))
            messages.append((CONFIG_ALL, payload))
        failed = await self.publisher.publish(messages)
        if not failed:
            self.metrics.publishes.labels("success").inc()
            return []
        if len(failed) == len(messages):
            self.metrics.publishes.labels("failure").inc()
            return [
                f"nats_publish_failed: the change is stored (epoch {epoch}) but no delta was published; "
                "gateways and sidecars pick it up from their epoch poll"
            ]
        self.metrics.publishes.labels("partial").inc()
        return [f"nats_publish_partial: publishing to {sorted(set(failed))} failed; pollers will catch up"]

"""The config service over a real nats-server and a real database (SQLite, and PostgreSQL when
127.0.0.1:5432 answers): write path, deltas, replay, conflicts, restart, NATS outage, failover."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import nats
import pytest
import yaml

from config_service.main import serve
from protocol.config_delta import decode_config_delta
from protocol.model_config import parse_model_yaml
from protocol.subjects import CONFIG_ALL, config_subject
from tests.integration.config_service.conftest import (
    ADMIN,
    INFER,
    READ,
    dense_model,
    make_settings,
    wait_ready,
)
from tests.support import postgres
from tests.support.polling import wait_until

NEW_MODEL = dense_model("acme/dense-small")

CHANGED_DEFAULT = NEW_MODEL.replace("max_batch_tokens: 4096", "max_batch_tokens: 2048")

APPEND_PROFILE = """\
sie_id: acme/dense-small
profiles:
  short:
    extends: default
    adapter_options:
      runtime: {max_seq_length: 128}
"""

UNKNOWN_KEY = NEW_MODEL + "colour: blue\n"


async def collect(nc, subject: str) -> tuple[list, object]:
    got: list = []

    async def cb(msg):
        got.append(msg)

    sub = await nc.subscribe(subject, cb=cb)
    return got, sub


async def test_post_publishes_delta_on_bundle_and_all_subjects(service, nc):
    inst = await service()
    per_bundle, _ = await collect(nc, config_subject("default"))
    rerank, _ = await collect(nc, config_subject("rerank"))
    all_msgs, _ = await collect(nc, CONFIG_ALL)
    await nc.flush()
    async with inst.client() as c:
        epoch0 = (await c.get("/v1/configs/epoch")).json()["epoch"]
        r = await c.post(
            "/v1/configs/models", content=NEW_MODEL, headers={"Content-Type": "application/x-yaml"}
        )
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["model_id"] == "acme/dense-small"
        assert body["created_profiles"] == ["default"]
        assert body["routable_bundles_by_profile"] == {"default": ["default", "rerank"]}
        assert body["router_id"] == "sie-config-test"
        assert body["warnings"] == []
        export = (await c.get("/v1/configs/export")).json()
    await wait_until(lambda: per_bundle and rerank and len(all_msgs) == 2, what="deltas")
    delta = decode_config_delta(per_bundle[0].data)
    assert delta.bundle_id == "default"
    assert delta.router_id == "sie-config-test"
    assert delta.epoch == epoch0 + 1 == export["epoch"]
    assert delta.model_id == "acme/dense-small"
    assert delta.profiles_added == ["default"]
    assert delta.affected_bundles == ["default", "rerank"]
    assert delta.pool == "default"
    assert delta.bundle_config_hash == export["bundle_config_hashes"]["default"] != ""
    assert delta.bundle_pool_config_hashes["default"]["default"] == delta.bundle_config_hash
    assert delta.bundle_adapters["rerank"] == ["worker.adapters.dense", "worker.adapters.cross_encoder"]
    assert parse_model_yaml(delta.model_config_yaml).profiles["default"].max_batch_tokens == 4096
    assert decode_config_delta(rerank[0].data).bundle_id == "rerank"
    # the same bytes go to _all, one message per affected bundle
    assert sorted(m.data for m in all_msgs) == sorted([per_bundle[0].data, rerank[0].data])


async def test_contract_check_29_round_trip(service):
    """Contract section 10, check 29, against the service (httpx, admin token)."""
    inst = await service()
    async with inst.client() as c:
        r = await c.post("/v1/configs/models", content=NEW_MODEL, headers={"Idempotency-Key": "k-1"})
        assert r.status_code == 201, r.text
        assert r.json()["created_profiles"] == ["default"]
        epoch = (await c.get("/v1/configs/epoch")).json()
        assert epoch["epoch"] >= 1 and epoch["bundles_hash"] and epoch["bundle_config_hashes_hash"]

        r = await c.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 200, r.text
        assert r.json()["existing_profiles_skipped"] == ["default"]
        assert r.json()["created_profiles"] == []
        assert (await c.get("/v1/configs/epoch")).json() == epoch

        # the same key and body replays the first answer verbatim
        r = await c.post("/v1/configs/models", content=NEW_MODEL, headers={"Idempotency-Key": "k-1"})
        assert r.status_code == 201 and r.json()["created_profiles"] == ["default"]

        r = await c.post("/v1/configs/models", content=APPEND_PROFILE, headers={"Idempotency-Key": "k-1"})
        assert r.status_code == 422
        assert r.json()["detail"]["error"] == "idempotency_mismatch"

        r = await c.post("/v1/configs/models", content=CHANGED_DEFAULT)
        assert r.status_code == 409
        detail = r.json()["detail"]
        assert detail["error"] == "content_conflict"
        assert detail["conflicting_profiles"] == ["default"]
        assert detail["model_id"] == "acme/dense-small"

        r = await c.post("/v1/configs/models", content=UNKNOWN_KEY)
        assert r.status_code == 422
        detail = r.json()["detail"]
        assert detail["error"] == "validation_error"
        assert detail["details"][0]["loc"] == ["colour"]
        assert "Unknown field" in detail["details"][0]["message"]

        # nothing above changed the epoch
        assert (await c.get("/v1/configs/epoch")).json() == epoch

        export = (await c.get("/v1/configs/export")).json()
        assert export["snapshot_version"] == 1
        assert export["epoch"] == epoch["epoch"]
        models = {m["model_id"]: m for m in export["models"]}
        assert models["acme/dense-small"]["source"] == "api"
        assert models["acme/dense-small"]["affected_bundles"] == ["default", "rerank"]
        assert models["acme/dense-small"]["model_config"]["profiles"]["default"]["max_batch_tokens"] == 4096
        assert models["baseline/minilm"]["source"] == "filesystem"


async def test_append_profile_and_reads(service):
    inst = await service()
    async with inst.client() as c:
        assert (await c.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        e1 = (await c.get("/v1/configs/epoch")).json()["epoch"]
        r = await c.post("/v1/configs/models", content=APPEND_PROFILE)
        assert r.status_code == 201, r.text
        assert r.json()["created_profiles"] == ["short"]
        assert r.json()["routable_bundles_by_profile"]["short"] == ["default", "rerank"]
        assert (await c.get("/v1/configs/epoch")).json()["epoch"] == e1 + 1

        # JSON is YAML too: the model's merged config, posted as JSON, is a pure replay
        r = await c.get("/v1/configs/models/acme/dense-small")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-yaml")
        stored = yaml.safe_load(r.text)
        assert set(stored["profiles"]) == {"default", "short"}
        assert stored["hf_id"] == "acme/dense-small"  # omitted top-level fields are preserved
        r = await c.post(
            "/v1/configs/models", content=json.dumps(stored), headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 200 and sorted(r.json()["existing_profiles_skipped"]) == ["default", "short"]

        listing = (await c.get("/v1/configs/models")).json()["models"]
        assert {"model_id": "acme/dense-small", "profiles": ["default", "short"], "source": "api"} in listing
        assert {"model_id": "baseline/minilm", "profiles": ["default"], "source": "filesystem"} in listing
        r = await c.get("/v1/configs/models/nope/missing")
        assert r.status_code == 404 and r.json()["detail"]["error"] == "model_not_found"

        bundles = (await c.get("/v1/configs/bundles")).json()["bundles"]
        assert [b["bundle_id"] for b in bundles] == ["default", "rerank"]
        assert bundles[0] == {
            "bundle_id": "default",
            "engine": "pytorch",
            "priority": 10,
            "adapter_count": 2,
            "source": "filesystem",
        }
        r = await c.get("/v1/configs/bundles/rerank")
        assert yaml.safe_load(r.text)["adapters"] == [
            "worker.adapters.dense",
            "worker.adapters.cross_encoder",
        ]
        r = await c.get("/v1/configs/bundles/none")
        assert r.status_code == 404 and r.json()["detail"] == {
            "error": "bundle_not_found",
            "message": "bundle 'none' is not known",
            "bundle_id": "none",
        }

        # appending to a filesystem baseline model stores the merged config as an API model
        r = await c.post(
            "/v1/configs/models",
            content="sie_id: baseline/minilm\nprofiles:\n  big:\n    extends: default\n    max_batch_tokens: 16384\n",
        )
        assert r.status_code == 201, r.text
        export = (await c.get("/v1/configs/export")).json()
        minilm = next(m for m in export["models"] if m["model_id"] == "baseline/minilm")
        assert minilm["source"] == "api" and set(minilm["model_config"]["profiles"]) == {"default", "big"}
        assert minilm["model_config"]["hf_id"] == "sentence-transformers/all-MiniLM-L6-v2"


async def test_bad_input_is_refused_with_clear_errors(service):
    inst = await service()
    async with inst.client() as c:
        epoch = (await c.get("/v1/configs/epoch")).json()

        async def post(body, status, code):
            r = await c.post("/v1/configs/models", content=body)
            assert r.status_code == status, r.text
            assert r.json()["detail"]["error"] == code, r.text
            return r.json()["detail"]

        await post("sie_id: [unclosed", 400, "parse_error")
        await post("- a\n- b\n", 400, "parse_error")
        await post(NEW_MODEL.replace("acme/dense-small", "acme/../x"), 400, "invalid_model_id")
        await post(NEW_MODEL.replace("acme/dense-small", "acme/status"), 400, "invalid_model_id")
        d = await post(
            NEW_MODEL.replace("worker.adapters.dense:", "worker.adapters.nothere:"), 422, "validation_error"
        )
        assert "Adapter(s) not in any known bundle: worker.adapters.nothere" in d["message"]
        await post(
            "profiles:\n  default:\n    adapter_path: worker.adapters.dense:D\n    max_batch_tokens: 1\n",
            422,
            "validation_error",
        )
        await post("sie_id: acme/x\nprofiles: {}\n", 422, "validation_error")
        await post("sie_id: acme/x\nprofiles: [a]\n", 422, "validation_error")
        await post(
            NEW_MODEL.replace("max_batch_tokens: 4096", "max_batch_tokens: many"), 422, "validation_error"
        )
        await post(
            NEW_MODEL.replace("max_batch_tokens: 4096", "max_batch_tokens: 4096\n    colour: red"),
            422,
            "validation_error",
        )
        await post(NEW_MODEL + "pool: _default\n", 422, "validation_error")
        await post(NEW_MODEL + "routing: {policy: threshold}\n", 422, "validation_error")
        await post(b"\xff\xfe", 400, "parse_error")

        # 1 MiB limit: one byte over → 413, nothing stored
        big = NEW_MODEL + "#" + "x" * (1024 * 1024 - len(NEW_MODEL) - 1) + "\n"
        assert len(big.encode()) == 1024 * 1024 + 1
        await post(big, 413, "payload_too_large")
        # exactly at the limit is accepted (a YAML comment pads it)
        at_limit = big[:-2] + "\n"
        r = await c.post("/v1/configs/models", content=at_limit)
        assert r.status_code == 201, r.text[:300]

        # chunked upload without Content-Length is also cut at the limit
        async def chunks():
            for _ in range(17):
                yield b"#" + b"y" * 65535

        r = await c.post("/v1/configs/models", content=chunks())
        assert r.status_code == 413

        r = await c.post(
            "/v1/configs/models",
            content=NEW_MODEL.replace("acme/dense-small", "acme/other"),
            headers={"Idempotency-Key": "k" * 300},
        )
        assert r.status_code == 400 and r.json()["detail"]["error"] == "invalid_idempotency_key"
        assert (await c.get("/v1/configs/epoch")).json()["epoch"] == epoch["epoch"] + 1


async def test_auth_tokens(service):
    inst = await service()
    async with inst.client(token=None) as c:
        r = await c.get("/v1/configs/epoch")
        assert r.status_code == 401 and r.json() == {"detail": "Missing Authorization header"}
        r = await c.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 401
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/readyz")).status_code == 200
        metrics = await c.get("/metrics")
        assert metrics.status_code == 200 and "sie_config_epoch" in metrics.text

        for token in (READ, INFER, ADMIN, f"bearer  {READ}", f"BEARER {ADMIN}"):
            assert (await c.get("/v1/configs/models", headers={"Authorization": token})).status_code == 200
        r = await c.get("/v1/configs/epoch", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 403 and r.json() == {"detail": "Invalid token"}
        # the inference token does not open the export
        assert (
            await c.get("/v1/configs/export", headers={"Authorization": f"Bearer {INFER}"})
        ).status_code == 403
        assert (
            await c.get("/v1/configs/export", headers={"Authorization": f"Bearer {READ}"})
        ).status_code == 200
        # writes need the admin token
        for token in (READ, INFER):
            r = await c.post(
                "/v1/configs/models", content=NEW_MODEL, headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == 403 and r.json() == {
                "detail": "Admin token required for config mutations"
            }
        r = await c.post(
            "/v1/configs/models", content=NEW_MODEL, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert r.status_code == 201
        r = await c.put(
            "/v1/configs/models/acme/dense-small", content=NEW_MODEL, headers={"Authorization": ADMIN}
        )
        # the same content again: an unchanged replace, nothing published
        assert r.status_code == 200 and r.json()["unchanged"] is True
        r = await c.patch(
            "/v1/configs/models/acme/dense-small", content=NEW_MODEL, headers={"Authorization": ADMIN}
        )
        assert r.status_code == 405 and "detail" in r.json()
        metrics = (await c.get("/metrics")).text
        assert 'sie_config_nats_publishes_total{result="success"} 1.0' in metrics
        assert "sie_config_writer 1.0" in metrics


async def test_restart_keeps_models_and_epoch(service):
    inst = await service()
    async with inst.client() as c:
        assert (
            await c.post("/v1/configs/models", content=NEW_MODEL, headers={"Idempotency-Key": "r-1"})
        ).status_code == 201
        assert (await c.post("/v1/configs/models", content=APPEND_PROFILE)).status_code == 201
        before = (await c.get("/v1/configs/epoch")).json()
        export_before = (await c.get("/v1/configs/export")).json()
    await inst.close()
    async with (await inst.start()).client() as c:  # the same settings: a restart
        assert (await c.get("/v1/configs/epoch")).json() == before
        export = (await c.get("/v1/configs/export")).json()
        assert export["epoch"] == before["epoch"] == 2
        assert export["models"] == export_before["models"]
        assert export["bundle_config_hashes"] == export_before["bundle_config_hashes"]
        # idempotency keys survive the restart too
        r = await c.post("/v1/configs/models", content=NEW_MODEL, headers={"Idempotency-Key": "r-1"})
        assert r.status_code == 201 and r.json()["epoch"] == 1
        r = await c.post("/v1/configs/models", content=APPEND_PROFILE, headers={"Idempotency-Key": "r-1"})
        assert r.status_code == 422 and r.json()["detail"]["error"] == "idempotency_mismatch"


async def test_nats_down_refuses_writes_and_persists_nothing(service, nats_server):
    inst = await service()
    async with inst.client() as c:
        before = (await c.get("/v1/configs/epoch")).json()
        nats_server.stop()
        r = await c.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 503, r.text
        assert r.json()["detail"]["error"] == "nats_unavailable"
        # nothing persisted; reads still work
        assert (await c.get("/v1/configs/epoch")).json() == before
        assert (await c.get("/v1/configs/models/acme/dense-small")).status_code == 404
        assert (await c.get("/readyz")).json()["nats_connected"] is False

        nats_server.start()
        await wait_ready(inst.url, writer=True, nats=True)
        nc = await nats.connect(nats_server.url)
        try:
            got, _ = await collect(nc, CONFIG_ALL)
            await nc.flush()
            r = await c.post("/v1/configs/models", content=NEW_MODEL)
            assert r.status_code == 201, r.text
            await wait_until(lambda: len(got) == 2, what="deltas after NATS came back")
            assert decode_config_delta(got[0].data).epoch == before["epoch"] + 1
        finally:
            await nc.close()


async def test_without_bundles_every_write_is_refused(nats_server, db_url, tmp_path, instances):
    empty = tmp_path / "empty"
    empty.mkdir()
    inst = await instances(make_settings(db_url, nats_server.url, (empty, empty))).start()
    async with inst.client() as c:
        r = await c.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 422 and "not in any known bundle" in r.json()["detail"]["message"]
        assert (await c.get("/v1/configs/epoch")).json() == {
            "epoch": 0,
            "bundles_hash": "",
            "bundle_config_hashes_hash": "",
        }


async def test_broken_bundle_file_makes_registry_unavailable(nats_server, db_url, catalog_dirs, instances):
    bundles, models = catalog_dirs
    (bundles / "broken.yaml").write_text("name: broken\nadapters: not-a-list\n")
    inst = instances(make_settings(db_url, nats_server.url, catalog_dirs))
    inst.stop = asyncio.Event()
    inst.task = asyncio.create_task(serve(inst.settings, inst.stop))
    async with inst.client() as c:
        deadline = time.monotonic() + 10
        while True:
            try:
                r = await c.get("/readyz")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        assert r.status_code == 503 and "broken.yaml" in r.json()["reason"]
        r = await c.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 503 and r.json()["detail"]["error"] == "registry_unavailable"
        r = await c.get("/v1/configs/export")
        assert r.status_code == 503 and r.json()["detail"]["error"] == "registry_unavailable"
        r = await c.get("/v1/configs/epoch")  # keeps answering without a registry
        assert r.status_code == 200 and r.json()["epoch"] == 0


async def test_standby_takes_writes_when_the_writer_is_killed(nats_server, db_url, catalog_dirs, spawn):
    """Two ``python -m config_service`` processes on one database; kill -9 the writer."""
    first = spawn(make_settings(db_url, nats_server.url, catalog_dirs), "sie-config-a")
    await wait_ready(first.url, writer=True, nats=True, timeout=60)
    second = spawn(make_settings(db_url, nats_server.url, catalog_dirs), "sie-config-b")
    ready = await wait_ready(second.url, writer=False, nats=True, timeout=60)
    assert ready["writer"] is False

    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(headers=headers, timeout=10) as c:
        # the standby forwards a write to the writer, which answers it
        r = await c.post(f"{second.url}/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 201 and r.json()["router_id"] == "sie-config-a", r.text
        assert r.headers["X-SIE-Config-Writer"] == "sie-config-a"
        r = await c.post(f"{first.url}/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 200 and r.json()["router_id"] == "sie-config-a"  # a replay
        # the standby serves reads of what the writer wrote
        assert (await c.get(f"{second.url}/v1/configs/epoch")).json()["epoch"] == 1
        export = (await c.get(f"{second.url}/v1/configs/export")).json()
        assert "acme/dense-small" in {m["model_id"] for m in export["models"]}

        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        await wait_ready(second.url, writer=True, nats=True, timeout=60)  # a hang guard, not a speed claim

        r = await c.post(f"{second.url}/v1/configs/models", content=APPEND_PROFILE)
        assert r.status_code == 201, r.text
        assert r.json()["router_id"] == "sie-config-b"
        assert r.json()["epoch"] == 2
        r = await c.post(f"{second.url}/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 200  # replay of what the dead writer stored


async def test_concurrent_writes_with_one_idempotency_key_apply_once(service):
    inst = await service()
    async with inst.client() as c:
        rs = await asyncio.gather(
            *[
                c.post("/v1/configs/models", content=NEW_MODEL, headers={"Idempotency-Key": "same"})
                for _ in range(8)
            ]
        )
        assert [r.status_code for r in rs] == [201] * 8
        assert len({r.text for r in rs}) == 1
        # without a key, natural idempotency: one 201, the rest identical replays
        other = NEW_MODEL.replace("acme/dense-small", "acme/other")
        rs = await asyncio.gather(*[c.post("/v1/configs/models", content=other) for _ in range(6)])
        assert sorted(r.status_code for r in rs) == [200] * 5 + [201]
        assert (await c.get("/v1/configs/epoch")).json()["epoch"] == 2


async def test_postgres_writer_that_loses_its_lock_connection_stops_then_reacquires(service, db_url):
    if not db_url.startswith("postgresql"):
        pytest.skip("the advisory-lock connection exists only on PostgreSQL")
    import psycopg

    inst = await service()
    dbname = db_url.rsplit("/", 1)[1]
    user = db_url.split("//", 1)[1].split("@", 1)[0]
    with psycopg.connect(host="127.0.0.1", user=user, dbname="test", autocommit=True) as admin:
        killed = admin.execute(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND d.datname = %s",
            (dbname,),
        ).fetchall()
    assert killed, "the writer should hold an advisory lock"
    statuses = []
    async with inst.client() as c:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            r = await c.post("/v1/configs/models", content=NEW_MODEL)
            statuses.append(r.status_code)
            if r.status_code == 201:
                break
            assert r.status_code == 503 and r.json()["detail"]["error"] == "not_writer", r.text
            await asyncio.sleep(0.1)
        assert statuses[-1] == 201, statuses
        assert (await c.get("/v1/configs/epoch")).json()["epoch"] == 1
        assert (await c.get("/readyz")).json()["writer"] is True


async def test_export_and_epoch_parse_with_the_protocol_models(service):
    from protocol.config_delta import parse_epoch_info, parse_export

    inst = await service()
    async with inst.client(token=READ) as reader, inst.client() as admin:
        first = parse_epoch_info((await reader.get("/v1/configs/epoch")).content)
        assert (await admin.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        second = parse_epoch_info((await reader.get("/v1/configs/epoch")).content)
        assert second.differs_from(first) and not second.differs_from(second)
        export = parse_export((await reader.get("/v1/configs/export")).content)
        assert export.epoch == second.epoch == 1
        assert export.bundle_config_hashes_hash == second.bundle_config_hashes_hash
        model = next(m for m in export.models if m.model_id == "acme/dense-small")
        assert parse_model_yaml(model.raw_yaml).sie_id == model.config["sie_id"] == "acme/dense-small"


def test_writer_locks_of_two_databases_on_one_postgres_server_do_not_collide():
    """Advisory locks are the server's: the key is per database, so two clusters whose config
    databases share a PostgreSQL server each have their writer (and one database, one writer)."""
    from config_service.lock import PostgresLock

    with postgres.databases("sie_cfg", 2, scheme="postgresql+psycopg") as urls:
        locks: list[PostgresLock] = []
        try:
            first, second = (PostgresLock(url) for url in urls)
            again = PostgresLock(urls[0])
            locks += [first, second, again]
            assert first.key != second.key
            assert first.try_acquire() and second.try_acquire()
            assert first.check() and second.check()
            assert not again.try_acquire()  # the same database: still one writer
        finally:
            for lock in locks:
                lock.release()

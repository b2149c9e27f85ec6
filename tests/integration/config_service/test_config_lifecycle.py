"""PUT (replace) and DELETE of model configs, and the write-time checks, over a real nats-server and
a real database (SQLite, and PostgreSQL when 127.0.0.1:5432 answers)."""

from __future__ import annotations

from protocol.config_delta import decode_config_delta
from protocol.model_config import parse_model_yaml
from protocol.subjects import CONFIG_ALL, config_subject
from tests.integration.config_service.conftest import READ, dense_model
from tests.integration.config_service.test_config_service import NEW_MODEL, collect
from tests.support.polling import wait_until

MODEL_ID = "acme/dense-small"
REPLACED = NEW_MODEL.replace("max_batch_tokens: 4096", "max_batch_tokens: 1024")
# the same content as NEW_MODEL, spelled differently (flow style, other key order)
NEW_MODEL_RESPELLED = """\
profiles: {default: {max_batch_tokens: 4096, adapter_path: "worker.adapters.dense:DenseAdapter"}}
tasks: {encode: {dense: {dim: 384}}}
hf_id: acme/dense-small
sie_id: acme/dense-small
"""
# a cross-encoder only: served by the rerank bundle, not by default
MOVED_TO_RERANK = """\
sie_id: acme/dense-small
hf_id: acme/dense-small
tasks:
  score: {}
profiles:
  default:
    adapter_path: worker.adapters.cross_encoder:CrossEncoderAdapter
    max_batch_tokens: 4096
"""
OVERRIDE_BASELINE = dense_model("baseline/minilm", "sentence-transformers/all-MiniLM-L6-v2", 2048)


async def _epoch(c) -> int:
    return (await c.get("/v1/configs/epoch")).json()["epoch"]


async def test_put_replaces_with_a_new_epoch_and_a_delta_and_same_content_is_a_no_op(service, nc):
    inst = await service()
    per_bundle, _ = await collect(nc, config_subject("default"))
    await nc.flush()
    async with inst.client() as c:
        assert (await c.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        e1 = await _epoch(c)
        # the same content, spelled differently: nothing changes
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=NEW_MODEL_RESPELLED)
        assert r.status_code == 200, r.text
        assert r.json()["unchanged"] is True and r.json()["replaced"] is False
        assert await _epoch(c) == e1

        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=REPLACED)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["replaced"] is True and body["unchanged"] is False and body["created"] is False
        assert body["epoch"] == e1 + 1 == await _epoch(c)
        assert body["affected_bundles"] == ["default", "rerank"]
        stored = parse_model_yaml((await c.get(f"/v1/configs/models/{MODEL_ID}")).text)
        assert stored.profiles["default"].max_batch_tokens == 1024
        # a replay of the replace changes nothing more
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=REPLACED)
        assert r.json()["unchanged"] is True and await _epoch(c) == e1 + 1
    await wait_until(lambda: len(per_bundle) == 2, what="two deltas on the default bundle")
    delta = decode_config_delta(per_bundle[1].data)
    assert delta.epoch == e1 + 1 and not delta.deleted
    assert parse_model_yaml(delta.model_config_yaml).profiles["default"].max_batch_tokens == 1024


async def test_put_refusals(service):
    inst = await service()
    async with inst.client() as c:
        assert (await c.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        e1 = await _epoch(c)
        r = await c.put("/v1/configs/models/acme/other", content=REPLACED)
        assert r.status_code == 400 and r.json()["detail"]["error"] == "model_id_mismatch"
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=REPLACED + "pool: elsewhere\n")
        assert r.status_code == 422 and "pool" in r.json()["detail"]["message"]
        # a PUT is a whole config: a partial body fails the schema
        r = await c.put(
            f"/v1/configs/models/{MODEL_ID}",
            content="sie_id: acme/dense-small\nprofiles: {x: {extends: default}}\n",
        )
        assert r.status_code == 422 and r.json()["detail"]["error"] == "validation_error"
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content="[1, 2")
        assert r.status_code == 400 and r.json()["detail"]["error"] == "parse_error"
        assert await _epoch(c) == e1
    async with inst.client(READ) as c:
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=REPLACED)
        assert r.status_code == 403 and r.json()["detail"] == "Admin token required for config mutations"
        r = await c.delete(f"/v1/configs/models/{MODEL_ID}")
        assert r.status_code == 403
    async with inst.client(None) as c:
        assert (await c.delete(f"/v1/configs/models/{MODEL_ID}")).status_code == 401


async def test_put_that_moves_a_model_off_a_bundle_tombstones_it_there(service, nc):
    inst = await service()
    default, _ = await collect(nc, config_subject("default"))
    rerank, _ = await collect(nc, config_subject("rerank"))
    await nc.flush()
    async with inst.client() as c:
        assert (await c.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=MOVED_TO_RERANK)
        assert r.status_code == 200 and r.json()["affected_bundles"] == ["rerank"]
        export = (await c.get("/v1/configs/export")).json()
    await wait_until(lambda: len(default) == 2 and len(rerank) == 2, what="deltas")
    gone = decode_config_delta(default[1].data)
    assert gone.is_tombstone and gone.model_id == MODEL_ID and not gone.model_config_yaml
    assert gone.bundle_config_hash == export["bundle_config_hashes"]["default"]
    moved = decode_config_delta(rerank[1].data)
    assert not moved.deleted and "cross_encoder" in moved.model_config_yaml


async def test_delete_tombstones_persists_and_is_idempotent(service, nc):
    inst = await service()
    all_msgs, _ = await collect(nc, CONFIG_ALL)
    await nc.flush()
    async with inst.client() as c:
        assert (await c.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        e1 = await _epoch(c)
        r = await c.delete(f"/v1/configs/models/{MODEL_ID}")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["deleted"] is True and body["unchanged"] is False and body["fallback"] is None
        assert body["epoch"] == e1 + 1 and body["affected_bundles"] == ["default", "rerank"]
        r = await c.get(f"/v1/configs/models/{MODEL_ID}")
        assert r.status_code == 404 and r.json()["detail"]["error"] == "model_not_found"
        # again: success, nothing changes
        r = await c.delete(f"/v1/configs/models/{MODEL_ID}")
        assert r.status_code == 200 and r.json()["deleted"] is False and r.json()["unchanged"] is True
        assert await _epoch(c) == e1 + 1
        r = await c.delete("/v1/configs/models/never/existed")
        assert r.status_code == 200 and r.json()["deleted"] is False
    await wait_until(lambda: len(all_msgs) == 4, what="2 adds + 2 tombstones on _all")
    tombstones = [decode_config_delta(m.data) for m in all_msgs[2:]]
    assert {t.bundle_id for t in tombstones} == {"default", "rerank"}
    assert all(t.is_tombstone and t.epoch == e1 + 1 and t.model_id == MODEL_ID for t in tombstones)
    await inst.close()
    async with (await inst.start()).client() as c:  # the same settings: a restart
        assert await _epoch(c) == e1 + 1
        export = (await c.get("/v1/configs/export")).json()
        assert MODEL_ID not in {m["model_id"] for m in export["models"]}
        # and it can be added again, at a newer epoch
        r = await c.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 201 and r.json()["epoch"] == e1 + 2


async def test_delete_of_an_override_brings_the_filesystem_config_back(service, nc):
    inst = await service()
    default, _ = await collect(nc, config_subject("default"))
    await nc.flush()
    async with inst.client() as c:
        r = await c.put("/v1/configs/models/baseline/minilm", content=OVERRIDE_BASELINE)
        assert r.status_code == 200 and r.json()["replaced"] is True
        models = {m["model_id"]: m for m in (await c.get("/v1/configs/models")).json()["models"]}
        assert models["baseline/minilm"]["source"] == "api"
        r = await c.delete("/v1/configs/models/baseline/minilm")
        assert r.json()["deleted"] is True and r.json()["fallback"] == "filesystem"
        stored = parse_model_yaml((await c.get("/v1/configs/models/baseline/minilm")).text)
        assert stored.profiles["default"].max_batch_tokens == 8192
        # a PUT of exactly the image's config changes nothing either
        r = await c.put(
            "/v1/configs/models/baseline/minilm", content=OVERRIDE_BASELINE.replace("2048", "8192")
        )
        assert r.json()["unchanged"] is True
        models = {m["model_id"]: m for m in (await c.get("/v1/configs/models")).json()["models"]}
        assert models["baseline/minilm"]["source"] == "filesystem"
        # rollout status lives on the gateway; the config service says where
        r = await c.get("/v1/configs/models/baseline/minilm/status")
        assert r.status_code == 404 and "served by the gateway" in r.json()["detail"]["message"]
        # the image's config cannot be deleted through the API: success, nothing changes
        e = await _epoch(c)
        r = await c.delete("/v1/configs/models/baseline/minilm")
        assert r.json() | {"epoch": 0} == {
            "model_id": "baseline/minilm",
            "deleted": False,
            "unchanged": True,
            "fallback": "filesystem",
            "affected_bundles": [],
            "epoch": 0,
            "distribution": "epoch_export",
        }
        assert await _epoch(c) == e
    await wait_until(lambda: len(default) == 2, what="replace + restore deltas")
    restore = decode_config_delta(default[1].data)
    assert not restore.deleted
    assert parse_model_yaml(restore.model_config_yaml).profiles["default"].max_batch_tokens == 8192


async def test_write_time_checks_weights_path_and_runtime_options(service, tmp_path):
    inst = await service()
    local_only = NEW_MODEL.replace("hf_id: acme/dense-small", f"weights_path: {tmp_path / 'nowhere'}")
    async with inst.client() as c:
        e0 = await _epoch(c)
        r = await c.post("/v1/configs/models", content=local_only)
        assert r.status_code == 400, r.text
        detail = r.json()["detail"]
        assert detail["error"] == "invalid_weights_path" and "nowhere" in detail["message"]
        r = await c.put(f"/v1/configs/models/{MODEL_ID}", content=local_only)
        assert r.status_code == 400 and r.json()["detail"]["error"] == "invalid_weights_path"
        assert await _epoch(c) == e0
        # with another source the worker falls back to it: accepted, with a warning
        r = await c.post("/v1/configs/models", content=NEW_MODEL + f"weights_path: {tmp_path / 'nowhere'}\n")
        assert r.status_code == 201 and "does not exist" in r.json()["warnings"][0]
        # a directory the service sees is fine
        (tmp_path / "weights").mkdir()
        ok = local_only.replace("nowhere", "weights").replace(MODEL_ID, "acme/local")
        r = await c.post("/v1/configs/models", content=ok)
        assert r.status_code == 201 and r.json()["warnings"] == []
        bad_options = NEW_MODEL.replace(
            "max_batch_tokens: 4096",
            "max_batch_tokens: 4096\n    adapter_options: {runtime: {max_seq_length: -3, output_dtype: float64}}",
        ).replace(MODEL_ID, "acme/bad-options")
        r = await c.post("/v1/configs/models", content=bad_options)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert detail["error"] == "validation_error"
        assert detail["details"][0]["loc"] == ["profiles", "default", "adapter_options", "runtime"]
        assert "output_dtype" in detail["details"][0]["message"]
        bad_pooling = bad_options.replace("max_seq_length: -3, output_dtype: float64", "pooling: median")
        r = await c.post("/v1/configs/models", content=bad_pooling)
        assert (
            r.status_code == 422 and "pooling must be one of" in r.json()["detail"]["details"][0]["message"]
        )
        # load-time options: only those the adapter reads, of the type it reads
        bad_loadtime = bad_options.replace(
            "runtime: {max_seq_length: -3, output_dtype: float64}", "loadtime: {pakced: true, packed: 'yes'}"
        )
        r = await c.post("/v1/configs/models", content=bad_loadtime)
        assert r.status_code == 422, r.text
        details = {tuple(d["loc"]): d["message"] for d in r.json()["detail"]["details"]}
        assert set(details) == {
            ("profiles", "default", "adapter_options", "loadtime", "packed"),
            ("profiles", "default", "adapter_options", "loadtime", "pakced"),
        }
        assert "must be a bool" in details[("profiles", "default", "adapter_options", "loadtime", "packed")]
        assert (
            "no load-time option 'pakced'"
            in details[("profiles", "default", "adapter_options", "loadtime", "pakced")]
        )
        # a misspelt class of a shipped adapter module
        typo = NEW_MODEL.replace("DenseAdapter", "DenseAdaptor").replace(MODEL_ID, "acme/typo")
        r = await c.post("/v1/configs/models", content=typo)
        assert r.status_code == 422 and "unknown adapter 'worker.adapters.dense:DenseAdaptor'" in r.text
        good = bad_options.replace(
            "runtime: {max_seq_length: -3, output_dtype: float64}", "loadtime: {packed: false}"
        )
        assert (await c.post("/v1/configs/models", content=good)).status_code == 201


async def test_put_idempotency_key_and_body_limit(service):
    inst = await service(config_max_body_bytes=4096)
    async with inst.client() as c:
        assert (await c.post("/v1/configs/models", content=NEW_MODEL)).status_code == 201
        path = f"/v1/configs/models/{MODEL_ID}"
        first = await c.put(path, content=REPLACED, headers={"Idempotency-Key": "put-1"})
        assert first.status_code == 200 and first.json()["replaced"] is True
        e = await _epoch(c)
        # the same key and body: the first answer replayed verbatim (not "unchanged")
        again = await c.put(path, content=REPLACED, headers={"Idempotency-Key": "put-1"})
        assert again.json() == first.json() and await _epoch(c) == e
        r = await c.put(path, content=NEW_MODEL, headers={"Idempotency-Key": "put-1"})
        assert r.status_code == 422 and r.json()["detail"]["error"] == "idempotency_mismatch"
        # a key used by a POST is another request: it is not replayed for a PUT of the same bytes
        r = await c.post("/v1/configs/models", content=REPLACED, headers={"Idempotency-Key": "k"})
        assert r.status_code == 200 and r.json()["existing_profiles_skipped"] == ["default"]
        r = await c.put(path, content=REPLACED, headers={"Idempotency-Key": "k"})
        assert r.status_code == 422 and r.json()["detail"]["error"] == "idempotency_mismatch"
        r = await c.put(path, content=REPLACED, headers={"Idempotency-Key": "x" * 300})
        assert r.status_code == 400 and r.json()["detail"]["error"] == "invalid_idempotency_key"
        r = await c.put(path, content=REPLACED + "#" * 5000)
        assert r.status_code == 413 and r.json()["detail"]["error"] == "payload_too_large"
        assert await _epoch(c) == e

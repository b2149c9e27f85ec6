"""Property-based fuzzing of every config-service route (issue 12): no 5xx, no hang, and a normal
write and read still succeed afterwards. Real wiring (config_service.main.serve), SQLite, nats-server."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from config_service.app import Auth, create_app
from tests.integration.config_service.conftest import ADMIN, INFER, READ, Instance, dense_model, make_settings
from tests.support.fuzz import (
    FUZZ_SETTINGS,
    HEADER_TEXT,
    NO_HANG_S,
    OUTCOMES,
    LoopThread,
    Vocabulary,
    assert_no_5xx,
    json_values,
    requests_for,
    send,
    texts,
)

MODELS = ["baseline/minilm", "acme/fuzz", "acme/fuzz:default"]
ADAPTERS = ["worker.adapters.dense:DenseAdapter", "worker.adapters.cross_encoder:X", "nothere:Y"]
profile = st.fixed_dictionaries(
    {},
    optional={
        "adapter_path": st.one_of(st.sampled_from(ADAPTERS), json_values),
        "max_batch_tokens": st.one_of(st.integers(-5, 10**6), json_values),
        "extends": st.one_of(st.sampled_from(["default", "x"]), json_values),
        "adapter_options": json_values,
    },
)
CONFIG_FIELDS = {
    "sie_id": st.one_of(st.sampled_from(MODELS), texts, json_values),
    "hf_id": st.one_of(texts, json_values),
    "tasks": st.one_of(st.just({"encode": {"dense": {"dim": 384}}}), json_values),
    "profiles": st.one_of(
        st.dictionaries(st.sampled_from(["default", "q", "x"]), profile, max_size=2), json_values
    ),
    "pool": st.one_of(st.sampled_from(["default", "_default", "gpu"]), json_values),
    "routing": json_values,
    "model": st.one_of(st.sampled_from(MODELS), texts, json_values),
    "bundle": st.one_of(st.sampled_from(["default", "rerank"]), json_values),
}
VALID = dense_model("acme/after-fuzz")


@pytest.fixture
def config_service(nats_server, tmp_path, catalog_dirs):
    settings = make_settings(
        f"sqlite:///{tmp_path / 'state' / 'config.db'}",
        nats_server.url,
        catalog_dirs,
        config_body_timeout_s=5.0,
    )
    loop = LoopThread()
    inst = Instance(settings)
    loop.run(inst.start())
    client = httpx.Client(base_url=inst.url, timeout=NO_HANG_S, headers={"Authorization": f"Bearer {ADMIN}"})
    try:
        yield client
    finally:
        client.close()
        loop.run(inst.close())
        loop.close()


def normal_requests_succeed(client: httpx.Client) -> None:
    r = client.post("/v1/configs/models", content=VALID, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code in (200, 201), r.text
    r = client.get("/v1/configs/models/acme/after-fuzz", headers={"Authorization": f"Bearer {READ}"})
    assert r.status_code == 200 and "acme/after-fuzz" in r.text, r.text


def test_fuzz_every_config_route(config_service):
    client = config_service
    routes = create_app(None, Auth())  # type: ignore[arg-type] - only its route table is used
    tokens = st.one_of(st.sampled_from([f"Bearer {t}" for t in (ADMIN, READ, INFER)]), HEADER_TEXT)

    @FUZZ_SETTINGS
    @given(
        requests_for(
            routes, Vocabulary(MODELS, CONFIG_FIELDS), header_values={"Authorization": tokens}, yaml_too=True
        )
    )
    def fuzz(req):
        assert_no_5xx(send(client, req), req)

    fuzz()
    print("config service fuzz outcomes:", dict(OUTCOMES.most_common()))
    normal_requests_succeed(client)

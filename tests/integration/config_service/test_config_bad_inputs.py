"""Config-service inputs that once answered 500 or hung (issue 12): each is a 4xx parse_error."""

from __future__ import annotations

import pytest

from tests.integration.config_service.conftest import ADMIN
from tests.support.fuzz import answer_to_a_short_body

DEEP_FLOW = "sie_id: " + "[" * 1000 + "]" * 1000 + "\n"
DEEP_BLOCK = "sie_id: acme/x\nx:\n" + "".join("  " * i + "- \n" for i in range(1, 400))
DEEP_JSON = '{"sie_id": "acme/x", "x": ' + "[" * 1000 + "]" * 1000 + "}"
HUGE_INT = "sie_id: 1" + "0" * 4300 + "\n"
SURROGATE = 'sie_id: "acme/\\ud800"\nprofiles: {}\n'


@pytest.mark.parametrize(
    "body",
    [DEEP_FLOW, DEEP_BLOCK, DEEP_JSON, HUGE_INT, SURROGATE],
    ids=["yaml-deep-flow", "yaml-deep-block", "json-deep", "huge-int", "surrogate"],
)
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_hostile_model_bodies_are_parse_errors(service, body):
    inst = await service()
    async with inst.client() as c:
        r = await c.post("/v1/configs/models", content=body)
        assert r.status_code == 400, r.text[:500]
        assert r.json()["detail"]["error"] == "parse_error"
        r = await c.post("/v1/configs/resolve", content=DEEP_JSON)
        assert r.status_code == 400 and r.json()["detail"]["error"] == "parse_error", r.text[:500]
        r = await c.post("/v1/configs/resolve", content='{"model": ' + HUGE_INT[8:] + "}")
        assert r.status_code == 400 and r.json()["detail"]["error"] == "parse_error", r.text[:500]
        assert (await c.get("/v1/configs/models")).status_code == 200


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_body_shorter_than_its_content_length_times_out(service):
    inst = await service(config_body_timeout_s=1.0)
    head = f"POST /v1/configs/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
    answer = await answer_to_a_short_body("127.0.0.1", inst.settings.config_port, head, "sie_id: acme/x\n")
    assert answer.split(b" ")[1] == b"408", answer

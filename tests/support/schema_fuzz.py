"""Schemathesis against a running service, from the service's own ``/openapi.json``: every
documented operation gets generated requests (JSON, msgpack and YAML bodies as documented, valid
and invalid ones); no answer may be a 5xx, take longer than ``NO_HANG_S``, or differ from the
document (status, content type, headers, body schema). Generation is derandomized, so a run is
repeatable."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgpack
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

NO_HANG_S = 60.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def _packable(value: Any) -> Any:
    """msgpack has 64-bit integers only: a larger generated integer travels as a float."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, dict):
        return {k: _packable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_packable(v) for v in value]
    return value


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(_packable(value), use_bin_type=True)


def _body_examples(doc: dict[str, Any], method: str, path: str) -> list[Any]:
    body = doc["paths"][path][method.lower()].get("requestBody")
    if not body or "application/json" not in body["content"]:
        return []
    ref = body["content"]["application/json"]["schema"].get("$ref", "")
    schema = doc["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
    return list(schema.get("examples", []))


def fuzz_service(
    url: str,
    *,
    max_examples: int,
    headers: dict[str, str] | None = None,
    path_values: dict[str, list[str]] | None = None,
) -> Counter[str]:
    """Run every operation of ``url``'s document; returns how many answers of each status came back.
    ``path_values``: real values a path parameter takes in about half the cases (a model id), so
    the requests reach past the 404 of an unknown name."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    statuses: Counter[str] = Counter()
    # JSON answers: msgpack ones cannot be schema-checked
    sent_headers = {"Accept": "application/json", **(headers or {})}
    for result in schema.get_all_operations():
        _fuzz_operation(
            result.ok(), url, max_examples, sent_headers, path_values or {}, statuses, schema.raw_schema
        )
    return statuses


def _fuzz_operation(
    op: Any,
    url: str,
    max_examples: int,
    sent_headers: dict[str, str],
    path_values: dict[str, list[str]],
    statuses: Counter[str],
    raw: dict[str, Any],
) -> None:
    """The documented examples of one operation, then ``max_examples`` generated requests."""
    # schema-valid requests and invalid ones (each must be refused with a documented 4xx)
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
    # the documented examples first: each must be answered as the document says
    for example in _body_examples(raw, op.method, op.path):
        params = {name: values[0] for name, values in path_values.items() if "{" + name + "}" in op.path}
        case = op.Case(body=example, media_type="application/json", path_parameters=params)
        response = case.call_and_validate(
            base_url=url, headers=sent_headers, checks=CHECKS, timeout=NO_HANG_S
        )
        statuses[f"{op.method.upper()} {op.path} {response.status_code}"] += 1

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(strategy)
        for name, values in path_values.items():
            if case.path_parameters and name in case.path_parameters and data.draw(st.booleans()):
                case.path_parameters[name] = data.draw(st.sampled_from(values))
        response = case.call_and_validate(
            base_url=url, headers=sent_headers, checks=CHECKS, timeout=NO_HANG_S
        )
        statuses[f"{op.method.upper()} {op.path} {response.status_code}"] += 1

    run()

"""Property-based HTTP fuzzing shared by the gateway, `sie serve` and config-service fuzz suites.

The server under test runs in an event loop on a background thread (``LoopThread``), so the
hypothesis tests themselves are plain synchronous functions that send real HTTP requests with
httpx. ``requests_for(app, ...)`` draws requests for every route the aiohttp app has (path
parameters, methods, headers, query strings and bodies: structure-aware JSON/msgpack/YAML
documents with hostile leaves, deep nesting, huge integers, lone surrogates, raw bytes).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import yaml
from aiohttp import web
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from protocol.codec import packb

# Bounded so each suite stays well under a minute in the default run.
FUZZ_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    database=None,
)
OUTCOMES: Counter[str] = Counter()  # status (and error code) of every fuzzed request; pytest -s shows them
NO_HANG_S = 20.0  # generous: a request that takes longer than this counts as a hang


async def answer_to_a_short_body(host: str, port: int, head: str, body_start: str) -> bytes:
    """Send a request whose body stops short of its ``Content-Length: 1000`` (``head``: the request
    line and headers but that one) and return the head of the server's answer."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"{head}Content-Length: 1000\r\n\r\n{body_start}".encode())
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # generous: "no hang"
    finally:
        writer.close()


class LoopThread:
    """An asyncio loop on a daemon thread; ``run`` executes a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def serve_app(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on a free loopback port (call inside the LoopThread)."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


# ---- leaves and documents ------------------------------------------------------------------

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.one_of(
    st.text(max_size=24),
    st.text(alphabet=st.one_of(st.characters(), SURROGATES), max_size=8),
    st.sampled_from(["", " ", "\x00", "a" * 3000, "Hello World", "../..", "%2e%2e", "🙂" * 5]),
)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([0, -1, 2**63, 2**64, -(2**63) - 1]),  # past 4,300 digits: see the raw bodies
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)


def deep(n: int, open_: str = "[", close: str = "]") -> str:
    return open_ * n + close * n


@dataclass
class Vocabulary:
    """What a process's bodies are made of: field names and the values that make sense for them."""

    models: list[str]
    fields: dict[str, st.SearchStrategy] = field(default_factory=dict)


def item_strategy() -> st.SearchStrategy:
    return st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "text": st.one_of(texts, json_values),
                "id": st.one_of(texts, json_values),
                "images": json_values,
                "metadata": json_values,
            },
        ),
        json_values,
    )


def inference_fields(models: list[str]) -> dict[str, st.SearchStrategy]:
    model = st.one_of(st.sampled_from(models), texts)
    return {
        "items": st.one_of(st.lists(item_strategy(), max_size=5), json_values),
        "query": st.one_of(item_strategy(), json_values),
        "options": json_values,
        "params": json_values,
        "output_types": st.one_of(
            st.lists(st.sampled_from(["dense", "sparse", "multivector", "x"])), json_values
        ),
        "labels": st.one_of(st.lists(texts, max_size=3), json_values),
        "instruction": st.one_of(texts, json_values),
        "model": model,
        "input": st.one_of(texts, st.lists(texts, max_size=4), json_values),
        "encoding_format": st.one_of(st.sampled_from(["float", "base64", "x"]), json_values),
        "dimensions": st.one_of(st.integers(-2, 5000), json_values),
        "name": st.one_of(texts, json_values),
        "gpus": json_values,
        "ttl_s": numbers,
    }


def documents(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.one_of(st.fixed_dictionaries({}, optional=fields), json_values)


def encode_json(doc: Any) -> bytes:
    # ensure_ascii writes a lone surrogate as a \\udXXX escape, as a hostile client would
    return json.dumps(doc, allow_nan=True).encode()


def encode_msgpack(doc: Any) -> bytes:
    try:
        return packb(doc)
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
        return encode_json(doc)


def encode_yaml(doc: Any) -> bytes:
    try:
        return yaml.safe_dump(doc, allow_unicode=False).encode()
    except (yaml.YAMLError, UnicodeEncodeError, RecursionError):
        return encode_json(doc)


def bodies(docs: st.SearchStrategy, *, yaml_too: bool = False) -> st.SearchStrategy:
    """(content type, raw body) pairs."""
    encoders = [("application/json", encode_json), ("application/msgpack", encode_msgpack)]
    if yaml_too:
        encoders.append(("application/x-yaml", encode_yaml))
    structured = st.tuples(st.sampled_from(encoders), docs).map(lambda t: (t[0][0], t[0][1](t[1])))
    hostile = st.tuples(
        st.sampled_from(["application/json", "application/msgpack", "text/plain", "", "application/x-yaml"]),
        st.one_of(
            st.binary(max_size=64),
            st.integers(1, 3000).map(lambda n: deep(n).encode()),
            st.integers(1, 3000).map(lambda n: ('{"items":' + deep(n) + "}").encode()),
            st.integers(1, 1200).map(lambda n: ("sie_id: " + deep(n) + "\n").encode()),
            st.integers(4000, 6000).map(lambda n: ("1" + "0" * n).encode()),
            st.integers(4000, 6000).map(lambda n: ("sie_id: 1" + "0" * n + "\n").encode()),
            st.sampled_from(
                [
                    b"",
                    b"{",
                    b'{"items":[{"text":"\\ud800"}]}',
                    b'{"input":"\\udfff"}',
                    b"\xff\xfe",
                    b"null",
                    b"[]",
                ]
            ),
        ),
    )
    return st.one_of(structured, structured, hostile)


# ---- requests ------------------------------------------------------------------------------

# h11 refuses to send a header value with surrounding whitespace; servers never see one
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20).map(
    str.strip
)
_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")


@dataclass
class Req:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None
    params: dict[str, str]

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        body = self.body if self.body is None or len(self.body) < 300 else self.body[:300] + b"..."
        return f"Req({self.method} {self.path} params={self.params} headers={self.headers} body={body!r})"


def routes_of(app: web.Application) -> list[tuple[str, str]]:
    out = []
    for route in app.router.routes():
        info = route.resource.canonical if route.resource is not None else None
        if info and route.method != "HEAD":
            out.append((route.method, info))
    return sorted(set(out))


@st.composite
def requests_for(
    draw: st.DrawFn,
    app: web.Application,
    vocabulary: Vocabulary,
    *,
    header_values: dict[str, st.SearchStrategy] | None = None,
    yaml_too: bool = False,
) -> Req:
    routes = routes_of(app)
    with_body = [r for r in routes if r[0] in ("POST", "PUT", "PATCH")] or routes
    method, template = draw(st.one_of(st.sampled_from(routes), st.sampled_from(with_body)))  # bodies: half
    if draw(st.integers(0, 19)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))

    def fill(match: re.Match) -> str:
        value = draw(st.one_of(st.sampled_from(vocabulary.models), texts.filter(bool)))
        return quote(value.encode("utf-8", "surrogatepass"), safe="/:")

    path = _PARAM.sub(fill, template)
    headers: dict[str, str] = {}
    extra = {
        "Accept": st.sampled_from(["application/json", "application/msgpack", "*/*", "text/html"]),
        "X-SIE-SDK-Version": st.one_of(st.sampled_from(["0.10.1", "0.6.0", "9"]), HEADER_TEXT),
        "X-SIE-MACHINE-PROFILE": st.one_of(st.sampled_from(["cpu", "l4"]), HEADER_TEXT),
        "X-SIE-Pool": HEADER_TEXT,
        "Idempotency-Key": HEADER_TEXT,
        **(header_values or {}),
    }
    for name, values in extra.items():
        if draw(st.booleans()):
            headers[name] = draw(values)
    body = None
    if method in ("POST", "PUT", "PATCH") or draw(st.integers(0, 9)) == 0:
        ctype, body = draw(bodies(documents(vocabulary.fields), yaml_too=yaml_too))
        if ctype and "Content-Type" not in headers:
            headers["Content-Type"] = ctype
    params = draw(st.dictionaries(st.sampled_from(["format", "pool", "x", "model"]), HEADER_TEXT, max_size=2))
    return Req(method, path, headers, body, params)


def send(client: httpx.Client, req: Req) -> httpx.Response:
    resp = client.request(req.method, req.path, headers=req.headers, content=req.body, params=req.params)
    OUTCOMES[f"{resp.status_code} {resp.headers.get('X-SIE-Error-Code', '')}".strip()] += 1
    return resp


def assert_no_5xx(resp: httpx.Response, req: Req) -> None:
    assert resp.status_code < 500, (
        f"{resp.status_code} {resp.headers.get('X-SIE-Error-Code')} {resp.text[:500]}\n{req!r}"
    )

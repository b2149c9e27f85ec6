"""A scriptable SIE-speaking HTTP server (real aiohttp on a loopback port) for SDK tests.

The server runs in its own thread and event loop, so the sync client can block on it and
the async client can run in the test's loop. Each route answers from a script of
``Reply`` objects (consumed in order, the last one repeating when ``repeat`` is set) and
falls back to a well-formed success answer built from the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from protocol.codec import packb, unpackb
from sdk import SIEAsyncClient, SIEClient


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    msgpack: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False  # close the connection without answering


def err(
    code: str, status: int = 503, retry_after: str | None = None, *, header_only: bool = False, **extra: Any
) -> Reply:
    """An error answer in the native envelope, with the code in X-SIE-Error-Code (and the body)."""
    headers = {"X-SIE-Error-Code": code}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    detail: dict[str, Any] = {"message": f"{code.lower()} from test server", **extra}
    if not header_only:
        detail["code"] = code
    return Reply(status=status, json={"detail": detail}, headers=headers)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    peer: Any


def encode_success(body: dict[str, Any], model: str) -> dict[str, Any]:
    params = body.get("params") or {}
    types = params.get("output_types") or ["dense"]
    items = []
    for index, item in enumerate(body.get("items") or []):
        text = item.get("text", "")
        out: dict[str, Any] = {}
        if "id" in item:
            out["id"] = item["id"]
        if "dense" in types:
            values = np.array([len(text), index, 1.0, 2.0], dtype=np.float32)
            out["dense"] = {"dims": 4, "dtype": "float32", "values": values}
        if "sparse" in types:
            out["sparse"] = {
                "dims": 100,
                "dtype": "float32",
                "indices": np.array([3, 7, 42], dtype=np.int32),
                "values": np.array([0.5, 0.25, 0.125], dtype=np.float32),
            }
        if "multivector" in types:
            out["multivector"] = {
                "token_dims": 2,
                "num_tokens": 3,
                "dtype": "float32",
                "values": np.arange(6, dtype=np.float32).reshape(3, 2),
            }
        items.append(out)
    return {"model": model, "items": items, "timing": {"total_ms": 1.5, "inference_ms": 1.0}}


def score_success(body: dict[str, Any], model: str) -> dict[str, Any]:
    items = body.get("items") or []
    scored = [(item.get("id", f"item-{i}"), float(len(item.get("text", "")))) for i, item in enumerate(items)]
    scored.sort(key=lambda p: -p[1])
    return {
        "model": model,
        "query_id": body["query"].get("id"),
        "scores": [{"item_id": i, "score": s, "rank": r} for r, (i, s) in enumerate(scored)],
    }


def extract_success(body: dict[str, Any], model: str) -> dict[str, Any]:
    labels = (body.get("params") or {}).get("labels") or ["thing"]
    items = []
    for index, item in enumerate(body.get("items") or []):
        text = item.get("text", "")
        word = text.split()[0] if text else ""
        items.append(
            {
                "id": item.get("id", f"item-{index}"),
                "entities": [
                    {
                        "text": word,
                        "label": labels[0],
                        "score": 0.9,
                        "start": 0,
                        "end": len(word),
                        "bbox": None,
                    }
                ],
                "relations": [],
                "classifications": [],
                "objects": [],
                "data": {},
            }
        )
    return {"model": model, "items": items}


class FakeServer:
    def __init__(self) -> None:
        self.scripts: dict[str, list[Reply]] = {}
        self.repeat: dict[str, bool] = {}
        self.seen: list[Seen] = []
        self.pools: dict[str, dict[str, Any]] = {}
        self.health: dict[str, Any] | None = None
        self.models = [
            {
                "name": "test/dense",
                "inputs": ["text"],
                "outputs": ["dense"],
                "dims": {"dense": 4},
                "loaded": True,
            }
        ]
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    # -- scripting -------------------------------------------------------------------

    def script(self, route: str, *replies: Reply, repeat: bool = False) -> None:
        """Answer ``route`` (``encode``, ``score``, ``extract``, ``pools``, ...) with ``replies``."""
        self.scripts[route] = list(replies)
        self.repeat[route] = repeat

    def calls(self, route: str | None = None, method: str | None = None) -> list[Seen]:
        return [
            s
            for s in list(self.seen)
            if (route is None or s.path.startswith(route)) and (method is None or s.method == method)
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- handling ----------------------------------------------------------------------

    def _next(self, route: str) -> Reply | None:
        script = self.scripts.get(route)
        if not script:
            return None
        if len(script) == 1 and self.repeat.get(route):
            return script[0]
        return script.pop(0)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        ctype = request.headers.get("Content-Type", "")
        body: Any = None
        if raw:
            try:
                body = unpackb(raw) if "msgpack" in ctype else json.loads(raw)
            except Exception:
                body = raw
        path = request.path
        self.seen.append(
            Seen(
                request.method,
                path,
                dict(request.headers),
                body,
                request.transport.get_extra_info("peername"),
            )
        )
        parts = path.strip("/").split("/")
        route = parts[1] if len(parts) > 1 and parts[0] == "v1" else parts[0]
        if route == "pools" and len(parts) >= 4 and parts[3] == "renew":
            route = "renew"
        reply = self._next(route)
        if reply is not None:
            return await self._send(request, reply)
        return self._default(request, route, parts, body)

    async def _send(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.drop:
            request.transport.close()  # type: ignore[union-attr]
            raise asyncio.CancelledError
        headers = dict(reply.headers)
        if reply.json is not None:
            data = json.dumps(reply.json).encode()
            headers.setdefault("Content-Type", "application/json")
        elif reply.msgpack is not None:
            data = packb(reply.msgpack)
            headers.setdefault("Content-Type", "application/msgpack")
        else:
            data = reply.raw or b""
        return web.Response(status=reply.status, body=data, headers=headers)

    def _default(self, request: web.Request, route: str, parts: list[str], body: Any) -> web.StreamResponse:
        model = "/".join(parts[2:])
        headers = {"X-SIE-Request-ID": f"req-{len(self.seen)}", "X-SIE-Server-Version": "0.10.1"}
        builders: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
            "encode": encode_success,
            "score": score_success,
            "extract": extract_success,
        }
        if route in builders and request.method == "POST":
            return web.Response(
                body=packb(builders[route](body, model)),
                headers={**headers, "Content-Type": "application/msgpack", "X-SIE-Units-Input-Tokens": "7"},
            )
        if route == "models":
            if not model:
                return web.json_response({"models": self.models})
            for m in self.models:
                if m["name"] == model:
                    return web.json_response(m)
            return web.json_response(
                {"detail": {"code": "MODEL_NOT_FOUND", "message": f"no model {model}"}}, status=404
            )
        if route == "health":
            if self.health is None:
                return web.json_response({"detail": "Not Found"}, status=404)
            return web.json_response(self.health)
        if route == "pools":
            return self._pool(request, parts, body)
        if route == "renew":
            name = parts[2].lower()
            if name not in self.pools:
                return web.json_response({"detail": {"message": "unknown pool"}}, status=404)
            return web.json_response({"message": "Pool renewed"})
        return web.json_response({"detail": {"code": "NOT_FOUND", "message": "no such route"}}, status=404)

    def _pool(self, request: web.Request, parts: list[str], body: Any) -> web.StreamResponse:
        if request.method == "POST" and len(parts) == 2:
            name = body["name"].lower()
            spec = {"name": name, **{k: v for k, v in body.items() if k != "name"}}
            self.pools[name] = {
                "name": name,
                "spec": spec,
                "status": {"state": "pending", "assigned_workers": []},
            }
            return web.json_response(self.pools[name], status=201)
        name = parts[2].lower()
        if request.method == "GET":
            if name not in self.pools:
                return web.json_response({"detail": {"message": "unknown pool"}}, status=404)
            return web.json_response(self.pools[name])
        if request.method == "DELETE":
            if self.pools.pop(name, None) is None:
                return web.json_response({"detail": {"message": "unknown pool"}}, status=404)
            return web.json_response({"message": "deleted"})
        return web.json_response({"detail": {"message": "bad pool call"}}, status=405)


@pytest.fixture
def server():
    srv = FakeServer().start()
    try:
        yield srv
    finally:
        srv.stop()


class AsyncFacade:
    """Drives an ``SIEAsyncClient`` from a sync test through its own event loop, so one test
    body checks both clients; attribute reads pass through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = SIEAsyncClient(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            result = attr(*a, **kw)
            if asyncio.iscoroutine(result):
                return self._loop.run_until_complete(result)
            return result

        return call

    def sleep(self, seconds: float) -> None:
        """Let the loop run (and the renewal task with it) for ``seconds``."""
        self._loop.run_until_complete(asyncio.sleep(seconds))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()


class SyncFacade(SIEClient):
    def sleep(self, seconds: float) -> None:
        import time

        time.sleep(seconds)


@pytest.fixture(params=["sync", "async"])
def make_client(request, server):
    """``make_client(**kwargs)`` builds a sync or an async client (the test runs for both)."""
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("base_url", server.url)
        client = SyncFacade(**kwargs) if request.param == "sync" else AsyncFacade(**kwargs)
        made.append(client)
        return client

    make.kind = request.param  # type: ignore[attr-defined]
    yield make
    for client in made:
        with contextlib.suppress(Exception):
            client.close()

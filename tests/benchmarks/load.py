"""The benchmarks' load generator: closed-loop HTTP/1.1 clients on keep-alive connections.

The load runs on the same two cores as the servers it measures, so its own CPU is taken from them.
aiohttp's client spent 0.13-0.17 ms of CPU per request here (on the zero-cost model at 32 clients,
about a sixth of all the CPU a request cost through the cluster); each client here is one asyncio
protocol on one connection that writes the request's bytes in one call and reads the answer by its
``Content-Length``, on uvloop where it is installed, the way a load tool such as wrk keeps out of
the measurement. Every answer's status is checked: anything but 200 ends the run with its body.
With ``openai=True`` the requests are OpenAI-style embedding requests (JSON ``{"model", "input"}``
to ``/embeddings``, as Infinity serves them), and each answer's number of embeddings is checked too.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import urllib.request
from urllib.parse import urlsplit

from iokit import eventloop
from protocol.codec import packb, unpackb

_END = b"\r\n\r\n"
_LENGTH = b"\r\ncontent-length:"


class _Connection(asyncio.Protocol):
    """One keep-alive connection; :meth:`call` sends a whole request and returns (status, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body_at = 0  # where the answer's body starts in buf, once its head is in
        self.end = 0  # where it ends

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if not self.end:
            head_end = self.buf.find(_END)
            if head_end < 0:
                return
            head = bytes(self.buf[:head_end]).lower()
            at = head.find(_LENGTH)
            if at < 0:
                waiter.set_exception(RuntimeError(f"an answer without Content-Length: {head[:200]!r}"))
                return
            value_end = head.find(b"\r\n", at + len(_LENGTH))
            length = int(head[at + len(_LENGTH) : value_end if value_end >= 0 else len(head)])
            self.body_at = head_end + 4
            self.end = self.body_at + length
        if len(self.buf) >= self.end:
            status = int(self.buf[9:12])
            body = bytes(self.buf[self.body_at : self.end])
            del self.buf[: self.end]
            self.end = 0
            waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the server closed the connection ({exc})"))

    async def call(self, request: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


def _route(model: str, openai: bool) -> tuple[str, str]:
    """(path, content type) of an encode request: ours in msgpack, or an OpenAI-style one in JSON."""
    return ("/embeddings", "application/json") if openai else (f"/v1/encode/{model}", "application/msgpack")


def _body(model: str, texts: list[str], openai: bool) -> bytes:
    if openai:
        return json.dumps({"model": model, "input": texts}).encode()
    return packb({"items": [{"text": t} for t in texts]})


def embed(url: str, model: str, texts: list[str], *, openai: bool = False) -> list[list[float]]:
    """The vectors of ``texts`` from one request to ``url`` (not timed: for a correctness check)."""
    path, ctype = _route(model, openai)
    request = urllib.request.Request(
        url + path, data=_body(model, texts, openai), headers={"Content-Type": ctype, "Accept": ctype}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        body = resp.read()
    if openai:
        return [d["embedding"] for d in json.loads(body)["data"]]
    return [list(item["dense"]["values"]) for item in unpackb(body)["items"]]


def _request_head(host: str, path: str, headers: dict[str, str]) -> bytes:
    """A request's head up to its Content-Length line, the same for every request of a run."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n").encode()


async def http_load(
    url: str,
    texts: list[str],
    per_request: int,
    clients: int,
    seconds: float,
    *,
    model: str,
    max_requests: int = 100_000,
    extra_headers: dict[str, str] | None = None,
    latencies: list[float] | None = None,
    warmup_s: float | None = None,
    openai: bool = False,
) -> tuple[float, float, float]:
    """(items/s, p50 ms, p99 ms) of ``clients`` closed-loop clients for ``seconds`` (or until
    ``max_requests`` requests), each sending ``per_request`` texts of ``texts`` per msgpack encode
    request to ``url``'s ``/v1/encode/{model}`` (with ``openai``, per JSON request to its
    ``/embeddings``); each request's latency (s) is also appended to ``latencies`` when given.

    Without ``warmup_s`` the rate counts the whole run: every item answered, over the time from the
    first connection to the last answer (the pipeline filling at the start and draining at the
    end included). With it, the clients run ``warmup_s`` first and the rate is that of the
    ``seconds`` that follow, the steady state: each request is credited with the share of its items
    that its time within the window makes (a request of 32 items that spent half its time there counts
    16), so a window of a few requests is not rounded to whole ones (at 32 x 4, 1.5 s held 10 to 12
    of them: one more or less moved the rate by 9%). The latencies are then those of the requests
    sent within the window, answered in it or after it: a request that stalls across the window's
    end still shows, and weighs on the rate for its time inside."""
    lat: list[float] = [] if latencies is None else latencies
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path, ctype = _route(model, openai)
    headers = {"Content-Type": ctype, "Accept": ctype, **(extra_headers or {})}
    head = _request_head(f"{host}:{port}", path, headers)
    loop = asyncio.get_running_loop()
    done: float = 0
    counter = 0
    start = time.perf_counter()
    opens = start + (warmup_s or 0.0)  # the measured window: [opens, stop]
    stop = opens + seconds

    async def client(cid: int) -> None:
        nonlocal done, counter
        transport, conn = await loop.create_connection(_Connection, host, port)
        try:
            i = cid * 997
            while time.perf_counter() < stop and counter < max_requests:
                counter += 1
                payload = _body(model, [texts[(i + k) % len(texts)] for k in range(per_request)], openai)
                i += per_request
                request = head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
                t = time.perf_counter()
                status, body = await conn.call(request)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
                answered = time.perf_counter()
                if openai and (got := body.count(b'"embedding":')) != per_request:  # compact JSON
                    raise RuntimeError(f"{got} embeddings for {per_request} texts: {body[:200]!r}")
                if warmup_s is None:
                    lat.append(answered - t)
                    done += per_request
                    continue
                if t >= opens:
                    lat.append(answered - t)
                inside = min(answered, stop) - max(t, opens)
                if inside > 0:
                    done += per_request * inside / (answered - t)
        finally:
            transport.close()

    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - start if warmup_s is None else seconds
    lat.sort()
    if not lat:  # nothing sent within the window was answered: a stall as long as the run
        return done / elapsed, float("inf"), float("inf")
    return done / elapsed, lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000


def run_load(
    url: str, texts: list[str], per_request: int, clients: int, seconds: float, **kwargs
) -> tuple[float, float, float]:
    """:func:`http_load` on a new event loop (uvloop where installed), from synchronous code, with the
    collector off: a full collection of the process that drives the load (22-30 ms in a script
    driving 1 x 16 slices; the benchmark's own process also holds sentence-transformers) delays
    every answer in flight, whichever front door is measured."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return eventloop.run(http_load(url, texts, per_request, clients, seconds, **kwargs))
    finally:
        if collecting:
            gc.enable()

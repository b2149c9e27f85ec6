"""A gateway told to stop (SIGTERM, Ctrl-C in ``sie up``) answers what is in flight, answers new
requests ``503 QUEUE_UNAVAILABLE`` with a ``Retry-After`` (which clients retry) instead of
refusing their connections, fails ``/readyz``, and then exits."""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.main import serve
from protocol.codec import packb, unpackb
from tests.integration.gateway.conftest import DENSE
from tests.integration.gateway.fake_worker import FakeWorker, answer
from tests.support.nats_server import free_port

MSGPACK = {
    "Content-Type": "application/msgpack",
    "Accept": "application/msgpack",
    "X-SIE-SDK-Version": "0.10.1",
}


async def test_stop_drains_in_flight_requests_and_answers_new_ones_503(nats_server, make_settings):
    release = asyncio.Event()

    async def held(item, worker):
        await release.wait()
        return answer(item, worker.worker_id)

    port = free_port()
    settings = make_settings(gateway_host="127.0.0.1", gateway_port=port, gateway_drain_timeout_s=30.0)
    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    worker = await FakeWorker(nats_server.url, "w1", handler=held).start()
    server = asyncio.create_task(serve(settings, stop))
    try:
        async with aiohttp.ClientSession() as session:

            async def get(path: str) -> int:
                try:
                    async with session.get(base + path) as resp:
                        return resp.status
                except aiohttp.ClientConnectionError:
                    return 0

            async def encode(text: str) -> tuple[int, dict, dict]:
                body = packb({"items": [{"text": text}]})
                async with session.post(f"{base}/v1/encode/{DENSE}", data=body, headers=MSGPACK) as resp:
                    raw = await resp.read()
                    parsed = unpackb(raw) if "msgpack" in resp.content_type else await resp.json()
                    return resp.status, dict(resp.headers), parsed

            for _ in range(200):  # ready, and the worker's heartbeat heard
                try:
                    async with session.get(base + "/readyz") as resp:
                        if resp.status == 200 and (await resp.json())["healthy_workers"] >= 1:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            first = asyncio.create_task(encode("in flight"))
            for _ in range(200):
                if worker.seen:
                    break
                await asyncio.sleep(0.05)
            assert worker.seen, "the first request never reached the worker"

            stop.set()
            for _ in range(200):
                if await get("/readyz") == 503:
                    break
                await asyncio.sleep(0.05)
            assert await get("/readyz") == 503
            status, headers, body = await encode("arrived while draining")
            assert status == 503 and headers["X-SIE-Error-Code"] == "QUEUE_UNAVAILABLE", body
            assert headers["Retry-After"] == "1" and "shutting down" in body["detail"]["message"]
            assert len(worker.seen) == 1  # nothing was published for it
            assert not server.done()  # still up: the first request is in flight

            release.set()
            status, _, body = await first
            assert status == 200 and len(body["items"]) == 1
            await asyncio.wait_for(server, 15)  # then it exits on its own
            assert await get("/healthz") == 0  # and its port is closed
    finally:
        release.set()
        stop.set()
        if not server.done():
            server.cancel()
        await worker.stop()

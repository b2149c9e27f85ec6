"""The benchmarks' load generator: whole-run accounting, and the steady-state window after a warm-up."""

from __future__ import annotations

import asyncio

from aiohttp import web

from protocol.codec import packb
from tests.benchmarks.load import http_load
from tests.support.nats_server import free_port


async def _server(delays: list[float]) -> tuple[web.AppRunner, str]:
    """An encode endpoint that answers the n-th request after ``delays[n]`` (the last one after that)."""
    seen = 0

    async def encode(request: web.Request) -> web.Response:
        nonlocal seen
        await request.read()
        delay = delays[min(seen, len(delays) - 1)]
        seen += 1
        await asyncio.sleep(delay)
        return web.Response(body=packb({"items": [{}]}), content_type="application/msgpack")

    app = web.Application()
    app.router.add_post("/v1/encode/{model}", encode)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_the_window_counts_the_steady_state_and_not_the_drain():
    """One client, 100 ms per request. Whole-run accounting counts the last answer, which comes after
    the run's time: 1 s of sending is 10 or 11 requests over 1.0-1.1 s. With 300 ms per request, the
    window of 0.5 s after 0.15 s of warm-up holds the second half of the first request, all of the
    second and a sixth of the third: 1.67 items, 3.3/s (counting whole answers would make it 2, 4/s)."""
    runner, url = await _server([0.1])
    try:
        rate, p50, _ = await http_load(url, ["a"], 1, 1, 1.0, model="m")
        assert 7.0 <= rate <= 10.5 and 95 <= p50 <= 200
    finally:
        await runner.cleanup()
    runner, url = await _server([0.3])
    try:
        rate, p50, _ = await http_load(url, ["a"], 1, 1, 0.5, model="m", warmup_s=0.15)
        assert 2.9 <= rate <= 3.45 and 295 <= p50 <= 400
    finally:
        await runner.cleanup()


async def test_a_request_that_stalls_across_the_windows_end_still_shows():
    """The fourth request (sent within the window) takes 1.5 s, past the window's end: its latency is
    among the window's, and the rate is what the window got done (about 3 items/s, not the 20/s of
    50 ms requests)."""
    runner, url = await _server([0.05, 0.05, 0.05, 1.5, 0.05])
    try:
        latencies: list[float] = []
        rate, _, p99 = await http_load(url, ["a"], 1, 1, 0.4, model="m", warmup_s=0.1, latencies=latencies)
        assert max(latencies) >= 1.5 and p99 >= 1500
        assert rate <= 5.0
    finally:
        await runner.cleanup()

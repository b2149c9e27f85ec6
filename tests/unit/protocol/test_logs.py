"""SIE_LOG_FORMAT=json: one JSON object per line, with the request and trace ids bound where known."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from protocol import logs

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def captured():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_one_object_per_line_with_bound_ids(captured):
    logger, stream = captured
    logger.info("before")
    with logs.bind(request_id="req-1", trace_id="ab" * 16):
        logger.warning("inside %s", "a\nmultiline")
    logger.info("after")
    before, inside, after = lines(stream)
    assert inside["msg"] == "inside a\nmultiline" and inside["level"] == "WARNING"
    assert inside["logger"] == "test.logs" and inside["ts"].endswith("+00:00")
    assert (inside["request_id"], inside["trace_id"]) == ("req-1", "ab" * 16)
    assert "request_id" not in before and "request_id" not in after


def test_bound_ids_follow_their_task(captured):
    logger, stream = captured

    async def handle(rid: str, gate: asyncio.Event, other: asyncio.Event) -> None:
        with logs.bind(request_id=rid):
            gate.set()
            await other.wait()
            logger.info("done")

    async def main() -> None:
        a, b = asyncio.Event(), asyncio.Event()
        await asyncio.gather(handle("r-a", a, b), handle("r-b", b, a))

    asyncio.run(main())
    assert sorted(rec["request_id"] for rec in lines(stream)) == ["r-a", "r-b"]


def test_trace_id_from_the_active_span_and_exceptions(captured, monkeypatch):
    logger, stream = captured
    monkeypatch.setattr(logs, "trace_id_source", lambda: "cd" * 16)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    (rec,) = lines(stream)
    assert rec["trace_id"] == "cd" * 16
    assert "RuntimeError: boom" in rec["exc"]


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log format"):
        logs.setup_logging("INFO", "xml")


@pytest.mark.parametrize(
    "module",
    [
        "gateway.settings:GatewaySettings",
        "sidecar.settings:SidecarSettings",
        "worker.settings:WorkerSettings",
        "config_service.settings:ConfigServiceSettings",
    ],
)
def test_every_process_reads_sie_log_format(module, monkeypatch):
    path, name = module.split(":")
    cls = getattr(__import__(path, fromlist=[name]), name)
    monkeypatch.setenv("SIE_LOG_FORMAT", "json")
    assert cls().log_format == "json"
    monkeypatch.setenv("SIE_LOG_FORMAT", "yaml")
    with pytest.raises(ValueError):
        cls()


def test_a_process_logs_json_lines():
    """The sidecar's entry point with SIE_LOG_FORMAT=json: every line it writes is a JSON object
    (it retries a NATS server that is not there, logging a warning each time)."""
    env = {
        "SIE_LOG_FORMAT": "json",
        "SIE_NATS_URL": "nats://127.0.0.1:1",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        written = [proc.stderr.readline() for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(10)
    records = [json.loads(line) for line in written]
    assert all(rec["logger"] == "sie.sidecar" and rec["level"] == "WARNING" for rec in records)
    # the refused connection, in asyncio's words or uvloop's
    assert any("Connect call failed" in rec["msg"] or "Connection refused" in rec["msg"] for rec in records)

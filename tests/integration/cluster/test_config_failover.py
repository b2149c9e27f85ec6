"""The config service's writer killed while admins write (issue 35): ``sie up --config-replicas 2
--config-db postgresql://…`` on the PostgreSQL at 127.0.0.1:5432, kill -9 of the replica holding
the writer lock while two admins POST new models (each to either replica: a standby forwards) and
a client encodes through the gateway.

Checked: the standby takes the lock; every write that was acknowledged is in the store afterwards;
no replica's epoch, nor the gateway's, ever goes back; the gateway serves every request; and it
reaches the final epoch (the deltas and its poller carry the writes across the failover)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from sdk.client import SIEClient
from tests.support import postgres
from tests.support.model_yaml import fake_model
from tests.support.polling import wait_until
from tests.support.sie_up import SieUp


@pytest.fixture
def pg_url():
    with postgres.databases("sie_failover", skip_without_login=True) as (url,):
        yield url


class Observed:
    """What the threads saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: dict[str, int] = {}  # model id → epoch its answer named
        self.write_latency: list[float] = []
        self.unacked: list[str] = []
        self.epochs: dict[str, list[int]] = {}  # observer → epochs in the order seen
        self.encodes = 0
        self.encode_errors: list[str] = []


def admin(up: SieUp, token: str, k: int, stop: threading.Event, seen: Observed) -> None:
    """Write new models one after another, each to one of the replicas in turn, retrying (as an admin
    client does) what is refused or not answered until it is acknowledged."""
    urls = [f"http://127.0.0.1:{up.ports['cfg'] + i}" for i in range(2)]
    i = 0
    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {token}"}) as c:
        while not stop.is_set():
            model_id = f"acme/failover-{k}-{i}"
            body = fake_model(model_id)
            start = time.monotonic()
            acked = False
            while time.monotonic() - start < 60 and not acked:
                url = urls[(i + k) % 2]
                try:
                    r = c.post(
                        url + "/v1/configs/models", content=body, headers={"Idempotency-Key": model_id}
                    )
                    if r.status_code in (200, 201):
                        with seen.lock:
                            seen.acked[model_id] = int(r.json()["epoch"])
                            seen.write_latency.append(time.monotonic() - start)
                        acked = True
                        break
                except httpx.HTTPError:
                    pass
                i += 1  # the other replica next (the killed one is restarting)
                time.sleep(0.2)
            if not acked:
                with seen.lock:
                    seen.unacked.append(model_id)
            i += 1


def watch_epochs(up: SieUp, token: str, stop: threading.Event, seen: Observed) -> None:
    observers = {
        "config": f"http://127.0.0.1:{up.ports['cfg']}",
        "config-2": f"http://127.0.0.1:{up.ports['cfg'] + 1}",
        "gateway": up.gateway,
    }
    with httpx.Client(timeout=2, headers={"Authorization": f"Bearer {token}"}) as c:
        while not stop.is_set():
            for name, url in observers.items():
                try:
                    epoch = int(c.get(url + "/v1/configs/epoch").json()["epoch"])
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                with seen.lock:
                    seen.epochs.setdefault(name, []).append(epoch)
            stop.wait(0.1)


def encode(up: SieUp, stop: threading.Event, seen: Observed) -> None:
    with SIEClient(up.gateway, timeout_s=60) as c:
        while not stop.is_set():
            try:
                r = c.encode(
                    "sie-fake", {"text": "served across the writer failover"}, provision_timeout_s=60
                )
                ok = len(r["dense"]) == 384
                with seen.lock:
                    seen.encodes += 1
                    if not ok:
                        seen.encode_errors.append("wrong dimension")
            except Exception as exc:
                with seen.lock:
                    seen.encode_errors.append(f"{type(exc).__name__}: {exc}"[:200])
            stop.wait(0.05)


def writer_of(up: SieUp) -> str | None:
    for i, name in enumerate(("config", "config-2")):
        try:
            if httpx.get(f"http://127.0.0.1:{up.ports['cfg'] + i}/readyz", timeout=2).json().get("writer"):
                return name
        except (httpx.HTTPError, ValueError):
            continue
    return None


@pytest.mark.timeout(600)
def test_writer_killed_while_admins_write_loses_no_acknowledged_write(tmp_path, pg_url):
    up = SieUp(
        tmp_path / "state",
        config_replicas=2,
        config_db=pg_url,
        extra_env={"SIE_CONFIG_POLL_INTERVAL_S": "2", "SIE_CONFIG_LOCK_POLL_S": "0.2"},
    )
    try:
        up.start()
        token = (up.state / "admin-token").read_text().strip()
        assert writer_of(up) == "config"
        seen, stop = Observed(), threading.Event()
        threads = [threading.Thread(target=admin, args=(up, token, k, stop, seen)) for k in range(2)]
        threads += [
            threading.Thread(target=watch_epochs, args=(up, token, stop, seen)),
            threading.Thread(target=encode, args=(up, stop, seen)),
        ]
        for t in threads:
            t.start()
        try:
            asyncio.run(wait_until(lambda: len(seen.acked) >= 6, 60, what="writes before the kill"))
            victim = up.children()["config"]["pid"]
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            asyncio.run(
                wait_until(lambda: writer_of(up) == "config-2", 60, what="the standby takes the lock")
            )
            takeover_s = time.monotonic() - killed_at
            before = len(seen.acked)
            asyncio.run(
                wait_until(lambda: len(seen.acked) >= before + 6, 60, what="writes after the takeover")
            )
            # the killed replica is back (sie up restarted it) as a standby: writes sent to it forward
            asyncio.run(wait_until(lambda: up.children()["config"]["restarts"] >= 1, 60, what="restart"))
        finally:
            stop.set()
            for t in threads:
                t.join(90)

        with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {token}"}) as c:
            standby = f"http://127.0.0.1:{up.ports['cfg'] + 1}"  # the writer now
            stored = {m["model_id"] for m in c.get(standby + "/v1/configs/export").json()["models"]}
            final_epoch = int(c.get(standby + "/v1/configs/epoch").json()["epoch"])
        lost = sorted(set(seen.acked) - stored)
        report = {
            "acknowledged": len(seen.acked),
            "unacknowledged": len(seen.unacked),
            "lost": lost,
            "takeover_s": round(takeover_s, 2),
            "longest_write_s": round(max(seen.write_latency), 2),
            "final_epoch": final_epoch,
            "encodes": seen.encodes,
            "encode_errors": seen.encode_errors[:5],
        }
        print("WRITER FAILOVER REPORT", report)
        assert not lost and not seen.unacked, report
        assert final_epoch >= max(seen.acked.values()), report
        for name, epochs in seen.epochs.items():
            assert epochs == sorted(epochs), (name, epochs)  # never goes back
        assert seen.encodes > 0 and not seen.encode_errors, report
        asyncio.run(
            wait_until(
                lambda: (
                    int(httpx.get(up.gateway + "/v1/configs/epoch", timeout=2).json()["epoch"]) >= final_epoch
                ),
                60,
                what="the gateway reaches the final epoch",
            )
        )
    finally:
        up.stop()

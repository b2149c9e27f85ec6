"""The soak (issue 35): a ``sie up`` cluster as production runs it (three NATS members, two gateways,
two worker pods, the result cache on) under mixed traffic for many minutes, with a random kill -9
of one of its processes every few minutes and now and then a NATS member restarted.

Traffic goes through our SDK from a few threads at a steady rate: encode, score and extract, both
priority classes, with the result cache used and skipped (``X-SIE-Cache: off``). Every answer is
checked against a reference taken before the first fault. Once a minute a line says how many
requests completed and failed in that minute, their p99, each process's RSS, open file descriptors
and established TCP connections (``name=RSS/descriptors+connections``, read every few seconds: the
lowest RSS of the minute, the medians of the counts), the connections of all processes together,
and the JetStream consumers on each NATS member; the end prints a verdict.

Which processes die: ``VICTIMS`` (the second gateway, the second worker pod's worker and sidecar,
the config service, two of the three NATS members), a NATS member only while all three are healthy
(one member down at a time is what a three-member cluster tolerates). The first of each kind (``gateway``,
``worker``, ``sidecar``, ``nats``) is never killed, so that a leak shows as growth of one process
over the whole run; the sie up supervisor and this driver live through the run as well. A killed
process's restarted successor is compared only over the minutes it lived through.

    .venv/bin/python -m pytest -m slow -s tests/integration/cluster/test_soak.py   # make soak
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.request
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from sdk.client import SIEClient

MODEL = "sie-fake"
TEXTS = [f"soak text {i}: the quick brown fox {i * 7} jumps" for i in range(24)]
SCORES = [(f"soak query {i}", [f"soak doc {i}-{j}" for j in range(3)]) for i in range(8)]
EXTRACTS = [f"Alice {i} met Bob in Paris on day {i}" for i in range(8)]
LABELS = ["person", "location"]

VICTIMS = ("gateway-2", "worker-2", "sidecar-2", "config", "nats-2", "nats-3")
NATS_RESTARTS = ("nats-2", "nats-3")
WITNESSES = ("gateway", "worker", "sidecar", "nats")
GROWTH_LIMIT = 0.10  # RSS and descriptor count may grow at most this much from the baseline minute
GROWTH_WINDOW = 5  # minutes that stand for each end of the comparison
ALL_TCP = "tcp (all)"  # the growth line of the TCP connections over every process


@dataclass
class Plan:
    minutes: float
    kill_every_s: tuple[float, float] = (120.0, 300.0)  # a kill -9 after a random wait in this range
    nats_restart_every_s: tuple[float, float] = (600.0, 900.0)  # a NATS member restarted (SIGTERM)
    baseline_minute: int = 10  # growth is measured from this minute to the last
    rate_per_s: float = 30.0  # requests per second, all threads together
    threads: int = 3
    seed: int = 35
    sample_every_s: float = 60.0  # one line per this many seconds
    # each process's RSS, descriptors and connections are read this often (see Minute)
    probe_every_s: float = 5.0


OK, WRONG, ERROR = 0, 1, 2


class Outcomes:
    """Every request's end, latency and status in flat arrays (an hour at 20 requests/s is 72,000 of
    them: as objects they grew the driver's own RSS steadily, which the verdict would have counted)."""

    def __init__(self) -> None:
        self.end = array("d")
        self.latency = array("d")
        self.status = array("b")
        self.errors: set[str] = set()  # distinct error messages, at most MAX_ERRORS
        self.slowest: list[tuple[float, float, str]] = []  # (latency, end, what): a heap of SLOWEST

    def add(self, end: float, latency: float, status: str, what: str = "") -> None:
        self.end.append(end)
        self.latency.append(latency)
        heapq.heappush(self.slowest, (latency, end, what))
        if len(self.slowest) > SLOWEST:
            heapq.heappop(self.slowest)
        code = OK if status == "ok" else WRONG if status == "wrong" else ERROR
        self.status.append(code)
        if code == ERROR and len(self.errors) < MAX_ERRORS:
            self.errors.add(status)

    def window(self, since: float, until: float) -> tuple[list[float], int, int]:
        """(latencies, failed, wrong) of the requests that ended in [since, until)."""
        lo = bisect.bisect_left(self.end, since)  # ends are appended in (almost) time order
        lat, failed, wrong = [], 0, 0
        for i in range(max(0, lo - 100), len(self.end)):  # threads append out of order by a little
            if since <= self.end[i] < until:
                lat.append(self.latency[i])
                failed += self.status[i] == ERROR
                wrong += self.status[i] == WRONG
        return lat, failed, wrong


MAX_ERRORS = 10
SLOWEST = 5  # the verdict names this many slowest requests: when, and what they were


class Minute(NamedTuple):
    """One process over one interval's reads.

    The RSS is the lowest read. A leak is memory that is never given back, so it lifts every read
    after it and the lowest with them; what a garbage collector takes and gives back moves the
    other reads and leaves the lowest where it was. nats-server's RSS follows its collector's cycle,
    31-41 MB from one minute to the next over an hour with its live heap flat (docs/ha.md), and
    that cycle is slower than a minute: one read a minute, and then the median of a minute's
    twelve, judged the phase of the cycle at each end of the hour (+1.5 % in one hour, +18.4 % in
    the next, the same member). The median is kept beside it for the record."""

    pid: int
    rss: int  # kB, the lowest read
    fds: int  # own descriptors (not established TCP connections), the median of the reads
    tcp: int  # established TCP connections, the median of the reads
    rss_median: int = 0  # kB


@dataclass
class Sample:
    minute: int
    procs: dict[str, Minute]
    consumers: list[int | None] = field(default_factory=list)  # JetStream consumers on each NATS member

    @property
    def connections(self) -> int:
        """Established TCP connections over every sampled process (a connection between two of
        them counts at both ends)."""
        return sum(p[3] for p in self.procs.values())


@dataclass
class Report:
    requests: int = 0
    failed: int = 0
    wrong: int = 0
    longest_s: float = 0.0
    p99_s: float = 0.0
    events: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    growth: dict[str, str] = field(default_factory=dict)  # name → "rss +x% fds +y%" or why not compared
    grew: list[str] = field(default_factory=list)  # names over GROWTH_LIMIT

    @property
    def passed(self) -> bool:
        return self.requests > 0 and self.failed == 0 and self.wrong == 0 and not self.grew


def established_sockets() -> set[int]:
    """Inodes of this host's TCP sockets (IPv4 and IPv6) in state ESTABLISHED."""
    out: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "01":
                    out.add(int(fields[9]))
    return out


def proc_stats(pid: int, established: set[int]) -> tuple[int, int, int] | None:
    """(RSS kB, open descriptors other than established TCP connections, established TCP
    connections) of ``pid``; None when it is gone. ``established`` is :func:`established_sockets`."""
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        own = tcp = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed since the listing
            if target.startswith("socket:[") and int(target[8:-1]) in established:
                tcp += 1
            else:
                own += 1
        return rss, own, tcp
    except (OSError, ValueError):
        return None


class Soak:
    """Drives ``up`` (a started tests' ``SieUp`` with 3 NATS members, 2 gateways, 2 worker pods)."""

    def __init__(self, up: Any, plan: Plan, say: Callable[[str], None] = print) -> None:
        self.up, self.plan, self.say = up, plan, say
        self.rng = random.Random(plan.seed)
        self.outcomes = Outcomes()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.report = Report()
        self.samples: list[Sample] = []
        self.refs: dict[tuple[str, str], Any] = {}
        self.started = time.monotonic()  # the traffic's start (run sets it)

    # ---- references and checks -------------------------------------------------------------
    def take_references(self) -> None:
        with SIEClient(self.up.gateway, base_url_headers={"X-SIE-Cache": "off"}) as c:
            for text in TEXTS:
                r = c.encode(MODEL, {"text": text}, provision_timeout_s=120)
                self.refs[("encode", text)] = np.asarray(r["dense"])
            for query, docs in SCORES:
                r = c.score(MODEL, {"text": query}, [{"text": d} for d in docs], provision_timeout_s=120)
                self.refs[("score", query)] = self._scores(r)
            for text in EXTRACTS:
                r = c.extract(MODEL, [{"text": text}], labels=LABELS, provision_timeout_s=120)
                self.refs[("extract", text)] = r[0]["entities"]

    @staticmethod
    def _scores(r: dict[str, Any]) -> list[tuple[str, float]]:
        return sorted((s["item_id"], round(float(s["score"]), 5)) for s in r["scores"])

    def one_request(self, client: SIEClient, rng: random.Random, what: list[str]) -> bool:
        """One request of a random operation and priority (appended to ``what``); True when its
        answer is the reference's."""
        priority = rng.choice(("interactive", "bulk"))
        op = rng.choices(("encode", "score", "extract"), weights=(2, 1, 1))[0]
        what.append(f"{op} {priority}")
        if op == "encode":
            text = rng.choice(TEXTS)
            r = client.encode(MODEL, {"text": text}, priority=priority, provision_timeout_s=120)
            return bool(np.allclose(np.asarray(r["dense"]), self.refs[("encode", text)], atol=1e-5))
        if op == "score":
            query, docs = rng.choice(SCORES)
            r = client.score(
                MODEL,
                {"text": query},
                [{"text": d} for d in docs],
                priority=priority,
                provision_timeout_s=120,
            )
            return self._scores(r) == self.refs[("score", query)]
        text = rng.choice(EXTRACTS)
        out = client.extract(
            MODEL, [{"text": text}], labels=LABELS, priority=priority, provision_timeout_s=120
        )
        return bool(out[0]["entities"] == self.refs[("extract", text)])

    # ---- threads ---------------------------------------------------------------------------
    def traffic(self, k: int) -> None:
        rng = random.Random(self.plan.seed * 1000 + k)
        interval = self.plan.threads / self.plan.rate_per_s
        with (
            SIEClient(self.up.gateway, timeout_s=180) as cached,
            SIEClient(self.up.gateway, timeout_s=180, base_url_headers={"X-SIE-Cache": "off"}) as uncached,
        ):
            while not self.stop.is_set():
                start = time.monotonic()
                use_cache = rng.random() < 0.5
                what = [f"thread {k}, cache {'on' if use_cache else 'off'}"]
                client = cached if use_cache else uncached
                try:
                    status = "ok" if self.one_request(client, rng, what) else "wrong"
                except Exception as exc:
                    status = f"error: {type(exc).__name__}: {exc}"[:300]
                end = time.monotonic()
                what.append(f"{client.last_retry_count} retries by the SDK")
                with self.lock:
                    self.outcomes.add(end, end - start, status, ", ".join(reversed(what)))
                self.stop.wait(max(0.0, interval - (end - start)))

    def chaos(self) -> None:
        t0 = time.monotonic()
        next_kill = t0 + self.rng.uniform(*self.plan.kill_every_s)
        next_restart = t0 + self.rng.uniform(*self.plan.nats_restart_every_s)
        while not self.stop.wait(0.5):
            now = time.monotonic()
            if now >= next_kill:
                victim = self.rng.choice(VICTIMS)
                if victim.startswith("nats") and not self.nats_healthy():
                    next_kill = now + 5  # one member down at a time: a three-member cluster's tolerance
                    continue
                self._signal(victim, signal.SIGKILL, "kill -9", t0)
                next_kill = now + self.rng.uniform(*self.plan.kill_every_s)
            if now >= next_restart:
                if not self.nats_healthy():
                    next_restart = now + 5
                    continue
                self._signal(self.rng.choice(NATS_RESTARTS), signal.SIGTERM, "restart (SIGTERM)", t0)
                next_restart = now + self.rng.uniform(*self.plan.nats_restart_every_s)

    def nats_consumers(self) -> list[int | None]:
        """The JetStream consumers each NATS member holds (its ``/jsz``; None while it is down): a
        client that leaves consumers behind shows here first (the gateway's key listings did, 45 a
        minute, until 2026-11-27)."""
        out: list[int | None] = []
        for port in self.up.nats_monitor_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=2) as resp:
                    out.append(int(json.load(resp).get("consumers", 0)))
            except (OSError, ValueError):
                out.append(None)
        return out

    def nats_healthy(self) -> bool:
        """Every NATS member up and current with the JetStream meta leader (its ``/healthz``)."""
        for port in self.up.nats_monitor_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    if resp.status != 200:
                        return False
            except OSError:
                return False
        return True

    def _signal(self, name: str, sig: signal.Signals, what: str, t0: float) -> None:
        child = self.up.children().get(name) or {}
        pid = child.get("pid")
        if not pid or child.get("state") != "running":
            self.report.events.append(
                f"{(time.monotonic() - t0) / 60:5.1f} min {what} {name}: not running, skipped"
            )
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        event = f"{(time.monotonic() - t0) / 60:5.1f} min {what} {name} (pid {pid})"
        self.report.events.append(event)
        self.say(f"[soak] event: {event}")

    # ---- sampling --------------------------------------------------------------------------
    def probe(self) -> dict[str, tuple[int, int, int, int]]:
        """Every process's (pid, RSS kB, own descriptors, TCP connections) now."""
        procs: dict[str, tuple[int, int, int, int]] = {}
        established = established_sockets()
        pids = {name: row["pid"] for name, row in self.up.children().items() if row.get("pid")}
        pids["sie-up"] = self.up.proc.pid
        pids["driver"] = os.getpid()
        for name, pid in sorted(pids.items()):
            stats = proc_stats(pid, established)
            if stats is not None:
                procs[name] = (pid, *stats)
        return procs

    def sample(self, minute: int, probes: list[dict[str, tuple[int, int, int, int]]]) -> Sample:
        """The interval's line: each process over ``probes`` (see :func:`summarise`)."""
        return Sample(minute, summarise(probes), self.nats_consumers())

    def minute_line(self, minute: int, since: float, until: float, sample: Sample) -> str:
        with self.lock:
            lat, failed, wrong = self.outcomes.window(since, until)
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else 0.0
        procs = " ".join(f"{n}={p.rss // 1024}M/{p.fds}+{p.tcp}" for n, p in sample.procs.items())
        return (
            f"[soak] min {minute:3d}  req {len(lat):5d}  fail {failed}  wrong {wrong}  "
            f"p99 {p99:6.0f} ms  | rss/fds+tcp {procs}  tcp {sample.connections}  "
            f"consumers {'/'.join('-' if c is None else str(c) for c in sample.consumers)}"
        )

    # ---- the run ---------------------------------------------------------------------------
    def run(self) -> Report:
        self.take_references()
        self.say(
            f"[soak] {self.plan.minutes:g} min, {self.plan.rate_per_s:g} req/s from {self.plan.threads} threads, "
            f"kill -9 every {self.plan.kill_every_s[0]:g}-{self.plan.kill_every_s[1]:g} s of one of {', '.join(VICTIMS)}; "
            f"a NATS member restarted every {self.plan.nats_restart_every_s[0]:g}-{self.plan.nats_restart_every_s[1]:g} s"
        )
        workers = [
            threading.Thread(target=self.traffic, args=(k,), daemon=True) for k in range(self.plan.threads)
        ]
        chaos = threading.Thread(target=self.chaos, daemon=True)
        t0 = self.started = time.monotonic()
        for t in workers:
            t.start()
        chaos.start()
        end = t0 + self.plan.minutes * 60
        minute = 0
        try:
            while time.monotonic() < end:
                minute += 1
                tick = min(end, t0 + minute * self.plan.sample_every_s)
                probes = []
                while (now := time.monotonic()) < tick:
                    time.sleep(min(self.plan.probe_every_s, tick - now))
                    probes.append(self.probe())
                sample = self.sample(minute, probes or [self.probe()])
                self.samples.append(sample)
                self.say(self.minute_line(minute, tick - self.plan.sample_every_s, tick, sample))
        finally:
            self.stop.set()
            chaos.join(5)
            for t in workers:
                t.join(200)  # a request in flight finishes (its own timeout bounds it)
        return self.verdict()

    def verdict(self) -> Report:
        r = self.report
        with self.lock:
            o = self.outcomes
            r.requests = len(o.status)
            r.failed = o.status.count(ERROR)
            r.wrong = o.status.count(WRONG)
            lat = sorted(o.latency)
            r.errors = sorted(o.errors)
            slowest = sorted(o.slowest, reverse=True)
        r.longest_s = round(lat[-1], 2) if lat else 0.0
        r.p99_s = round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else 0.0
        self._growth()
        self.say(f"[soak] events: {len(r.events)}")
        for event in r.events:
            self.say(f"[soak]   {event}")
        for name, text in sorted(r.growth.items()):
            self.say(f"[soak] growth {name:<10} {text}")
        self.say(
            f"[soak] VERDICT {'PASS' if r.passed else 'FAIL'}: {r.requests} requests, {r.failed} lost, "
            f"{r.wrong} wrong, p99 {r.p99_s * 1000:.0f} ms, longest {r.longest_s} s, "
            f"{len(r.events)} faults; over {GROWTH_LIMIT:.0%} growth: {', '.join(r.grew) or 'none'}"
        )
        for latency, end, what in slowest:
            self.say(f"[soak] slow: {latency:.2f} s, ended at minute {(end - self.started) / 60:.1f}: {what}")
        for error in r.errors:
            self.say(f"[soak] error: {error}")
        return r

    def _growth(self) -> None:
        """Per process: RSS and descriptors over the last minutes against the minutes from the
        baseline minute on, for the process that lived through both (a killed process's successor:
        from its second minute on, when that is at or after the baseline, and only when it lived at
        least half of the measured span). Each side spans up to GROWTH_WINDOW minutes: its RSS is
        the lowest read in them (see :class:`Minute`), its descriptors the median of the minutes'.

        A process's descriptors are judged without its established TCP connections, and those are
        judged over all processes together: a kill moves connections from the victim to a survivor
        for good (the driver's keep-alive connections to the other gateway; a NATS member's clients
        to the other members, which nothing moves back), which is a step in the survivor's count
        but no leak; a connection leaked anywhere grows the total, a socket left open after its
        peer closed is no longer established and counts among its process's own descriptors."""
        if not self.samples:
            return
        last = self.samples[-1]
        for name, now in last.procs.items():
            alive = [s for s in self.samples if name in s.procs and s.procs[name].pid == now.pid]
            first = alive[0].minute
            base_minute = max(self.plan.baseline_minute, first + 1)
            span = last.minute - base_minute
            if span < max(1, (last.minute - self.plan.baseline_minute) // 2):
                # a successor that lived a few minutes shows its warm-up, not a leak (the first hour
                # run flagged nats-3, restarted at minute 51.6, for 31→36 MB over minutes 53-60)
                self.report.growth[name] = (
                    f"not compared (this process started at minute {first}: too short to tell a leak "
                    "from warming up)"
                )
                continue
            window = max(1, min(GROWTH_WINDOW, span // 4))
            head = [s.procs[name] for s in alive if base_minute <= s.minute < base_minute + window]
            tail = [s.procs[name] for s in alive if s.minute > last.minute - window]
            rss0, rss1 = min(p.rss for p in head), min(p.rss for p in tail)
            mid0, mid1 = median(p.rss_median for p in head), median(p.rss_median for p in tail)
            fds0, fds1 = median(p.fds for p in head), median(p.fds for p in tail)
            tcp0, tcp1 = median(p.tcp for p in head), median(p.tcp for p in tail)
            g_rss, g_fds = (rss1 - rss0) / max(rss0, 1), (fds1 - fds0) / max(fds0, 1)
            self.report.growth[name] = (
                f"min {base_minute}-{base_minute + window - 1} → {last.minute - window + 1}-{last.minute}: "
                f"rss lowest {rss0 / 1024:.1f}→{rss1 / 1024:.1f} MB ({g_rss:+.1%}; median "
                f"{mid0 / 1024:.1f}→{mid1 / 1024:.1f}, not judged), fds {fds0:g}→{fds1:g} ({g_fds:+.1%}), "
                f"tcp {tcp0:g}→{tcp1:g} (not judged alone)"
            )
            if g_rss > GROWTH_LIMIT or g_fds > GROWTH_LIMIT:
                self.report.grew.append(name)
        base = self.plan.baseline_minute
        span = last.minute - base
        if span >= 1:
            window = max(1, min(GROWTH_WINDOW, span // 4))
            tcp0 = median(s.connections for s in self.samples if base <= s.minute < base + window)
            tcp1 = median(s.connections for s in self.samples if s.minute > last.minute - window)
            g_tcp = (tcp1 - tcp0) / max(tcp0, 1)
            self.report.growth[ALL_TCP] = (
                f"min {base}-{base + window - 1} → {last.minute - window + 1}-{last.minute} (medians): "
                f"established TCP connections of every process {tcp0:g}→{tcp1:g} ({g_tcp:+.1%})"
            )
            if g_tcp > GROWTH_LIMIT:
                self.report.grew.append(ALL_TCP)


def summarise(probes: list[dict[str, tuple[int, int, int, int]]]) -> dict[str, Minute]:
    """Per process of the last probe, its reads over ``probes`` (a process restarted in between:
    its successor's reads only) as a :class:`Minute`; each probe maps a name to (pid, RSS kB, own
    descriptors, TCP connections)."""
    out: dict[str, Minute] = {}
    for name, (pid, *_) in probes[-1].items():
        reads = [p[name] for p in probes if p.get(name, (0,))[0] == pid]
        fds, tcp, rss_median = (round(median(r[i] for r in reads)) for i in (2, 3, 1))
        out[name] = Minute(pid, min(r[1] for r in reads), fds, tcp, rss_median)
    return out


def median(values: Any) -> float:
    return float(statistics.median(list(values)))

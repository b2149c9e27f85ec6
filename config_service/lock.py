"""The single-writer lock held in the database.

PostgreSQL: a session-level ``pg_advisory_lock`` on a dedicated connection, held for the process
lifetime; the writer's transactions run on that same connection, so a writer that lost the lock
(connection gone) cannot write. SQLite: an exclusive ``flock`` on ``<db>.writer.lock`` beside the
database file; the kernel drops it when the process dies, however it dies.

A standby polls for the lock in a background task (``maintain``) and starts taking writes the
moment it gets it; until then ``write`` raises NotWriter and reads keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from config_service.store import PG_WRITER_LOCK_KEY, is_sqlite, sqlite_path

log = logging.getLogger(__name__)
T = TypeVar("T")


class NotWriter(RuntimeError):
    """This replica does not hold the writer lock (it is a standby, or it lost the lock)."""


class LockBackend(Protocol):
    """How one database holds the lock and runs the writer's transactions. The :class:`WriterLock`
    calls these one at a time (under its mutex), from a worker thread."""

    def try_acquire(self) -> bool:
        """Take the lock if it is free; True when this replica holds it now."""
        ...

    def check(self) -> bool:
        """Whether this replica still holds the lock."""
        ...

    def release(self) -> None: ...

    def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one write transaction; raises NotWriter when the lock is gone with it."""
        ...

    def close(self) -> None: ...


class WriterLock:
    """The background acquire/monitor loop and the held flag, over a :class:`LockBackend`."""

    def __init__(self, backend: LockBackend, poll_s: float = 1.0, check_every_s: float = 5.0) -> None:
        self.backend = backend
        self.poll_s = poll_s
        self.check_every_s = check_every_s
        self._held = False
        self._mutex = threading.Lock()  # one backend call at a time (a write, a check) on its connection
        self.acquired = asyncio.Event()
        self.on_change: Callable[[bool], None] | None = None

    @property
    def held(self) -> bool:
        return self._held

    def _set_held(self, held: bool) -> None:
        if held != self._held:
            self._held = held
            log.warning("writer lock %s", "acquired: this replica takes writes" if held else "lost")
            if held:
                self.acquired.set()
            else:
                self.acquired.clear()
            if self.on_change:
                self.on_change(held)

    async def _call(self, step: Callable[[], T]) -> T:
        def locked() -> T:
            with self._mutex:
                return step()

        return await asyncio.to_thread(locked)

    async def maintain(self) -> None:
        """Acquire the lock (waiting as a standby), then watch it; reacquire if it is lost."""
        last_check = 0.0
        waiting_logged = False
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not self._held:
                    if await self._call(self.backend.try_acquire):
                        self._set_held(True)
                        last_check = loop.time()
                    elif not waiting_logged:
                        waiting_logged = True
                        log.warning(
                            "writer lock is held by another replica: standby (reads only) until it is free"
                        )
                elif loop.time() - last_check >= self.check_every_s:
                    last_check = loop.time()
                    if not await self._call(self.backend.check):
                        await self._call(self.backend.release)
                        self._set_held(False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # database down: stay (or become) a standby and retry
                log.warning("writer lock: %s: %s", exc.__class__.__name__, exc)
                with contextlib.suppress(Exception):
                    await self._call(self.backend.release)
                self._set_held(False)
            await asyncio.sleep(self.poll_s)

    def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in one write transaction on the writer connection (blocking)."""
        with self._mutex:
            if not self._held:
                raise NotWriter("this replica does not hold the writer lock")
            try:
                return self.backend.write(fn)
            except NotWriter:
                # the lock went with the connection; maintain() (on the loop) says so and reacquires
                self._held = False
                raise

    def close(self) -> None:
        with self._mutex:
            self.backend.release()
            self._held = False
            self.backend.close()


class SqliteLock:
    """An exclusive ``flock`` on ``<db>.writer.lock`` beside the database file."""

    def __init__(self, engine: Engine, holder: str = "") -> None:
        self.engine = engine
        db = sqlite_path(engine)
        self.path: Path = db.with_name(db.name + ".writer.lock")
        self.holder = holder
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{self.holder} pid={os.getpid()}\n".encode())
        self._fd = fd
        return True

    def check(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def write(self, fn: Callable[[Connection], T]) -> T:
        with self.engine.connect() as conn:
            conn = conn.execution_options(sqlite_immediate=True)
            with conn.begin():
                return fn(conn)

    def close(self) -> None:
        pass  # the engine is the store's


def database_lock_key(database: str) -> int:
    """The writer lock's key for ``database``: advisory locks are the whole server's, so two
    clusters whose config databases share one PostgreSQL server must not take the same key."""
    return (PG_WRITER_LOCK_KEY ^ (zlib.crc32(database.encode()) << 8)) & 0x7FFF_FFFF_FFFF_FFFF


class PostgresLock:
    """A session-level ``pg_advisory_lock`` on a connection of its own, on which the writer's
    transactions run too."""

    def __init__(self, url: str, key: int | None = None) -> None:
        # A connection of its own (no pool): the lock lives exactly as long as it does.
        self.engine = sa.create_engine(url, poolclass=NullPool)
        self.key = key if key is not None else database_lock_key(self.engine.url.database or "")
        self._conn: Connection | None = None

    def try_acquire(self) -> bool:
        if self._conn is None:
            self._conn = self.engine.connect()
        got = bool(self._conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar())
        self._conn.commit()
        return got

    def check(self) -> bool:
        if self._conn is None:
            return False
        try:
            held = self._conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND pid = pg_backend_pid() AND objid = (:k & 4294967295) "
                    "AND classid = (:k >> 32) AND objsubid = 1"
                ),
                {"k": self.key},
            ).scalar()
            self._conn.commit()
            return bool(held)
        except sa.exc.SQLAlchemyError:
            return False

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def write(self, fn: Callable[[Connection], T]) -> T:
        if self._conn is None:
            raise NotWriter("writer connection is gone")
        try:
            with self._conn.begin():
                return fn(self._conn)
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            if self._conn.invalidated or self._conn.closed:
                self.release()
                raise NotWriter(f"writer connection lost: {exc}") from exc
            raise

    def close(self) -> None:
        self.engine.dispose()


def make_writer_lock(engine: Engine, poll_s: float = 1.0, holder: str = "") -> WriterLock:
    backend: LockBackend
    if is_sqlite(engine):
        backend = SqliteLock(engine, holder=holder)
    else:
        backend = PostgresLock(engine.url.render_as_string(hide_password=False))
    return WriterLock(backend, poll_s=poll_s)


__all__ = ["LockBackend", "NotWriter", "PostgresLock", "SqliteLock", "WriterLock", "make_writer_lock"]

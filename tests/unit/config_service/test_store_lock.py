"""The SQLite store and its single-writer file lock (real SQLite files)."""

from __future__ import annotations

import asyncio

import pytest

from config_service.lock import NotWriter, SqliteLock, WriterLock
from config_service.store import Store, StoreError, make_engine, migrate, normalize_db_url


def test_normalize_db_url():
    assert normalize_db_url("postgresql://u@h/db").startswith("postgresql+psycopg://")
    assert normalize_db_url("postgres://u@h/db").startswith("postgresql+psycopg://")
    assert normalize_db_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_in_memory_sqlite_is_refused():
    with pytest.raises(StoreError):
        make_engine("sqlite://")


def test_migrate_is_idempotent_and_epoch_starts_at_zero(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'a' / 'c.db'}")
    assert migrate(engine) == "0002"
    assert migrate(engine) == "0002"
    store = Store(engine)
    assert store.epoch() == 0 and store.snapshot() == (0, [])


async def test_only_one_lock_holder_and_the_standby_takes_over(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    e1, e2 = make_engine(url), make_engine(url)
    migrate(e1)
    a, b = WriterLock(SqliteLock(e1), poll_s=0.05), WriterLock(SqliteLock(e2), poll_s=0.05)
    ta = asyncio.create_task(a.maintain())
    await asyncio.wait_for(a.acquired.wait(), 5)
    tb = asyncio.create_task(b.maintain())
    await asyncio.sleep(0.3)
    assert a.held and not b.held
    with pytest.raises(NotWriter):
        b.write(lambda conn: None)
    assert a.write(lambda conn: Store.bump_epoch(conn)) == 1
    ta.cancel()
    a.close()
    await asyncio.wait_for(b.acquired.wait(), 5)
    assert b.write(lambda conn: Store.bump_epoch(conn)) == 2
    assert Store(e1).epoch() == 2
    tb.cancel()
    b.close()


def test_a_failed_write_transaction_rolls_back(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    migrate(engine)
    lock = WriterLock(SqliteLock(engine))
    assert lock.backend.try_acquire()
    lock._held = True

    def boom(conn):
        Store.bump_epoch(conn)
        Store.upsert_model(conn, "m", "sie_id: m\n", "default", 1)
        raise RuntimeError("fail after writing")

    with pytest.raises(RuntimeError):
        lock.write(boom)
    assert Store(engine).snapshot() == (0, [])
    lock.close()

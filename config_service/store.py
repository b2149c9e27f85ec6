"""The config store: SQLAlchemy over SQLite (default) or PostgreSQL, migrated with alembic.

Tables: ``models`` (one row per API-added model: the merged config as YAML, its pool and the
epochs it was created/updated at), ``config_state`` (one row: the epoch) and
``idempotency_keys`` (Idempotency-Key → SHA-256 of the body, status and response).

Reads use the engine's pool from any replica. Writes take a Connection from the writer lock
(config_service.lock), which only the replica holding the single-writer lock has.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url

metadata = sa.MetaData()

models_table = sa.Table(
    "models",
    metadata,
    sa.Column("model_id", sa.String(512), primary_key=True),
    sa.Column("raw_yaml", sa.Text(), nullable=False),
    sa.Column("pool", sa.String(128), nullable=False),
    sa.Column("created_epoch", sa.BigInteger(), nullable=False),
    sa.Column("updated_epoch", sa.BigInteger(), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

state_table = sa.Table(
    "config_state",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True),
    sa.Column("epoch", sa.BigInteger(), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
)

idempotency_table = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("key", sa.String(256), primary_key=True),
    sa.Column("body_sha256", sa.String(64), nullable=False),
    sa.Column("status", sa.Integer(), nullable=False),
    sa.Column("response_json", sa.Text(), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_idempotency_keys_created_at", "created_at"),
)

writer_table = sa.Table(
    "config_writer",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True),
    sa.Column("url", sa.String(1024), nullable=False),
    sa.Column("router_id", sa.String(256), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# pg_advisory_lock keys (64-bit); advisory locks are scoped to one database.
PG_WRITER_LOCK_KEY = 0x51E_C0F1_6001
PG_MIGRATE_LOCK_KEY = 0x51E_C0F1_6002


class StoreError(RuntimeError):
    """The database could not be reached or answered with an error."""


@dataclass(frozen=True)
class StoredModel:
    model_id: str
    raw_yaml: str
    pool: str
    created_epoch: int
    updated_epoch: int


@dataclass(frozen=True)
class IdempotencyRecord:
    key: str
    body_sha256: str
    status: int
    response: dict[str, Any]


def normalize_db_url(url: str) -> str:
    """``postgres://``/``postgresql://`` → the psycopg (v3) driver; anything else unchanged."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def is_sqlite(engine_or_url: Engine | str) -> bool:
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else make_url(engine_or_url)
    return url.get_backend_name() == "sqlite"


def sqlite_path(engine: Engine) -> Path:
    database = engine.url.database
    if not database or database == ":memory:":
        raise StoreError("the config store needs a SQLite file, not an in-memory database")
    return Path(database).resolve()


def make_engine(url: str, **kwargs: Any) -> Engine:
    url = normalize_db_url(url)
    if is_sqlite(url):
        database = make_url(url).database
        if not database or database == ":memory:":
            raise StoreError("the config store needs a SQLite file, not an in-memory database")
        Path(database).resolve().parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)
        _install_sqlite_transactions(engine)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, **kwargs)


def _install_sqlite_transactions(engine: Engine) -> None:
    """Real transactions on SQLite: pysqlite does not BEGIN before SELECTs on its own, so a
    multi-statement read would not be a snapshot. We BEGIN ourselves (IMMEDIATE for writes)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get("sqlite_immediate"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[Connection]:
    """Serialise concurrent migrations of replicas starting together."""
    if is_sqlite(engine):
        lock_path = sqlite_path(engine).with_name(sqlite_path(engine).name + ".migrate.lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with engine.connect() as conn:
                yield conn
        finally:
            os.close(fd)
    else:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": PG_MIGRATE_LOCK_KEY})
            conn.commit()
            try:
                yield conn
            finally:
                conn.rollback()
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": PG_MIGRATE_LOCK_KEY})
                conn.commit()


def migrate(engine: Engine) -> str:
    """Upgrade the schema to the newest alembic revision; returns that revision."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with _migration_lock(engine) as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
        conn.commit()
        return MigrationContext.configure(conn).get_current_revision() or ""


def _now() -> datetime:
    return datetime.now(UTC)


class Store:
    """Reads (any replica) and the write statements the writer runs inside its transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self.engine.connect() as conn:
                if self.engine.dialect.name == "postgresql":
                    conn = conn.execution_options(isolation_level="REPEATABLE READ")
                with conn.begin():
                    yield conn
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"config store unavailable: {exc.__class__.__name__}: {exc}") from exc

    # ---- reads -------------------------------------------------------------------------
    def epoch(self) -> int:
        with self._read() as conn:
            return self._epoch(conn)

    @staticmethod
    def _epoch(conn: Connection) -> int:
        value = conn.execute(sa.select(state_table.c.epoch).where(state_table.c.id == 1)).scalar_one_or_none()
        if value is None:
            raise StoreError("config_state row missing: the store was not migrated")
        return int(value)

    def snapshot(self) -> tuple[int, list[StoredModel]]:
        """The epoch and every stored model, read in one transaction (a consistent instant)."""
        with self._read() as conn:
            epoch = self._epoch(conn)
            rows = conn.execute(sa.select(models_table).order_by(models_table.c.model_id)).all()
        return epoch, [self._model(r) for r in rows]

    def get_model(self, model_id: str) -> StoredModel | None:
        with self._read() as conn:
            row = conn.execute(sa.select(models_table).where(models_table.c.model_id == model_id)).first()
        return self._model(row) if row else None

    @staticmethod
    def _model(row: Any) -> StoredModel:
        return StoredModel(
            model_id=row.model_id,
            raw_yaml=row.raw_yaml,
            pool=row.pool,
            created_epoch=int(row.created_epoch),
            updated_epoch=int(row.updated_epoch),
        )

    def get_idempotency(self, key: str, ttl_s: float) -> IdempotencyRecord | None:
        with self._read() as conn:
            row = conn.execute(sa.select(idempotency_table).where(idempotency_table.c.key == key)).first()
        if row is None:
            return None
        created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
        if created < _now() - timedelta(seconds=ttl_s):
            return None
        return IdempotencyRecord(row.key, row.body_sha256, int(row.status), json.loads(row.response_json))

    def writer(self) -> tuple[str, str] | None:
        """(URL, router id) the writer recorded when it took the lock; None before any did."""
        with self._read() as conn:
            row = conn.execute(sa.select(writer_table).where(writer_table.c.id == 1)).first()
        return (str(row.url), str(row.router_id)) if row else None

    def ping(self) -> None:
        with self._read() as conn:
            conn.execute(sa.text("SELECT 1"))

    # ---- writes (run by the writer, inside its transaction) ----------------------------
    @staticmethod
    def bump_epoch(conn: Connection) -> int:
        epoch = Store._epoch(conn) + 1
        conn.execute(
            sa.update(state_table).where(state_table.c.id == 1).values(epoch=epoch, updated_at=_now())
        )
        return epoch

    @staticmethod
    def upsert_model(conn: Connection, model_id: str, raw_yaml: str, pool: str, epoch: int) -> None:
        now = _now()
        updated = conn.execute(
            sa.update(models_table)
            .where(models_table.c.model_id == model_id)
            .values(raw_yaml=raw_yaml, pool=pool, updated_epoch=epoch, updated_at=now)
        ).rowcount
        if not updated:
            conn.execute(
                sa.insert(models_table).values(
                    model_id=model_id,
                    raw_yaml=raw_yaml,
                    pool=pool,
                    created_epoch=epoch,
                    updated_epoch=epoch,
                    created_at=now,
                    updated_at=now,
                )
            )

    @staticmethod
    def put_writer(conn: Connection, url: str, router_id: str) -> None:
        """Record where this writer takes writes (in the writer's own transaction: only the lock's
        holder can)."""
        values = {"url": url, "router_id": router_id, "updated_at": _now()}
        if not conn.execute(sa.update(writer_table).where(writer_table.c.id == 1).values(**values)).rowcount:
            conn.execute(sa.insert(writer_table).values(id=1, **values))

    @staticmethod
    def delete_model(conn: Connection, model_id: str) -> bool:
        """Remove an API-added model; False when there was none."""
        return bool(conn.execute(sa.delete(models_table).where(models_table.c.model_id == model_id)).rowcount)

    @staticmethod
    def put_idempotency(
        conn: Connection, key: str, body_sha256: str, status: int, response: dict[str, Any], ttl_s: float
    ) -> None:
        now = _now()
        conn.execute(
            sa.delete(idempotency_table).where(
                idempotency_table.c.created_at < now - timedelta(seconds=ttl_s)
            )
        )
        conn.execute(sa.delete(idempotency_table).where(idempotency_table.c.key == key))
        conn.execute(
            sa.insert(idempotency_table).values(
                key=key,
                body_sha256=body_sha256,
                status=status,
                response_json=json.dumps(response),
                created_at=now,
            )
        )

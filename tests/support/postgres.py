"""Scratch databases on the PostgreSQL server at 127.0.0.1:5432, for the tests that run against one
when it answers (and are skipped when it does not)."""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import Iterator

import pytest

HOST, PORT = "127.0.0.1", 5432


def answers() -> bool:
    try:
        with socket.create_connection((HOST, PORT), timeout=0.5):
            return True
    except OSError:
        return False


def admin_connection():
    """An autocommit connection as ``postgres`` or else ``root``, and the user it logged in as."""
    import psycopg

    last = None
    for user in ("postgres", "root"):
        try:
            conn = psycopg.connect(
                host=HOST, port=PORT, user=user, dbname="test", connect_timeout=2, autocommit=True
            )
            return conn, user
        except Exception as exc:  # noqa: PERF203
            last = exc
    raise RuntimeError(f"PostgreSQL at {HOST}:{PORT} is not usable: {last}")


@contextlib.contextmanager
def databases(
    prefix: str, count: int = 1, *, scheme: str = "postgresql", skip_without_login: bool = False
) -> Iterator[list[str]]:
    """The URLs of ``count`` new databases named ``<prefix>_<random>``, dropped on the way out.
    Skips the test when no server answers, and when none of the users may log in if
    ``skip_without_login`` (else that fails it)."""
    if not answers():
        pytest.skip(f"PostgreSQL does not answer on {HOST}:{PORT}")
    try:
        conn, user = admin_connection()
    except RuntimeError:
        if skip_without_login:
            pytest.skip(f"PostgreSQL at {HOST}:{PORT} takes no connection as postgres or root")
        raise
    names = [f"{prefix}_{uuid.uuid4().hex[:12]}" for _ in range(count)]
    try:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')
        yield [f"{scheme}://{user}@{HOST}:{PORT}/{name}" for name in names]
    finally:
        for name in names:
            with contextlib.suppress(Exception):
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()

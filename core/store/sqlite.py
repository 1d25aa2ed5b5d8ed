"""Opening store.db safely: look before touching, then an engine with the PRAGMAs every connection needs.

A file that is not ours (corrupt, another program's SQLite, a newer SpecPilot's) must be refused with an
error that says what to do, and must be left byte-for-byte as it was; so it is inspected read-only first.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event

from specpilot.core.store.migrations import SCHEMA_VERSION, missing_steps

SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 5000


class StoreError(Exception):
    """A store that cannot be used; the one-line message says what to do about it."""


def inspect_file(path: Path) -> int | None:
    """The schema version of an existing store at `path`, None for a missing or empty file; else StoreError."""
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        if not path.parent.is_dir():
            raise StoreError(f"folder {path.parent} does not exist; create it or pass another --db path")
        return None
    if not path.is_file():
        raise StoreError(f"{path} is not a file; pass a file path with --db")
    with path.open("rb") as handle:
        if handle.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            raise StoreError(f"{path} is not an SQLite database (corrupt or another kind of file); "
                             "move it aside or pass another --db path")
    try:
        conn = _read_only_connect(path)
        try:
            tables = {row[0] for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
            if not tables:
                return None
            if "meta" not in tables:
                raise StoreError(f"{path} is an SQLite database but not a SpecPilot store (no meta table; tables: "
                                 f"{', '.join(sorted(tables)[:5])}); pass another --db path")
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path} cannot be read as a SpecPilot store ({exc}); move it aside or pass "
                         "another --db path") from None
    if row is None or not str(row[0]).lstrip("-").isdigit():
        raise StoreError(f"{path} is an SQLite database but not a SpecPilot store (no schema_version in meta); "
                         "pass another --db path")
    version = int(row[0])
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path} has store schema version {version}, newer than this SpecPilot supports "
                         f"({SCHEMA_VERSION}); upgrade SpecPilot or pass another --db path")
    if missing_steps(version):
        raise StoreError(f"{path} has store schema version {version} and there is no migration from it to "
                         f"version {SCHEMA_VERSION}; start a new store with another --db path")
    return version


def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
    # Autocommit at the driver so SQLAlchemy's BEGIN (below) is the only transaction control: DDL in a
    # migration then commits or rolls back with everything else.
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.close()


def _on_begin(conn: object) -> None:
    # Writers take the write lock up front so a second writer waits (busy_timeout) instead of failing on a
    # lock upgrade; readers start a plain snapshot and never block the writer under WAL.
    write = conn.get_execution_options().get("store_write", False)  # type: ignore[attr-defined]
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")  # type: ignore[attr-defined]


def _read_only_connect(path: Path) -> sqlite3.Connection:
    """A connection that can never write: mode=ro, or immutable=1 where even the WAL index cannot be
    created (a read-only filesystem), so `runs` and `show` work on a store nobody may change."""
    base = f"file:{quote(str(path.resolve()))}"
    conn = sqlite3.connect(f"{base}?mode=ro", uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        conn.close()
    return sqlite3.connect(f"{base}?immutable=1", uri=True, check_same_thread=False)


def _on_connect_read_only(dbapi_conn: sqlite3.Connection, _record: object) -> None:
    dbapi_conn.isolation_level = None
    dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


def make_read_only_engine(path: Path) -> Engine:
    """An engine for reading an existing store without writing a byte (no schema, no WAL switch)."""
    engine = create_engine("sqlite://", creator=lambda: _read_only_connect(path))
    event.listen(engine, "connect", _on_connect_read_only)
    event.listen(engine, "begin", _on_begin)
    return engine


def make_engines(path: Path) -> tuple[Engine, Engine]:
    """(reader, writer) engines over one pool; the writer's transactions begin IMMEDIATE."""
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False,
                                                              "timeout": BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _on_connect)
    event.listen(engine, "begin", _on_begin)
    return engine, engine.execution_options(store_write=True)

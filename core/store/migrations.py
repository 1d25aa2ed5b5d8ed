"""Schema versions of store.db and the steps that upgrade an older file in place.

MIGRATIONS[v] upgrades a file at version v to v + 1, inside the same transaction as the version bump, so
an interrupted upgrade leaves the file at its old version. Tables added in a version need no step:
`metadata.create_all` adds missing tables after the steps run.
"""

from __future__ import annotations

from typing import Callable

from sqlalchemy import Connection

SCHEMA_VERSION = 1

Migration = Callable[[Connection], None]


def _columns(conn: Connection, table: str) -> set[str]:
    return {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")}


def _v0_event_round(conn: Connection) -> None:
    """Version 0 kept an event's round only inside its payload; version 1 has a column so replay can slice."""
    if not _columns(conn, "event"):
        return
    if "round" not in _columns(conn, "event"):
        conn.exec_driver_sql("ALTER TABLE event ADD COLUMN round INTEGER")
    conn.exec_driver_sql("UPDATE event SET round = json_extract(payload, '$.round') "
                         "WHERE round IS NULL AND json_valid(payload)")
    conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_event_run_round ON event (run_id, round)")


MIGRATIONS: dict[int, Migration] = {
    0: _v0_event_round,
}


def missing_steps(version: int, migrations: dict[int, Migration] | None = None) -> list[int]:
    """The versions between `version` and SCHEMA_VERSION that have no upgrade step."""
    table = MIGRATIONS if migrations is None else migrations
    return [v for v in range(version, SCHEMA_VERSION) if v not in table]


def upgrade(conn: Connection, version: int) -> None:
    """Run every step from `version` up to SCHEMA_VERSION on `conn` (the caller owns the transaction)."""
    for v in range(version, SCHEMA_VERSION):
        MIGRATIONS[v](conn)

"""Store: round trips, transactions, redaction, replay slicing, memory order, threads, schema versions."""

from __future__ import annotations

import random
import sqlite3
import threading
from pathlib import Path

import pytest

from specpilot.core.events import Event
from specpilot.core.store import SCHEMA_VERSION, Store, StoreError
from specpilot.core.store import migrations

FORCING = {"tokens": 256, "mismatches": 0, "rate": 0.0, "near_ties": 2, "threshold": 0.002, "passed": True}
SAMPLES = [{"request": i, "candidate_s": 0.8, "incumbent_s": 1.0} for i in range(4)]
EVAL = {"speedup": 1.25, "low": 1.2, "high": 1.3, "noise_floor": 0.02, "passed": True, "samples": SAMPLES}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def store(path: Path) -> Store:
    return Store(path)


def add_round(store: Store, run: int, index: int, cid: str) -> int:
    rid = store.start_round(run, index, {"largest_gap": "draft"})
    store.add_candidate(rid, cid, "local-tree", "Deeper", "why", "recipe", "--- a\n+++ b\n", "name = 'x'\n", 1.1)
    return rid


def test_candidate_round_trip(store: Store) -> None:
    run = store.create_run({"target": "demo"}, {"auto": True})
    rid = add_round(store, run, 1, "c1")
    store.set_gate("c1", "applies", True, "")
    store.add_forcing("c1", {**FORCING, "worst_request": 3})
    store.add_evaluation("c1", "tuning", EVAL)
    store.add_evaluation("c1", "heldout", {**EVAL, "speedup": 1.2})
    store.add_decision("c1", "approve", "looks good", "user")
    cand = store.candidate("c1")
    assert cand is not None
    assert (cand["agent"], cand["status"], cand["run_id"], cand["round"], cand["round_id"]) == (
        "local-tree", "approved", run, 1, rid)
    assert cand["gates"] == {"applies": {"passed": True, "detail": ""}}
    assert cand["forcing"]["near_ties"] == 2 and cand["forcing"]["extra"] == {"worst_request": 3}
    assert cand["evaluations"]["tuning"]["samples"] == SAMPLES
    assert cand["evaluations"]["heldout"]["speedup"] == 1.2
    assert cand["decision"]["note"] == "looks good"
    assert [c["cid"] for c in store.candidates(rid)] == ["c1"]
    assert store.candidate("nope") is None


def test_runs_and_rounds_listing(store: Store) -> None:
    first = store.create_run({"target": "a"}, {})
    second = store.create_run({"target": "b"}, {})
    for index, speedup in ((1, 1.4), (2, 1.7)):
        rid = add_round(store, first, index, f"c{index}")
        store.finish_round(rid, {"round": index, "heldout_speedup_vs_ar": speedup})
    store.finish_run(first, "finished", {"best": 1.7})
    runs = store.list_runs()
    assert [r["id"] for r in runs] == [second, first]
    assert runs[1]["status"] == "finished" and runs[1]["finished_at"] is not None
    assert (runs[1]["rounds"], runs[1]["best_heldout_speedup"], runs[1]["deployment"]) == (2, 1.7, {"target": "a"})
    assert (runs[0]["rounds"], runs[0]["best_heldout_speedup"]) == (0, None)
    rounds = store.list_rounds(first)
    assert [(r["index"], r["candidates"], r["incumbent"]["heldout_speedup_vs_ar"]) for r in rounds] == [
        (1, 1, 1.4), (2, 1, 1.7)]


def test_failed_gate_fails_candidate_and_blocks_approval(store: Store) -> None:
    rid = add_round(store, store.create_run({}, {}), 1, "c1")
    store.set_gate("c1", "forcing", False, "3 mismatches")
    assert store.candidate("c1")["status"] == "failed"
    with pytest.raises(StoreError, match="failed .forcing: 3 mismatches.; it cannot be approved"):
        store.add_decision("c1", "approve", "", "user")
    store.add_decision("c1", "reject", "", "auto")
    store.add_candidate(rid, "c2", "a", "t", "r", "recipe", "", "", None)
    store.fail_candidate("c2", "diff did not apply")
    assert [(c["cid"], c["status"], c["reason"]) for c in store.candidates(rid)] == [
        ("c1", "rejected", "forcing: 3 mismatches"), ("c2", "failed", "diff did not apply")]


def test_clear_errors_for_unknown_ids(store: Store) -> None:
    run = store.create_run({}, {})
    add_round(store, run, 1, "c1")
    with pytest.raises(StoreError, match="unknown candidate 'zz'; record it with add_candidate first"):
        store.set_gate("zz", "smoke", True, "")
    with pytest.raises(StoreError, match="unknown run id 99"):
        store.start_round(99, 1, {})
    with pytest.raises(StoreError, match="candidate 'c1' already exists"):
        add_round(store, run, 2, "c1")
    with pytest.raises(StoreError, match="unknown gate 'speed'"):
        store.set_gate("c1", "speed", True, "")


def test_transaction_commits_all_or_nothing(store: Store) -> None:
    run = store.create_run({}, {})
    with pytest.raises(RuntimeError):
        with store.transaction():
            add_round(store, run, 1, "c1")
            store.append_event(run, Event("round_started", {"round": 1}))
            assert store.candidate("c1") is not None
            raise RuntimeError("crash mid-step")
    assert store.list_rounds(run) == [] and store.candidate("c1") is None and store.events(run) == []
    with store.transaction():
        with store.transaction():
            add_round(store, run, 1, "c1")
        store.append_event(run, Event("round_started", {"round": 1}))
    assert len(store.list_rounds(run)) == 1 and len(store.events(run)) == 1


def test_events_seq_round_and_replay_slice(store: Store) -> None:
    run = store.create_run({}, {})
    other = store.create_run({}, {})
    kinds = []
    for index in (1, 2, 3):
        for kind, payload in (("round_started", {"round": index}), ("agent_chunk", {"cid": "c", "text": "x"}),
                              ("round_finished", {"round": index})):
            stored = store.append_event(run, Event(kind, payload, round=index))
            kinds.append((stored.seq, kind, index))
    assert store.append_event(other, Event("notice", {"message": "hi"})).seq == 1
    events = store.events(run)
    assert [(e.seq, e.kind, e.round) for e in events] == kinds
    assert all(e.run == run for e in events)
    assert [e.seq for e in store.events(run, upto_round=2)] == list(range(1, 7))
    assert len(store.events(run, upto_round=7)) == 9


def test_api_key_never_stored(store: Store, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "plain-secret-value-42"
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    run = store.create_run({"target": "t", "note": f"key={secret}"}, {"token": "sk-ant-api03-AbC_d-9"})
    returned = store.append_event(run, Event("error", {"message": f"401 for {secret}", "nested": [secret]}))
    assert returned.payload == {"message": "401 for [redacted]", "nested": ["[redacted]"]}
    rid = store.start_round(run, 1, {})
    store.add_candidate(rid, "c1", "claude", secret, f"rationale {secret}", "recipe", secret, "", None)
    store.fail_candidate("c1", f"API error with sk-ant-x {secret}")
    store.add_memory({"mechanism": "m", "fingerprint": "f", "description": secret})
    store.finish_run(run, "failed", {"error": secret})
    conn = sqlite3.connect(path)
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    dump = "\n".join(str(row) for table in tables for row in conn.execute(f"SELECT * FROM {table}"))
    conn.close()
    assert "[redacted]" in dump and secret not in dump and "sk-ant-" not in dump


def test_memory_puts_this_deployment_first(store: Store) -> None:
    evidence = {"run": 1, "round": 2, "candidate": "c3", "interval": [1.1, 1.3]}
    store.add_memory({"mechanism": "a", "fingerprint": "other", "effect": 1.5})
    store.add_memory({"mechanism": "b", "fingerprint": "mine", "effect": 1.1, "evidence": evidence,
                      "fragment": {"tree": {"depth": 6}}, "description": "deeper chain"})
    store.add_memory({"mechanism": "c", "fingerprint": "mine", "effect": 1.2})
    assert [m["mechanism"] for m in store.memory("mine")] == ["c", "b", "a"]
    assert [m["mechanism"] for m in store.memory()] == ["a", "c", "b"]
    assert store.memory("mine")[1]["evidence"] == evidence
    with pytest.raises(StoreError, match="unknown keys \\['colour'\\], missing \\['fingerprint'\\]"):
        store.add_memory({"mechanism": "x", "colour": "red"})


def test_one_writer_and_reader_threads(store: Store) -> None:
    run = store.create_run({}, {})
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                seqs = [e.seq for e in store.events(run)]
                assert seqs == list(range(1, len(seqs) + 1))
                store.list_runs()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    for i in range(150):
        store.append_event(run, Event("agent_chunk", {"cid": "c", "text": str(i)}))
    done.set()
    for thread in readers:
        thread.join()
    assert errors == []
    assert [e.payload["text"] for e in store.events(run)] == [str(i) for i in range(150)]


def test_reopen_keeps_data_and_version(store: Store, path: Path) -> None:
    run = store.create_run({"target": "t"}, {})
    store.close()
    again = Store(path)
    assert [r["id"] for r in again.list_runs()] == [run]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    conn.close()


# --- files that are not (this version of) a store ------------------------------------------------


def refuses(path: Path, message: str) -> None:
    before = path.read_bytes()
    with pytest.raises(StoreError) as err:
        Store(path)
    assert str(err.value) == message
    assert "\n" not in str(err.value)
    assert path.read_bytes() == before


def test_corrupt_file_is_refused_untouched(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))
    refuses(path, f"{path} is not an SQLite database (corrupt or another kind of file); "
                  "move it aside or pass another --db path")
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    refuses(path, f"{path} cannot be read as a SpecPilot store (file is not a database); "
                  "move it aside or pass another --db path")


def test_foreign_sqlite_is_refused_untouched(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('ada')")
    conn.commit()
    conn.close()
    refuses(path, f"{path} is an SQLite database but not a SpecPilot store (no meta table; tables: users); "
                  "pass another --db path")


def set_version(path: Path, version: int) -> None:
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
    conn.commit()
    conn.close()


def test_newer_schema_is_refused_untouched(store: Store, path: Path) -> None:
    store.close()
    set_version(path, SCHEMA_VERSION + 1)
    refuses(path, f"{path} has store schema version {SCHEMA_VERSION + 1}, newer than this SpecPilot supports "
                  f"({SCHEMA_VERSION}); upgrade SpecPilot or pass another --db path")


def make_version0(path: Path) -> int:
    """A store as version 0 wrote it: the event table had no `round` column (the round lived in the payload)."""
    store = Store(path)
    run = store.create_run({"target": "old"}, {})
    for index in (1, 2):
        store.append_event(run, Event("round_started", {"round": index}))
        store.append_event(run, Event("round_finished", {"round": index}))
    store.close()
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE event_v0 (id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES run (id),
                               seq INTEGER NOT NULL, time FLOAT NOT NULL, kind VARCHAR NOT NULL,
                               payload JSON NOT NULL, UNIQUE (run_id, seq));
        INSERT INTO event_v0 SELECT id, run_id, seq, time, kind, payload FROM event;
        DROP TABLE event;
        ALTER TABLE event_v0 RENAME TO event;
        UPDATE meta SET value = '0' WHERE key = 'schema_version';
    """)
    conn.close()
    return run


def columns(path: Path, table: str) -> set[str]:
    conn = sqlite3.connect(path)
    found = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    conn.close()
    return found


def test_version0_store_is_migrated_in_place(path: Path) -> None:
    run = make_version0(path)
    assert "round" not in columns(path, "event")
    store = Store(path)
    assert "round" in columns(path, "event")
    assert [(e.kind, e.round) for e in store.events(run)] == [
        ("round_started", 1), ("round_finished", 1), ("round_started", 2), ("round_finished", 2)]
    assert len(store.events(run, upto_round=1)) == 2
    assert store.append_event(run, Event("notice", {"message": "after"})).seq == 5
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    conn.close()
    assert Store(path).list_runs()[0]["deployment"] == {"target": "old"}


def test_old_schema_without_migration_is_refused(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_version0(path)
    monkeypatch.setattr(migrations, "MIGRATIONS", {})
    refuses(path, f"{path} has store schema version 0 and there is no migration from it to version "
                  f"{SCHEMA_VERSION}; start a new store with another --db path")


def test_failed_migration_leaves_old_version(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_version0(path)

    def broken(conn) -> None:  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("ALTER TABLE event ADD COLUMN round INTEGER")
        raise ValueError("disk says no")

    monkeypatch.setitem(migrations.MIGRATIONS, 0, broken)
    with pytest.raises(StoreError, match="upgrading the store from schema version 0 failed .disk says no."):
        Store(path)
    assert "round" not in columns(path, "event")
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta").fetchone() == ("0",)
    conn.close()


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="folder .* does not exist; create it or pass another --db path"):
        Store(tmp_path / "nope" / "store.db")

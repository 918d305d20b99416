"""The ledger's journal on real files and real SQLite: rows and requests in flight survive a
SIGKILL (a real child process killed), a database outage and a restart; a row the database
refuses goes to the dead-letter file and every other row is written; the bound in bytes and
its two policies; torn lines; one process a slot; segments deleted once written."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tokenpace.gateway import metrics
from tokenpace.gateway.ledger import BudgetState, LedgerError, UsageRecord, open_ledger
from tokenpace.gateway.ledger._journal import Journal, JournalError
from tokenpace.gateway.ledger._sqlite import SqliteBackend
from tokenpace.gateway.ledger._writer import Ledger

from .test_ledger import T0, record


def _url(path: Path) -> str:
    return f"sqlite:///{path}"


def _count(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    finally:
        conn.close()


def _ids(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY request_id")]
    finally:
        conn.close()


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("segment-*.jsonl"))


def _sample(name: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name)
    return 0.0 if value is None else value


_CHILD = r"""
import os, signal, sys
from tokenpace.gateway.ledger import UsageRecord, open_ledger
url, journal, n_rows, n_open = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# A writer that never writes before the kill: everything is only in the journal.
ledger = open_ledger(url, journal=journal, flush_interval_s=3600, max_batch=10**6)
for i in range(n_rows):
    ledger.record(UsageRecord(f"row-{i}", "acme", "tiny", "default", 3, 4, 11.0, 1.0, 2.0,
                              5.0, "stop", 1.0, 2.0))
for i in range(n_open):
    rec = UsageRecord(f"open-{i}", "acme", "tiny", "default", 3, 50, 103.0, 1.0, None,
                      5.0, "interrupted", 1.0, 2.0, estimated=True)
    assert ledger.open(rec, engine="http://127.0.0.1:1", kind="chat", cost=(1.0, 2.0, 1.0))
# One request of the opened ones ended before the kill: it is not in flight.
ledger.record(UsageRecord("open-0", "acme", "tiny", "default", 3, 7, 17.0, 1.0, 2.0, 5.0,
                          "stop", 1.0, 2.0))
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_process_loses_no_row_and_names_its_requests_in_flight(
        tmp_path: Path) -> None:
    db, journal = tmp_path / "usage.db", tmp_path / "journal"
    child = subprocess.run([sys.executable, "-c", _CHILD, _url(db), str(journal), "300", "5"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "ready" in child.stdout
    assert _count(db) == 0  # nothing reached the database before the kill

    ledger = open_ledger(_url(db), journal=str(journal), flush_interval_s=0.05)
    try:
        orphans = ledger.orphans()
        assert sorted(o["open"]["request_id"] for o in orphans) == [f"open-{i}"
                                                                    for i in range(1, 5)]
        assert {o["engine"] for o in orphans} == {"http://127.0.0.1:1"}
        assert all(o["kind"] == "chat" and o["cost"] == [1.0, 2.0, 1.0] for o in orphans)
        ledger.flush()
        assert _count(db) == 301  # 300 rows and open-0's, each once
        # The orphans' segment stays until their rows are recorded.
        assert _segments(ledger.journal.directory)
        for o in orphans:
            rec = UsageRecord(o["open"]["request_id"], "acme", "tiny", "default", 3, 9, 21.0,
                              None, None, 0.0, "interrupted", 1.0, 2.0)
            ledger.record(rec)
        ledger.flush()
        assert _count(db) == 305
    finally:
        ledger.close()
    # A third process finds nothing left to do.
    again = open_ledger(_url(db), journal=str(journal))
    try:
        assert again.orphans() == []
        again.flush()
        assert _count(db) == 305
    finally:
        again.close()


def test_rows_wait_in_the_journal_through_an_outage_and_a_restart(tmp_path: Path) -> None:
    db, journal = tmp_path / "usage.db", tmp_path / "journal"
    ledger = open_ledger(_url(db), journal=str(journal), flush_interval_s=3600)
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the database refuses every write: an outage
    try:
        for i in range(20):
            ledger.record(record(i))
        ledger.save_budgets([BudgetState("acme", "20000/10s", 42.0, T0)])
        with pytest.raises(LedgerError, match="locked"):
            ledger.flush()
        assert ledger.journal.size_bytes > 0
        started = time.monotonic()
        ledger.close()  # the last flush fails too: the rows stay in the journal
        assert time.monotonic() - started < 12.0  # bounded by close_timeout_s (10 s)
        assert ledger.dropped == 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert _count(db) == 0
    restarted = open_ledger(_url(db), journal=str(journal))
    try:
        restarted.flush()
        assert restarted.rows() == [record(i) for i in range(20)]
    finally:
        restarted.close()


def test_a_row_the_database_refuses_goes_to_the_dead_letter_file(tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    SqliteBackend(str(db), create=True).close()
    conn = sqlite3.connect(db)
    # A value the database refuses while it answers (as Postgres refuses a NUL byte).
    conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON requests WHEN NEW.tenant = 'evil' "
                 "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
    conn.commit()
    conn.close()
    before = _sample("tokenpace_gateway_ledger_dead_letter_rows_total")
    ledger = open_ledger(_url(db), journal=str(tmp_path / "journal"), flush_interval_s=3600,
                         max_batch=64)
    try:
        for i in range(100):
            ledger.record(record(i, tenant="evil" if i in (7, 70) else "acme"))
        ledger.flush()
        assert sorted(_ids(db)) == sorted(f"req-{i}" for i in range(100) if i not in (7, 70))
        lines = [json.loads(x) for x in ledger.dead_letter_path.read_text().splitlines()]
        assert [x["row"]["request_id"] for x in lines] == ["req-7", "req-70"]
        assert "refused by the test" in lines[0]["error"]
        assert _sample("tokenpace_gateway_ledger_dead_letter_rows_total") - before == 2
        # Later rows are written as usual: metering did not stop.
        ledger.record(record(100))
        ledger.flush()
        assert _count(db) == 99
    finally:
        ledger.close()


def test_the_bound_refuses_opens_and_keeps_served_rows(tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    backend = SqliteBackend(str(db), create=True)
    journal = Journal(tmp_path / "journal", max_bytes=4096)  # one segment: rotated once read
    ledger = Ledger(backend, flush_interval_s=3600, max_batch=10_000, journal=journal,
                    on_full="refuse")
    try:
        opened = 0
        while ledger.open(record(opened), engine="http://e", kind="chat"):
            opened += 1
        assert 0 < opened < 40
        # An unserved row (a refusal) is dropped at the bound; a served one uses the reserve.
        refused = replace(record(900), served=False, finish_reason="rejected:budget")
        ledger.record(refused)
        assert ledger.dropped == 1
        for i in range(opened):
            ledger.record(record(i))
        assert ledger.dropped == 1
        ledger.flush()
        assert _count(db) == opened
        assert journal.size_bytes < 4096  # written segments were deleted
    finally:
        ledger.close()


def test_the_drop_policy_serves_unjournaled_and_counts(tmp_path: Path) -> None:
    backend = SqliteBackend(str(tmp_path / "usage.db"), create=True)
    journal = Journal(tmp_path / "journal", max_bytes=1024)
    ledger = Ledger(backend, flush_interval_s=3600, max_batch=10_000, journal=journal,
                    on_full="drop")
    before = _sample("tokenpace_gateway_ledger_unjournaled_requests_total")
    try:
        results = [ledger.open(record(i), engine="http://e", kind="chat") for i in range(20)]
        assert all(results)
        assert _sample("tokenpace_gateway_ledger_unjournaled_requests_total") > before
    finally:
        ledger.close()


def test_a_torn_last_line_is_cut_off(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    journal.append({"row": {"request_id": "a"}})
    journal.append({"row": {"request_id": "b"}})
    slot = journal.directory
    journal.close()
    segment = slot / _segments(slot)[0]
    with open(segment, "ab") as f:
        f.write(b'{"row": {"request_id": "c"')  # the machine stopped mid-write
    again = Journal(tmp_path / "j", max_bytes=1 << 20)
    try:
        assert again.directory == slot  # the slot the closed journal left
        assert [e["row"]["request_id"] for _, e in again.entries()] == ["a", "b"]
        assert segment.read_bytes().endswith(b"\n")
        again.append({"row": {"request_id": "d"}})
        assert [e["row"]["request_id"] for _, e in again.read(10)] == ["a", "b", "d"]
    finally:
        again.close()


def test_one_process_a_slot(tmp_path: Path) -> None:
    first = Journal(tmp_path / "j", max_bytes=1 << 20)
    second = Journal(tmp_path / "j", max_bytes=1 << 20)
    try:
        assert first.directory != second.directory
        assert {first.directory.name, second.directory.name} == {"0", "1"}
    finally:
        second.close()
    third = Journal(tmp_path / "j", max_bytes=1 << 20)  # takes the slot second left
    try:
        assert third.directory.name == "1"
    finally:
        third.close()
        first.close()


def test_an_unwritable_directory_is_a_ledger_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(LedgerError, match="journal"):
        open_ledger(_url(tmp_path / "usage.db"), journal=str(blocker / "j"))
    with pytest.raises(JournalError):
        Journal(blocker / "j", max_bytes=1)


def test_segments_are_deleted_once_written_unless_an_open_waits(tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    backend = SqliteBackend(str(db), create=True)
    journal = Journal(tmp_path / "journal", max_bytes=1 << 30, segment_bytes=2048)
    ledger = Ledger(backend, flush_interval_s=3600, max_batch=7, journal=journal)
    try:
        assert ledger.open(record(999), engine="http://e", kind="chat")  # still in flight
        for i in range(60):
            ledger.record(record(i))
        # Segments numbered past 3 were made (the writer may already have deleted some:
        # it writes every 7 rows, so how many are left at this point depends on timing).
        newest = _segments(journal.directory)[-1]
        assert int(newest.removeprefix("segment-").removesuffix(".jsonl")) > 3
        ledger.flush()
        assert _count(db) == 60
        left = _segments(journal.directory)
        assert left[0] == "segment-000000000001.jsonl"  # the open's segment is kept
        assert len(left) <= 3
        ledger.record(record(999))  # it ended
        ledger.flush()
        ledger.record(record(1000))  # a write after: the open's segment goes
        ledger.flush()
        assert "segment-000000000001.jsonl" not in _segments(journal.directory)
    finally:
        ledger.close()


class _HungBackend:
    """The real SQLite backend whose writes hang until released (a database that stopped
    answering without closing the connection)."""

    def __init__(self, inner: SqliteBackend) -> None:
        self.inner = inner
        self.placeholder = inner.placeholder
        self.release = threading.Event()

    def write(self, rows: list[tuple[Any, ...]], budgets: list[tuple[Any, ...]]) -> None:
        self.release.wait()
        self.inner.write(rows, budgets)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.inner.query(sql, params)

    def ping(self) -> None:
        self.inner.ping()

    def close(self) -> None:
        self.inner.close()


def test_close_is_bounded_when_the_database_hangs(tmp_path: Path) -> None:
    db, directory = tmp_path / "usage.db", tmp_path / "journal"
    hung = _HungBackend(SqliteBackend(str(db), create=True))
    ledger = Ledger(hung, flush_interval_s=0.01, max_batch=10,
                    journal=Journal(directory, max_bytes=1 << 20), close_timeout_s=0.5)
    for i in range(5):
        ledger.record(record(i))
    time.sleep(0.1)  # the writer is now blocked in write()
    started = time.monotonic()
    ledger.close()
    assert time.monotonic() - started < 2.0
    hung.release.set()  # let the abandoned thread end
    ledger._thread.join(5)
    # The rows are still in the journal: the next process writes them.
    restarted = open_ledger(_url(db), journal=str(directory))
    try:
        restarted.flush()
        assert _count(db) == 5
    finally:
        restarted.close()


def _config(tmp_path: Path, **keys: Any) -> Any:
    from tokenpace.gateway import parse_config

    return parse_config({"engines": ["http://127.0.0.1:1"],
                         "tenants": [{"id": "a", "api_keys": ["sk-a"]}], **keys},
                        base_dir=tmp_path)


def test_the_journal_settings_and_their_defaults(tmp_path: Path) -> None:
    from tokenpace.gateway import ConfigError

    beside = _config(tmp_path, ledger="sqlite:///usage.db")
    assert beside.ledger_journal == str(tmp_path / "usage.db.journal")
    assert beside.ledger_journal_max_bytes == 1 << 30 and beside.on_ledger_full == "refuse"
    postgres = _config(tmp_path, ledger="postgresql://u@db/usage")
    assert postgres.ledger_journal == str(tmp_path / "tokenpace-journal")
    given = _config(tmp_path, ledger_journal="j", ledger_journal_max_bytes=1 << 20,
                    on_ledger_full="drop")
    assert (given.ledger_journal, given.ledger_journal_max_bytes, given.on_ledger_full) == (
        str(tmp_path / "j"), 1 << 20, "drop")
    with pytest.raises(ConfigError, match="on_ledger_full"):
        _config(tmp_path, on_ledger_full="ignore")
    with pytest.raises(ConfigError, match="ledger_journal_max_bytes"):
        _config(tmp_path, ledger_journal_max_bytes=10)
    with pytest.raises(ConfigError, match="ledger_journal"):
        _config(tmp_path, ledger_journal=["not", "a", "path"])


def test_budget_levels_survive_a_crash_before_the_database_had_them(tmp_path: Path) -> None:
    """Levels are journaled: a process killed before its writer wrote them (simulated by a
    writer that never runs and a ledger never closed) leaves them for the next start,
    which prefers them to the database's older ones."""
    db, directory = tmp_path / "usage.db", tmp_path / "journal"
    first = open_ledger(_url(db), journal=str(directory))
    first.save_budgets([BudgetState("acme", "100/1d", 10.0, T0)])
    first.flush()
    first.close()
    hung = _HungBackend(SqliteBackend(str(db), create=True))
    crashed = Ledger(hung, flush_interval_s=3600, max_batch=10,
                     journal=Journal(directory, max_bytes=1 << 20), close_timeout_s=0.1)
    crashed.save_budgets([BudgetState("acme", "100/1d", 3.0, T0 + 5)])
    crashed.journal.close()  # the process died: its slot is free, nothing was written
    restarted = open_ledger(_url(db), journal=str(directory))
    try:
        assert restarted.load_budgets() == [BudgetState("acme", "100/1d", 3.0, T0 + 5)]
        restarted.flush()
        assert restarted.load_budgets() == [BudgetState("acme", "100/1d", 3.0, T0 + 5)]
    finally:
        restarted.close()
        hung.release.set()


def test_the_reader_spills_to_disk_past_its_memory_and_comes_back(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", max_bytes=1 << 20, segment_bytes=300, memory_entries=5)
    try:
        for i in range(20):
            assert journal.append({"row": [f"r{i}"]})
        first = [e["row"][0] for _, e in journal.read(7)]
        assert first == [f"r{i}" for i in range(7)]  # 5 from memory, then the disk
        for i in range(20, 23):
            journal.append({"row": [f"r{i}"]})  # appended while the reader is on disk
        rest = [e["row"][0] for _, e in journal.read(100)]
        assert rest == [f"r{i}" for i in range(7, 23)]
        journal.append({"row": ["r23"]})  # caught up: memory again
        assert [e["row"][0] for _, e in journal.read(100)] == ["r23"]
        assert not journal._spilled and journal.corrupt == 0
    finally:
        journal.close()


def test_segments_read_only_in_memory_are_not_deleted_before_they_are_written(
        tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", max_bytes=1 << 20, segment_bytes=200, memory_entries=12)
    try:
        for i in range(20):  # about 9 a segment: the spill starts in segment 2
            journal.append({"row": [f"r{i}" * 5]})
        assert journal._spilled and journal._read_seg == 2
        assert journal.read_segment == 1  # memory holds segment 1's entries, unread
        journal.remove(journal.read_segment, set())
        assert "segment-000000000001.jsonl" in _segments(journal.directory)
    finally:
        journal.close()


def test_a_slot_whose_process_is_gone_is_taken_over(tmp_path: Path) -> None:
    """Two processes shared a directory (two workers) and both died; one process comes back
    (the gateway now runs one worker): it writes both slots' rows and finds both slots'
    requests in flight."""
    import fcntl

    db, directory = tmp_path / "usage.db", tmp_path / "journal"

    def child(worker: int) -> None:
        script = (_CHILD.replace('"row-{i}"', f'"w{worker}-row-{{i}}"')
                  .replace('"open-{i}"', f'"w{worker}-open-{{i}}"')
                  .replace('"open-0"', f'"w{worker}-open-0"'))
        done = subprocess.run([sys.executable, "-c", script, _url(db), str(directory), "50",
                               "3"], capture_output=True, text=True, timeout=60)
        assert done.returncode == -signal.SIGKILL, done.stderr

    child(0)  # slot 0
    held = open(directory / "0" / "lock", "rb")
    fcntl.flock(held, fcntl.LOCK_EX)  # slot 0 busy: the second worker takes slot 1
    child(1)
    held.close()
    assert list((directory / "1").glob("segment-*.jsonl"))
    ledger = open_ledger(_url(db), journal=str(directory))
    try:
        assert ledger.journal.directory.name == "0"
        assert sorted(o["open"]["request_id"] for o in ledger.orphans()) == [
            f"w{w}-open-{i}" for w in (0, 1) for i in (1, 2)]
        ledger.flush()
        assert _count(db) == 2 * 51
        assert not list((directory / "1").glob("segment-*.jsonl"))
    finally:
        ledger.close()

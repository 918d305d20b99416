"""The engine's event log round trip: what the writer records is what benches and tests read."""

from __future__ import annotations

from pathlib import Path

from tokenpace.engine import read_charges
from tokenpace.engine._events import EventLog


def test_refund_cancels_the_latest_charge_of_its_request_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=1)
    log.record(10, "a", "r1", "charge")
    log.record(20, "a", "r1", "charge")
    log.record(25, "b", "r2", "charge")
    log.record(30, "a", "r1", "refund")  # the step that charged 20 was cancelled
    log.record(40, "a", "r1", "charge")
    log.record(50, "b", "r3", "refund")  # nothing charged: nothing to cancel
    log.close()
    assert read_charges(path) == {("a", "r1"): [10, 40], ("b", "r2"): [25]}
    assert read_charges(path, {"b"}) == {("b", "r2"): [25]}
    assert '"dp_rank":1' in path.read_text()


def test_a_log_not_yet_written_reads_empty(tmp_path: Path) -> None:
    assert read_charges(tmp_path / "missing.jsonl") == {}

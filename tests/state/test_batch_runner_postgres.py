"""The batch runner against a Postgres batch store that stops and comes back: the
runner, the ``BatchHost`` and the helpers of tests/unit/test_batch_runner.py, with a
throwaway PostgreSQL server (``tests._postgres``) in place of the SQLite file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tokenpace.gateway.batch._runner as runner_module
from tests.unit.test_batch_runner import Host, add_batch, drive, fast_runner, ids, until
from tokenpace.gateway.batch import BatchRecord, BatchRunner, BatchStore, Line

FIXTURES = (fast_runner,)  # autouse here too: imported so pytest finds it in this module

pytestmark = pytest.mark.postgres


def test_an_outage_while_results_wait_runs_no_line_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Postgres store stops while lines are in flight, with the input stored in many
    parts (each window reads the store): the results wait in memory, the runner reads
    no further meanwhile (a read would fail and lose them), and once the server is back
    the batch completes with every line run exactly once."""
    import tokenpace.gateway.batch._store as store_module
    from tests._postgres import PostgresServer

    monkeypatch.setattr(store_module, "PART_BYTES", 64)
    monkeypatch.setattr(runner_module, "WINDOW_LINES", 2)
    server = PostgresServer().start()
    try:
        store = BatchStore(server.url)
        batch = add_batch(store, ids(*(f"r{i}" for i in range(8))))
        gate = asyncio.Event()
        host = Host()
        script = host.script

        async def held(b: BatchRecord, line: Line, on_slot: Callable[[], None]) -> Any:
            host.runs.append(line.number)
            on_slot()
            await gate.wait()
            return script(line, 1)

        host.run_line = held  # type: ignore[method-assign]

        async def outage(runner: BatchRunner) -> None:
            await until(lambda: len(host.runs) == 2)
            await asyncio.to_thread(server.stop)
            gate.set()
            await asyncio.sleep(1.0)  # the writes fail and are tried again
            assert len(host.runs) <= 4
            await asyncio.to_thread(server.start)

        ended = asyncio.run(drive(store, host, batch.id, concurrency=2, timeout=30.0,
                                  during=outage))
        assert ended.status == "completed"
        assert sorted(host.runs) == list(range(1, 9)), host.runs
        store.close()
    finally:
        server.remove()

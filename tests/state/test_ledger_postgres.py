"""The usage ledger against a real, throwaway Postgres server.

The server is ``tests._postgres.PostgresServer``: ``initdb`` in a temporary directory, a
free loopback port, trust authentication; a machine without the Postgres binaries or
psycopg skips the module with the reason, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tokenpace.gateway.ledger import LedgerError, open_ledger
from tokenpace.gateway.ledger._postgres import PostgresBackend, _session_options
from tokenpace.gateway.ledger._schema import record_row

from tests._postgres import free_port, psycopg

from tests.unit.test_ledger import (
    OLD_REQUESTS_TABLE,
    T0,
    check_a_ledger_without_application_is_migrated,
    check_a_ledger_without_batch_id_is_migrated,
    check_a_ledger_without_cached_tokens_is_migrated,
    check_a_ledger_without_estimated_is_migrated,
    check_an_old_ledger_is_migrated,
    check_budgets_survive_restart,
    check_dirty_rows_are_written_clean,
    check_estimated_rows_are_counted,
    check_rewritten_rows_are_recorded_once,
    check_round_trip,
    check_unserved_prompt_tokens_are_a_separate_total,
    check_usage_by_application,
    check_usage_totals,
    record,
)


def test_round_trip_keeps_every_field(pg_url: str) -> None:
    check_round_trip(pg_url)


def test_postgres_scheme_alias(pg_url: str) -> None:
    check_round_trip(pg_url.replace("postgresql://", "postgres://", 1))


def test_budgets_upsert_and_survive_a_restart(pg_url: str) -> None:
    check_budgets_survive_restart(pg_url)


def test_usage_totals_by_tenant_model_lane_and_since(pg_url: str) -> None:
    check_usage_totals(pg_url)


def test_schema_types_and_idempotent_creation(pg_url: str) -> None:
    open_ledger(pg_url).close()
    open_ledger(pg_url).close()
    with psycopg.connect(pg_url) as conn:
        types = dict(conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = 'requests'"
        ).fetchall())
        indexes = {n for (n,) in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'requests'"
        )}
    assert types["prompt_tokens"] == "bigint"
    assert types["ended_at"] == "double precision"
    assert types["request_id"] == "text"
    assert types["application"] == "text"
    assert types["cached_prompt_tokens"] == "bigint"
    assert {"requests_ended_at", "requests_tenant"} <= indexes


def test_lost_connection_loses_no_rows(pg_url: str, postgres_server: str) -> None:
    """A broken connection (server restart, network cut) fails one flush; the next
    reconnects and writes the queued rows exactly once."""
    ledger = open_ledger(pg_url, flush_interval_s=60)
    try:
        ledger.record(record(0))
        ledger.flush()
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (pg_url.rsplit("/", 1)[1],),
            )
        for i in range(1, 4):
            ledger.record(record(i))
        try:
            ledger.flush()
        except LedgerError:
            ledger.flush()  # reconnects
        assert ledger.rows() == [record(i) for i in range(4)]
    finally:
        ledger.close()


def test_unreachable_server_is_a_ledger_error(postgres_server: str) -> None:
    url = f"postgresql://gw:s3cret@127.0.0.1:{free_port()}/usage?connect_timeout=5"
    with pytest.raises(LedgerError, match="cannot open Postgres ledger") as info:
        open_ledger(url)
    assert "s3cret" not in str(info.value)


def test_many_records_in_batches(pg_url: str) -> None:
    ledger = open_ledger(pg_url, flush_interval_s=0.01, max_batch=200)
    recs = [record(i) for i in range(2000)]
    for rec in recs:
        ledger.record(rec)
    ledger.close()
    reader = open_ledger(pg_url)
    try:
        assert reader.rows() == recs
        assert reader.rows(since=T0 + 1990) == recs[1990:]
    finally:
        reader.close()


def test_rewritten_rows_are_recorded_once(pg_url: str) -> None:
    check_rewritten_rows_are_recorded_once(pg_url)


def test_unserved_prompt_tokens_are_a_separate_total(pg_url: str) -> None:
    check_unserved_prompt_tokens_are_a_separate_total(pg_url)


def test_an_old_ledger_is_migrated(pg_url: str) -> None:
    def execute(sql: str) -> None:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql)

    check_an_old_ledger_is_migrated(pg_url, execute, "BIGINT", "DOUBLE PRECISION")


def test_usage_by_application_keeps_tenants_apart(pg_url: str) -> None:
    check_usage_by_application(pg_url)


def test_a_ledger_without_application_is_migrated(pg_url: str) -> None:
    def execute(sql: str) -> None:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql)

    check_a_ledger_without_application_is_migrated(pg_url, execute, "BIGINT", "DOUBLE PRECISION")


def test_a_ledger_without_cached_tokens_is_migrated(pg_url: str) -> None:
    def execute(sql: str) -> None:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql)

    check_a_ledger_without_cached_tokens_is_migrated(pg_url, execute, "BIGINT",
                                                     "DOUBLE PRECISION")


def test_a_ledger_without_batch_id_is_migrated(pg_url: str) -> None:
    def execute(sql: str) -> None:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql)

    check_a_ledger_without_batch_id_is_migrated(pg_url, execute, "BIGINT", "DOUBLE PRECISION")


def test_a_ledger_without_estimated_is_migrated(pg_url: str) -> None:
    def execute(sql: str) -> None:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql)

    check_a_ledger_without_estimated_is_migrated(pg_url, execute, "BIGINT", "DOUBLE PRECISION")


def _columns(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_name = 'requests' "
            "ORDER BY ordinal_position").fetchall()


def test_a_migrated_ledger_has_the_columns_of_a_new_one(pg_url: str, postgres_server: str) -> None:
    """The oldest ledger, migrated, has the very columns (order, type, NOT NULL, default)
    of one created now."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(OLD_REQUESTS_TABLE.format(integer="BIGINT", real="DOUBLE PRECISION"))
    open_ledger(pg_url).close()
    fresh = f"ledger_{os.getpid()}_fresh"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {fresh}")
    try:
        fresh_url = postgres_server.rsplit("/", 1)[0] + f"/{fresh}"
        open_ledger(fresh_url).close()
        assert _columns(pg_url) == _columns(fresh_url)
        assert ("estimated", "bigint", "NO", "0") in _columns(fresh_url)
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {fresh} WITH (FORCE)")


def test_estimated_rows_are_counted(pg_url: str) -> None:
    check_estimated_rows_are_counted(pg_url)


def test_dirty_rows_are_written_clean(pg_url: str) -> None:
    """NUL (which Postgres text refuses), lone surrogates (which psycopg cannot encode),
    8 MiB strings and NaN reach the server as a clean row, and so do the rows around."""
    check_dirty_rows_are_written_clean(pg_url)


def test_sessions_carry_time_limits_unless_the_url_sets_them(pg_url: str) -> None:
    """The ledger's sessions run with a statement, lock and idle-in-transaction timeout
    and TCP keepalives; a limit the URL's options set is the URL's."""
    def settings(backend: PostgresBackend) -> dict[str, str]:
        conn = backend._connection()  # the session the writes use, outside a read
        names = ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")
        return {n: conn.execute(f"SHOW {n}").fetchone()[0] for n in names}

    backend = PostgresBackend(pg_url)
    try:
        assert settings(backend) == {"statement_timeout": "10s", "lock_timeout": "5s",
                                     "idle_in_transaction_session_timeout": "1min"}
        params = backend._connection().info.get_parameters()
        assert (params["keepalives"], params["keepalives_idle"]) == ("1", "30")
        # A read gets the longer bound, for its own transaction only.
        assert backend.query("SHOW statement_timeout") == [("5min",)]
        assert settings(backend)["statement_timeout"] == "10s"
    finally:
        backend.close()
    own = PostgresBackend(pg_url + "?options=-c%20statement_timeout%3D1234&keepalives_idle=7")
    try:
        assert settings(own)["statement_timeout"] == "1234ms"
        assert settings(own)["lock_timeout"] == "5s"
        assert own.query("SHOW statement_timeout") == [("1234ms",)]
        assert own._connection().info.get_parameters()["keepalives_idle"] == "7"
    finally:
        own.close()


def test_options_keep_the_settings_the_url_gives() -> None:
    """Ours first and only those the URL's options do not name, in either spelling."""
    limits = {"statement_timeout": 10.0, "lock_timeout": 0.25}
    assert _session_options("", limits) == "-c statement_timeout=10000 -c lock_timeout=250"
    assert _session_options("--statement-timeout=1s -c search_path=x", limits) == \
        "-c lock_timeout=250 --statement-timeout=1s -c search_path=x"
    assert _session_options("-c lock_timeout=0 -c statement_timeout=0", limits) == \
        "-c lock_timeout=0 -c statement_timeout=0"


def test_a_held_lock_fails_the_write_at_lock_timeout(pg_url: str) -> None:
    """The server's own bound: a write waiting for a lock fails after lock_timeout, on a
    connection that stays usable."""
    backend = PostgresBackend(pg_url, lock_timeout_s=0.3)
    try:
        with psycopg.connect(pg_url) as holder:  # a transaction until the block ends
            holder.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                backend.write([record_row(record(0))], [])
            assert time.monotonic() - started < 0.3 + 2.0
        pid = backend.query("SELECT pg_backend_pid()")
        backend.write([record_row(record(0))], [])
        assert backend.query("SELECT pg_backend_pid()") == pid  # the same session
    finally:
        backend.close()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _children(parent: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _parent(int(entry)) == parent:
                    pids.append(int(entry))
            except OSError:
                pass  # gone meanwhile
    return pids


def test_a_stopped_server_fails_a_write_within_its_bound(pg_url: str) -> None:
    """A server that stops answering (SIGSTOP: the kernel still acknowledges, so no TCP
    timeout fires, and the server enforces none of its own) fails the write at its client
    bound, statement timeout + margin (1 s here), within 2 s more on a loaded machine;
    once the server runs again the next write goes through on a new connection, the
    rows of the failed one exactly once."""
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc to find the server's processes")
    backend = PostgresBackend(pg_url, statement_timeout_s=0.5, margin_s=0.5)
    try:
        backend.write([record_row(record(0))], [])
        (before,), = backend.query("SELECT pg_backend_pid()")
        postmaster = _parent(before)
        stopped: list[int] = []
        try:
            os.kill(postmaster, signal.SIGSTOP)  # first, so it starts no new children
            stopped.append(postmaster)
            for pid in _children(postmaster):  # the backend serving us among them
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            assert before in stopped
            started = time.monotonic()
            with pytest.raises((LedgerError, psycopg.Error), match="no answer from Postgres"):
                backend.write([record_row(record(1)), record_row(record(2))], [])
            took = time.monotonic() - started
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert 0.9 < took < 1.0 + 2.0
        backend.write([record_row(record(i)) for i in (1, 2, 3)], [])  # the writer's retry
        (after,), = backend.query("SELECT pg_backend_pid()")
        assert after != before
    finally:
        backend.close()
    reader = open_ledger(pg_url)
    try:
        assert reader.rows() == [record(i) for i in range(4)]
    finally:
        reader.close()


def test_the_stores_beside_the_ledger_connect_bounded_and_again_when_broken(
        pg_url: str) -> None:
    """``connect_postgres`` (the batch store's and the admin registry's sessions): time
    limits and keepalives unless the URL sets its own; ``usable`` keeps a good connection
    and replaces a closed one."""
    import psycopg

    from tokenpace.gateway.ledger import connect_postgres, usable

    def show(conn: Any, name: str) -> str:
        return conn.execute(f"SHOW {name}").fetchone()[0]

    conn = connect_postgres(psycopg, pg_url, 2500)
    try:
        assert [show(conn, n) for n in ("statement_timeout", "lock_timeout",
                                        "idle_in_transaction_session_timeout")] == ["2500ms"] * 3
        params = conn.info.get_parameters()
        assert (params["keepalives"], params["keepalives_idle"], params["connect_timeout"]) \
            == ("1", "30", "10")
        assert usable(conn, lambda: pytest.fail("a good connection is kept")) is conn
    finally:
        conn.close()
    again = usable(conn, lambda: connect_postgres(psycopg, pg_url, 2500))
    try:
        assert again is not conn and show(again, "statement_timeout") == "2500ms"
    finally:
        again.close()
    own = connect_postgres(
        psycopg, pg_url + "?options=-c%20statement_timeout%3D1234&keepalives_idle=7", 2500)
    try:
        assert show(own, "statement_timeout") == "1234ms" and show(own, "lock_timeout") == "2500ms"
        assert own.info.get_parameters()["keepalives_idle"] == "7"
    finally:
        own.close()

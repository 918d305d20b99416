"""The ledger against the engines' books (``gateway.reconcile``), in process: the pure
comparison, the book reader and the periodic check over a mock transport."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tokenpace.gateway import metrics
from tokenpace.gateway.ledger import LedgerError, UsageRecord
from tokenpace.gateway.reconcile import (
    DIFFERS,
    ESTIMATED,
    UNRECORDED,
    EngineEntry,
    Reconciler,
    compare,
    gateway_id,
    group,
    parse_grace,
    read_book,
    tenant_of_user,
)

G1, G2, G3 = (f"tpg-{c * 32}" for c in "abc")
NOW = 1_000_000.0


def entry(request_id: str, output: int, ended_at: float = NOW - 100, user: str = "team-a",
          engine: str = "http://e1") -> EngineEntry:
    return EngineEntry(engine, request_id, user, 7, output, ended_at)


def row(request_id: str, completion: int, tenant: str = "team-a",
        estimated: bool = False) -> UsageRecord:
    return UsageRecord(request_id, tenant, "m", "default", 7, completion, 1.0, None, None,
                       1.0, "stop", NOW - 101, NOW - 100, estimated=estimated)


def run(entries: list[EngineEntry], rows: list[UsageRecord], grace_s: float = 30.0,
        hold_s: float = 630.0) -> Any:
    requests, _ = group(entries)
    return compare(requests, {r.request_id: r for r in rows}, now=NOW, grace_s=grace_s,
                   hold_s=hold_s, tenant_of=of_tenants)


def of_tenants(user: str) -> str:
    return tenant_of_user(user, {"team-a", "team-b"}.__contains__)


@pytest.mark.parametrize("engine_id", [
    f"chatcmpl-{G1}", f"cmpl-{G1}-3", f"resp_{G1}_2", f"1_chatcmpl-{G1}", f"0_cmpl-{G1}-0"])
def test_every_engine_id_shape_names_its_gateway_request(engine_id: str) -> None:
    assert gateway_id(engine_id) == G1


def test_engine_requests_are_summed_per_gateway_request() -> None:
    requests, other = group([entry(f"0_chatcmpl-{G1}", 4), entry(f"1_chatcmpl-{G1}", 6),
                             entry(f"cmpl-{G2}-0", 5), entry("chatcmpl-direct-1234", 9)])
    assert other == 1
    assert requests[G1].output_tokens == 10 and not requests[G1].alone
    assert requests[G2].output_tokens == 5


def test_matching_rows_are_no_drift() -> None:
    result = run([entry(f"chatcmpl-{G1}", 5), entry(f"0_cmpl-{G2}-0", 3),
                  entry(f"1_cmpl-{G2}-0", 4)], [row(G1, 5), row(G2, 7)])
    figures = result.tenants["team-a"]
    assert (figures.requests, figures.engine_tokens, figures.ledger_tokens, figures.drift) == (
        2, 12, 12, 0)
    assert not result.drifted and result.discrepancies == [] and result.pending == []


def test_a_missing_row_is_unrecorded_under_the_users_tenant() -> None:
    result = run([entry(f"chatcmpl-{G1}", 5, user="team-b"),
                  entry(f"chatcmpl-{G2}", 8, user="stranger")], [])
    [lost_b] = [d for d in result.discrepancies if d.request_id == G1]
    assert (lost_b.tenant, lost_b.kind, lost_b.engine_tokens, lost_b.ledger_tokens) == (
        "team-b", UNRECORDED, 5, None)
    b, none = result.tenants["team-b"], result.tenants[""]  # an unknown user: ""
    assert (b.unrecorded_requests, b.unrecorded_tokens, b.drift) == (1, 5, -5)
    assert (none.unrecorded_requests, none.unrecorded_tokens) == (1, 8)
    assert result.drifted


def test_rows_that_differ_count_both_ways_and_estimates_are_listed() -> None:
    result = run([entry(f"chatcmpl-{G1}", 5), entry(f"chatcmpl-{G2}", 5),
                  entry(f"chatcmpl-{G3}", 5)],
                 [row(G1, 2), row(G2, 9, estimated=True), row(G3, 5, estimated=True)])
    a = result.tenants["team-a"]
    assert (a.unrecorded_tokens, a.overcharged_tokens, a.differing_rows, a.estimated_rows,
            a.drift) == (3, 4, 2, 2, 1)
    kinds = {d.request_id: (d.kind, d.estimated) for d in result.discrepancies}
    assert kinds == {G1: (DIFFERS, False), G2: (DIFFERS, True), G3: (ESTIMATED, True)}


def test_a_row_is_the_tenant_not_the_user() -> None:
    result = run([entry(f"chatcmpl-{G1}", 5, user="team-a")], [row(G1, 5, tenant="team-b")])
    assert list(result.tenants) == ["team-b"]


def test_requests_within_the_grace_wait() -> None:
    result = run([entry(f"chatcmpl-{G1}", 5, ended_at=NOW - 10),
                  entry(f"chatcmpl-{G2}", 5, ended_at=NOW - 10)], [row(G1, 5)])
    assert sorted(result.pending) == [G1, G2] and result.tenants == {}


def test_a_rowless_request_that_may_have_more_engine_requests_waits_for_request_timeout() -> None:
    """``cmpl-X-0`` alone: more prompts (or choices, or turns) may still be running, so
    no row yet is no proof; past ``hold_s`` it is. ``chatcmpl-X`` has no siblings."""
    entries = [entry(f"cmpl-{G1}-0", 5), entry(f"0_chatcmpl-{G2}", 5),
               entry(f"resp_{G3}_0", 5)]
    assert sorted(run(entries, [], hold_s=600).pending) == [G1, G2, G3]
    assert sorted(d.request_id for d in run(entries, [], hold_s=60).discrepancies) == [G1, G2, G3]
    assert run([entry(f"chatcmpl-{G1}", 5)], [], hold_s=600).pending == []


def test_a_pacing_user_of_an_application_is_its_tenant() -> None:
    assert tenant_of_user("team-a\x1fbot", {"team-a"}.__contains__) == "team-a"
    assert tenant_of_user("team-z", {"team-a"}.__contains__) == ""


@pytest.mark.parametrize("text,seconds", [("30s", 30.0), ("2m", 120.0), ("0", 0.0),
                                          ("500ms", 0.5), ("1.5", 1.5)])
def test_grace_durations(text: str, seconds: float) -> None:
    assert parse_grace(text) == seconds


def test_a_bad_grace_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_grace("soon")


# -- the book reader and the periodic check, over a mock transport ---------------------


class Book:
    """An engine's ``/tokenpace/v1/ended`` in memory: one book, entries numbered from 0,
    the first ``forgotten`` no longer kept."""

    def __init__(self, book: str = "b1") -> None:
        self.book = book
        self.entries: list[dict[str, Any]] = []
        self.forgotten = 0
        self.calls: list[dict[str, str]] = []
        self.status = 200

    def add(self, request_id: str, output: int, ended_at: float, user: str = "team-a") -> None:
        self.entries.append({"book": self.book, "seq": len(self.entries),
                             "request_id": request_id, "user": user, "prompt_tokens": 3,
                             "output_tokens": output, "ended_at": ended_at})

    def handle(self, request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        self.calls.append(params)
        if self.status != 200:
            return httpx.Response(self.status)
        cursor = dict(p.split(":") for p in params["after"].split(",")) if "after" in params else {}
        after = max(int(cursor.get(self.book, -1)), self.forgotten - 1)
        page = self.entries[after + 1:after + 1 + int(params["limit"])]
        last = page[-1]["seq"] if page else after
        return httpx.Response(200, json={"requests": page, "next": f"{self.book}:{last}",
                                         "oldest": {self.book: self.forgotten}})


def counted(name: str, tenant: str) -> float:
    value = metrics.REGISTRY.get_sample_value(f"tokenpace_gateway_ledger_{name}_total",
                                              {"tenant": tenant})
    return value or 0.0


def client(book: Book) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://e1", transport=httpx.MockTransport(book.handle))


def test_the_reader_pages_and_says_what_it_could_not_see() -> None:
    book = Book()
    for i in range(5):
        book.add(f"chatcmpl-{G1[:-1]}{i}", i, NOW)

    async def go() -> None:
        first = await read_book(client(book), "http://e1", None, page=2)
        assert [e.output_tokens for e in first.entries] == [0, 1, 2, 3, 4]
        assert first.cursor == {"b1": 4} and first.complete and first.problem is None
        assert len(book.calls) == 3  # pages of 2, 2 and 1
        for i in range(5, 9):
            book.add(f"chatcmpl-{G1[:-1]}{i}", i, NOW)
        book.forgotten = 7  # 5 and 6 forgotten before they were read
        again = await read_book(client(book), "http://e1", first.cursor, page=2, max_pages=1)
        assert again.forgotten == 2 and [e.output_tokens for e in again.entries] == [7, 8]
        book.book = "b2"  # the engine restarted: a new book
        restarted = await read_book(client(book), "http://e1", again.cursor)
        assert restarted.gone == 1
        book.status = 404
        plain = await read_book(client(book), "http://e1", None)
        assert plain.problem is not None and "not tokenpace" in plain.problem

    asyncio.run(go())


def test_the_periodic_check_compares_each_request_once_when_due() -> None:
    """Read twice: a request within the grace waits for the next check, one compared is
    not compared again, a missing row is counted in the metrics under its tenant."""
    book = Book()
    clock = [NOW]
    book.add(f"chatcmpl-{G1}", 5, NOW - 60, user="team-a")
    book.add(f"chatcmpl-{G2}", 6, NOW - 1, user="team-b")
    rows = {G1: row(G1, 5)}
    reconciler = Reconciler(grace_s=30, hold_s=630, since=NOW - 3600, clock=lambda: clock[0],
                            tenant_of=of_tenants)
    before = counted("unrecorded_requests", "team-b")
    tokens_before = counted("unrecorded_tokens", "team-b")

    async def go() -> None:
        e1 = client(book)
        first = await reconciler.check({"http://e1": e1},
                                       lambda ids: {i: rows[i] for i in ids if i in rows})
        assert first.tenants["team-a"].requests == 1 and first.pending == []
        assert reconciler.pending == 1  # G2: within the grace, not even read from the ledger
        clock[0] += 31
        second = await reconciler.check({"http://e1": e1}, lambda ids: {})
        assert list(second.tenants) == ["team-b"]
        assert second.tenants["team-b"].unrecorded_requests == 1
        assert reconciler.pending == 0
        assert book.calls[-1]["after"] == "b1:1"

    asyncio.run(go())
    assert counted("unrecorded_requests", "team-b") == before + 1
    assert counted("unrecorded_tokens", "team-b") == tokens_before + 6
    assert counted("unrecorded_requests", "team-a") == 0


def test_the_periodic_check_waits_while_the_ledger_is_down() -> None:
    book = Book()
    book.add(f"chatcmpl-{G1}", 5, NOW - 60)
    reconciler = Reconciler(grace_s=30, hold_s=630, since=0.0, clock=lambda: NOW,
                            tenant_of=lambda u: u)

    def down(ids: list[str]) -> dict[str, UsageRecord]:
        raise LedgerError("database down")

    async def go() -> None:
        result = await reconciler.check({"http://e1": client(book)}, down)
        assert result.pending == [G1] and reconciler.pending == 1
        result = await reconciler.check({"http://e1": client(book)}, lambda ids: {G1: row(G1, 5)})
        assert result.tenants["team-a"].requests == 1 and reconciler.pending == 0

    asyncio.run(go())


def test_requests_ended_before_the_check_began_are_not_compared() -> None:
    book = Book()
    book.add(f"chatcmpl-{G1}", 5, NOW - 7200)
    book.add(f"chatcmpl-{G2}", 5, NOW - 60)
    reconciler = Reconciler(grace_s=30, hold_s=630, since=NOW - 3600, clock=lambda: NOW,
                            tenant_of=lambda u: u)
    result = asyncio.run(reconciler.check({"http://e1": client(book)},
                                          lambda ids: {G2: row(G2, 5)}))
    assert result.tenants["team-a"].requests == 1 and result.pending == []

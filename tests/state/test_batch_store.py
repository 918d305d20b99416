"""The batch store on a real database: SQLite in a temporary file, and the same tests on
a real throwaway Postgres server (the ledger tests' fixture) where one can be started.

The store is what makes a batch survive a killed gateway and what keeps each line's
result exactly once, so the tests check what is durable (a new store on the same
database sees everything), what is conditional (a move only from the status read, a
result only once per line, a finish only from the batch's status) and what each tenant
can see (nothing of another's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tokenpace.gateway.batch import (
    BadMove,
    BatchRecord,
    BatchStore,
    LineResult,
    Usage,
    batch_store_url,
    new_id,
    result_line,
)

NOW = 1_795_000_000


@pytest.fixture
def store(store_url: str) -> Iterator[BatchStore]:
    opened = BatchStore(store_url)
    yield opened
    opened.close()


def make_batch(store: BatchStore, *, tenant: str = "acme", status: str = "validating",
               created_at: int = NOW, batch_id: str | None = None,
               input_file_id: str | None = None, **fields: object) -> BatchRecord:
    """A batch (on a fresh input file unless one is named), added to the store."""
    if input_file_id is None:
        input_file_id = store.add_file(tenant, "batch", "in.jsonl", b"{}\n").id
    record = BatchRecord(id=batch_id or new_id("batch_"), tenant=tenant, application="",
                         endpoint="/v1/chat/completions", input_file_id=input_file_id,
                         completion_window="24h", status=status, created_at=created_at,
                         expires_at=created_at + 86_400, **fields)  # type: ignore[arg-type]
    store.add_batch(record)
    return record


def result(number: int, ok: bool = True, *, text: str | None = None, prompt: int = 0,
           cached: int = 0, completion: int = 0) -> LineResult:
    custom_id = f"row-{number}"
    if text is None:
        text = result_line(f"tpg-{number}", custom_id, 200 if ok else 404, {"n": number}, None)
    return LineResult(number, custom_id, ok, text, prompt, cached, completion)


# -- files -------------------------------------------------------------------------------


def test_file_round_trip_and_delete(store: BatchStore) -> None:
    content = b'{"custom_id": "a"}\n' + bytes(range(256))  # any bytes, not only text
    record = store.add_file("acme", "batch", "in.jsonl", content)
    assert record.id.startswith("file-") and len(record.id) == len("file-") + 24
    assert (record.tenant, record.purpose, record.filename, record.bytes) == (
        "acme", "batch", "in.jsonl", len(content))
    assert store.file("acme", record.id) == record
    assert store.file_content("acme", record.id) == content
    assert store.count_files("acme") == 1

    assert store.delete_file("acme", record.id) is True
    assert store.file("acme", record.id) is None
    assert store.file_content("acme", record.id) is None
    assert store.delete_file("acme", record.id) is False
    assert store.count_files("acme") == 0


def test_file_with_a_given_id(store: BatchStore) -> None:
    record = store.add_file("acme", "batch", "x.jsonl", b"x", file_id="file-chosen")
    assert record.id == "file-chosen"
    assert store.file("acme", "file-chosen") == record


def test_another_tenants_file_is_not_found(store: BatchStore) -> None:
    """An id of another tenant's file answers as an unknown one: no read, no delete."""
    record = store.add_file("acme", "batch", "in.jsonl", b"secret")
    assert store.file("globex", record.id) is None
    assert store.file_content("globex", record.id) is None
    assert store.delete_file("globex", record.id) is False
    assert store.file_content("acme", record.id) == b"secret"
    assert store.count_files("globex") == 0
    assert store.files("globex", None, 10, None, False) == ([], False)
    assert store.file_in_use("globex", record.id) is False


def test_files_pages_in_both_orders(store: BatchStore) -> None:
    """OpenAI's cursor pages: ``after`` is the last id of the previous page; paging
    through gives every file once, in one order, and ``has_more`` is false on the last
    page. Files made in one second keep a stable order (insertion order on SQLite)."""
    ids = [store.add_file("acme", "batch", f"f{i}.jsonl", b"x").id for i in range(5)]
    store.add_file("globex", "batch", "other.jsonl", b"x")
    for ascending in (True, False):
        everything, more = store.files("acme", None, 100, None, ascending)
        assert not more
        order = [f.id for f in everything]
        assert sorted(order) == sorted(ids)
        pages: list[list[str]] = []
        flags: list[bool] = []
        after: str | None = None
        while True:
            page, more = store.files("acme", None, 2, after, ascending)
            pages.append([f.id for f in page])
            flags.append(more)
            if not more:
                break
            after = page[-1].id
        assert [len(p) for p in pages] == [2, 2, 1]
        assert flags == [True, True, False]
        assert [i for p in pages for i in p] == order
        if store_is_sqlite(store):
            assert order == (ids if ascending else ids[::-1])
    ascending_order = [f.id for f in store.files("acme", None, 100, None, True)[0]]
    descending_order = [f.id for f in store.files("acme", None, 100, None, False)[0]]
    assert descending_order == ascending_order[::-1]
    # a page that ends exactly at the last file says there is no more
    assert store.files("acme", None, 5, None, True)[1] is False
    assert store.files("acme", None, 4, None, True)[1] is True


def store_is_sqlite(store: BatchStore) -> bool:
    return store.url.startswith("sqlite:")


def test_files_filter_by_purpose(store: BatchStore) -> None:
    uploaded = store.add_file("acme", "batch", "in.jsonl", b"x")
    output = store.add_file("acme", "batch_output", "out.jsonl", b"y")
    assert [f.id for f in store.files("acme", "batch", 10, None, True)[0]] == [uploaded.id]
    assert [f.id for f in store.files("acme", "batch_output", 10, None, True)[0]] == [output.id]
    assert len(store.files("acme", None, 10, None, True)[0]) == 2
    assert store.count_files("acme") == 2


def test_file_in_use_by_an_unfinished_batch(store: BatchStore) -> None:
    """An input file cannot be deleted from under a batch that still reads it; once the
    batch finished it is free again."""
    record = store.add_file("acme", "batch", "in.jsonl", b"{}")
    assert store.file_in_use("acme", record.id) is False
    batch = make_batch(store, input_file_id=record.id)
    assert store.file_in_use("acme", record.id) is True
    store.move(batch.id, "validating", "failed", errors=[])
    assert store.file_in_use("acme", record.id) is False


# -- batches -----------------------------------------------------------------------------


def test_batch_round_trip(store: BatchStore) -> None:
    """Every field comes back as it went in, JSON fields included."""
    record = make_batch(store, total=3, metadata={"job": "nightly", "é": "✓"},
                        errors=[{"code": "x", "message": "m", "param": None, "line": 1}],
                        output_file_id="file-o", error_file_id="file-e",
                        stamps={"in_progress_at": NOW + 1}, model="tiny")
    assert store.batch(record.id) == record
    assert store.batch(record.id, "acme") == record
    assert store.batch(record.id, "globex") is None
    assert store.batch("batch_unknown") is None


def test_batches_pages_newest_first(store: BatchStore) -> None:
    """Newest first by creation time, ties in insertion order (newest first too)."""
    times = [NOW, NOW + 5, NOW + 5, NOW + 9, NOW + 1]
    made = [make_batch(store, created_at=t) for t in times]
    make_batch(store, tenant="globex")
    expected = [made[3].id, made[2].id, made[1].id, made[4].id, made[0].id]
    everything, more = store.batches("acme", 100, None)
    assert [b.id for b in everything] == expected and not more
    first, more = store.batches("acme", 2, None)
    assert [b.id for b in first] == expected[:2] and more
    second, more = store.batches("acme", 2, first[-1].id)
    assert [b.id for b in second] == expected[2:4] and more
    third, more = store.batches("acme", 2, second[-1].id)
    assert [b.id for b in third] == expected[4:] and not more


def test_move_only_from_the_status_read(store: BatchStore) -> None:
    """Two replicas (or a cancel and a finish) race: only the move from the status the
    batch is in applies; the other gets None and changes nothing."""
    batch = make_batch(store)
    moved = store.move(batch.id, "validating", "in_progress", total=4, model="tiny")
    assert moved is not None
    assert (moved.status, moved.total, moved.model) == ("in_progress", 4, "tiny")
    assert moved.stamps["in_progress_at"] > 0
    assert store.move(batch.id, "validating", "cancelling") is None
    assert store.batch(batch.id) == moved
    assert store.move("batch_unknown", "validating", "failed") is None


def test_move_refuses_a_disallowed_step(store: BatchStore) -> None:
    batch = make_batch(store, status="completed")
    with pytest.raises(BadMove):
        store.move(batch.id, "completed", "in_progress")
    with pytest.raises(BadMove):
        store.move(batch.id, "validating", "completed")  # not a step, whatever the status
    assert store.batch(batch.id) == batch


def test_move_sets_stamps_once_and_fields(store: BatchStore) -> None:
    """A stamp records when the batch first entered a status and is never overwritten;
    each move adds its own; ``errors`` is stored as JSON."""
    batch = make_batch(store, stamps={"in_progress_at": 12345})
    moved = store.move(batch.id, "validating", "in_progress")
    assert moved is not None and moved.stamps == {"in_progress_at": 12345}
    cancelling = store.move(batch.id, "in_progress", "cancelling")
    assert cancelling is not None
    assert set(cancelling.stamps) == {"in_progress_at", "cancelling_at"}
    assert cancelling.stamps["in_progress_at"] == 12345

    problems = [{"code": "empty_file", "message": "no requests", "param": None, "line": None}]
    failed = store.move(make_batch(store).id, "validating", "failed", errors=problems)
    assert failed is not None and failed.errors == problems
    assert "failed_at" in failed.stamps


def test_unfinished_and_count_unfinished(store: BatchStore) -> None:
    """The runners' list: every tenant's batches with work left, oldest first."""
    late = make_batch(store, created_at=NOW + 10, status="in_progress")
    early = make_batch(store, tenant="globex", created_at=NOW, status="validating")
    cancelling = make_batch(store, created_at=NOW + 20, status="cancelling")
    finalizing = make_batch(store, created_at=NOW + 30, status="finalizing")
    for status in ("completed", "failed", "expired", "cancelled"):
        make_batch(store, status=status)
    assert [b.id for b in store.unfinished()] == [early.id, late.id, cancelling.id,
                                                  finalizing.id]
    assert store.count_unfinished("acme") == 3
    assert store.count_unfinished("globex") == 1
    assert store.count_unfinished("initech") == 0


def test_unfinished_ties_keep_insertion_order(store: BatchStore) -> None:
    """``created_at`` is whole seconds, so batches made in one second tie; the runners
    must still resume them oldest first (insertion order), whatever their status."""
    made = [make_batch(store, created_at=NOW, status=status).id
            for status in ("in_progress", "validating", "cancelling", "validating")]
    assert [b.id for b in store.unfinished()] == made


# -- results -----------------------------------------------------------------------------


def test_add_result_exactly_once_per_line(store: BatchStore) -> None:
    """Two runs of one line (a hand-over between replicas) both end: the first result
    stays, the second changes nothing, so the output holds the custom_id once."""
    batch = make_batch(store, status="in_progress")
    first = result(1, text="first")
    assert store.add_result(batch.id, first) is True
    assert store.add_result(batch.id, result(1, ok=False, text="second")) is False
    assert store.results(batch.id) == [first]
    assert store.done_lines(batch.id) == {1}
    # the same line number of another batch is another line
    other = make_batch(store, status="in_progress")
    assert store.add_result(other.id, result(1, text="other")) is True
    assert [r.text for r in store.results(batch.id)] == ["first"]


def test_results_in_line_order(store: BatchStore) -> None:
    batch = make_batch(store, status="in_progress")
    for number in (5, 1, 9, 3):
        store.add_result(batch.id, result(number))
    assert [r.number for r in store.results(batch.id)] == [1, 3, 5, 9]
    assert store.done_lines(batch.id) == {1, 3, 5, 9}
    assert store.results("batch_none") == [] and store.done_lines("batch_none") == set()


def test_usage_sums_tokens_and_counts(store: BatchStore) -> None:
    batch = make_batch(store, status="in_progress")
    assert store.usage(batch.id) == Usage()
    store.add_result(batch.id, result(1, prompt=10, cached=4, completion=7))
    store.add_result(batch.id, result(2, prompt=20, cached=0, completion=3))
    store.add_result(batch.id, result(3, ok=False))
    store.add_result(batch.id, result(3, prompt=999, completion=999))  # a duplicate: ignored
    assert store.usage(batch.id) == Usage(requests_completed=2, requests_failed=1,
                                          input_tokens=30, cached_tokens=4, output_tokens=10)


# -- finish ------------------------------------------------------------------------------


def test_finish_writes_files_and_moves(store: BatchStore) -> None:
    """The output and error files appear with the move, in one transaction: a client
    that sees ``completed`` can always download them."""
    batch = make_batch(store, status="finalizing")
    files_before = store.count_files("acme")
    output, errors = b'{"ok": 1}\n{"ok": 2}\n', b'{"err": 3}\n'
    ended = store.finish(batch, "completed", output, errors)
    assert ended is not None and ended.status == "completed"
    assert "completed_at" in ended.stamps
    assert ended.output_file_id and ended.error_file_id
    assert store.file_content("acme", ended.output_file_id) == output
    assert store.file_content("acme", ended.error_file_id) == errors
    out = store.file("acme", ended.output_file_id)
    assert out is not None and out.purpose == "batch_output" and out.bytes == len(output)
    assert out.filename == f"batch_{batch.id}_output.jsonl"
    err = store.file("acme", ended.error_file_id)
    assert err is not None and err.filename == f"batch_{batch.id}_error.jsonl"
    assert store.count_files("acme") == files_before + 2
    assert store.batch(batch.id) == ended


def test_finish_writes_only_files_with_lines(store: BatchStore) -> None:
    batch = make_batch(store, status="finalizing")
    ended = store.finish(batch, "completed", b"line\n", b"")
    assert ended is not None and ended.output_file_id and ended.error_file_id is None
    batch = make_batch(store, status="cancelling")
    before = store.count_files("acme")
    ended = store.finish(batch, "cancelled", b"", b"")
    assert ended is not None and ended.status == "cancelled"
    assert ended.output_file_id is None and ended.error_file_id is None
    assert store.count_files("acme") == before


def test_finish_of_a_batch_moved_meanwhile_does_nothing(store: BatchStore) -> None:
    """A runner finishing from a stale record (the batch was cancelled since it read it)
    writes no file and moves nothing: the cancel wins."""
    batch = make_batch(store, status="in_progress")
    assert store.move(batch.id, "in_progress", "cancelling") is not None
    before = store.count_files("acme")
    assert store.finish(batch, "expired", b"out\n", b"err\n") is None
    current = store.batch(batch.id)
    assert current is not None and current.status == "cancelling"
    assert current.output_file_id is None and current.error_file_id is None
    assert store.count_files("acme") == before


def test_finish_refuses_a_disallowed_step(store: BatchStore) -> None:
    batch = make_batch(store, status="in_progress")
    with pytest.raises(BadMove):
        store.finish(batch, "completed", b"x\n", b"")  # in_progress must finalize first
    before = store.count_files("acme")
    assert store.batch(batch.id) == batch and store.count_files("acme") == before


# -- durability and location -------------------------------------------------------------


def test_a_new_store_on_the_same_database_sees_everything(store_url: str) -> None:
    """A gateway killed and restarted opens the same database and finds every file,
    batch and result (no state is only in memory)."""
    first = BatchStore(store_url)
    record = first.add_file("acme", "batch", "in.jsonl", b"payload")
    batch = make_batch(first, input_file_id=record.id)
    moved = first.move(batch.id, "validating", "in_progress", total=2)
    first.add_result(batch.id, result(1, prompt=5, completion=6))
    first.close()

    second = BatchStore(store_url)  # the schema statements run again: idempotent
    try:
        assert second.file_content("acme", record.id) == b"payload"
        assert second.batch(batch.id) == moved
        assert [b.id for b in second.unfinished()] == [batch.id]
        assert second.results(batch.id) == [result(1, prompt=5, completion=6)]
        assert second.usage(batch.id).output_tokens == 6
        assert second.add_result(batch.id, result(1, text="again")) is False
    finally:
        second.close()


def test_batch_store_url() -> None:
    """The SQLite store sits beside the ledger's file; Postgres shares the ledger's DB."""
    assert batch_store_url("sqlite:////a/b/usage.db") == "sqlite:////a/b/usage.batches.db"
    assert batch_store_url("sqlite:///rel/usage.db") == "sqlite:///rel/usage.batches.db"
    assert batch_store_url("sqlite:////a/b/usage") == "sqlite:////a/b/usage.batches.db"
    pg = "postgresql://gw:pw@db:5432/usage"
    assert batch_store_url(pg) == pg
    assert batch_store_url("postgres://gw@db/usage") == "postgres://gw@db/usage"
    assert batch_store_url("sqlite:///:memory:") == "sqlite:///:memory:"


def test_new_ids_are_random_and_prefixed() -> None:
    ids = {new_id("batch_") for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("batch_") and len(i) == len("batch_") + 24 for i in ids)


def test_store_text_round_trips_json_lines(store: BatchStore) -> None:
    """The result text is stored as it is: the output file is made of these exact bytes."""
    batch = make_batch(store, status="in_progress")
    text = result_line("tpg-1", 'quote " newline \n é', 200, {"x": "✓"}, None)
    store.add_result(batch.id, LineResult(1, "c", True, text))
    [stored] = store.results(batch.id)
    assert stored.text == text
    assert json.loads(stored.text)["custom_id"] == 'quote " newline \n é'


def test_files_written_from_the_results_stream_in_parts_and_pages(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """``finish_from_results``: the output and error files hold the stored results in
    line order (the extra error lines last), byte for byte what joining them gives, cut
    into parts and read in pages (made small here so a few results span several)."""
    import tokenpace.gateway.batch._store as store_module

    monkeypatch.setattr(store_module, "PART_BYTES", 64)
    monkeypatch.setattr(store_module, "RESULTS_PAGE", 3)
    batch = make_batch(store, status="finalizing")
    results = [result(n, ok=n % 3 != 0) for n in (7, 1, 5, 3, 2, 6, 4, 9, 8, 10)]
    for r in results:
        store.add_result(batch.id, r)
    extra = b'{"expired": 11}\n'
    assert store.result_bytes(batch.id) == (
        sum(len(r.text) + 1 for r in results if r.ok),
        sum(len(r.text) + 1 for r in results if not r.ok))
    ended = store.finish_from_results(batch, "completed", extra)
    assert ended is not None and ended.status == "completed"
    in_order = sorted(results, key=lambda r: r.number)
    output = "".join(r.text + "\n" for r in in_order if r.ok).encode()
    errors = "".join(r.text + "\n" for r in in_order if not r.ok).encode() + extra
    assert store.file_content("acme", ended.output_file_id or "") == output
    assert store.file_content("acme", ended.error_file_id or "") == errors
    out = store.file("acme", ended.output_file_id or "")
    assert out is not None and out.bytes == len(output) and len(output) > 3 * 64
    assert out.filename == f"batch_{batch.id}_output.jsonl"
    assert store.finish_from_results(batch, "completed") is None  # moved already

"""What bounds a Batch API upload, in process: the streaming line counter (the same count
as ``count_lines`` for any split, no list of lines), the upload gate's slots and memory,
and the store's bounds checked in the writing transaction (SQLite, and a real Postgres
where one can be started) with files kept in parts.
"""

from __future__ import annotations

import random
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from tokenpace.gateway.batch import (
    BatchRecord,
    BatchStore,
    LineCounter,
    StoreLimit,
    count_lines,
    new_id,
)
from tokenpace.gateway.batch._store import PART_BYTES
from tokenpace.gateway.config import BatchConfig
from tokenpace.gateway.server._upload import UploadGate
from tokenpace.gateway.wire import GatewayError


def test_the_counter_agrees_with_count_lines_for_any_split() -> None:
    rng = random.Random(53)
    alphabet = [b"a", b" ", b"\n", b"\r", b"\t", b"{", b"\x0b", b"\x0c", b"\xff"]
    for _ in range(2000):
        content = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        counter, at = LineCounter(), 0
        while at < len(content):
            step = rng.randint(1, 9)
            counter.feed(content[at:at + step])
            at += step
        assert counter.count == count_lines(content), content


def test_the_counter_holds_no_list_of_lines() -> None:
    """5 MiB of 3-byte lines fed whole: the counter's peak allocation is its one translated
    copy (5 MiB), where a list of the lines would take about 80 MiB."""
    content = b"ab\n" * (5 * 1024 * 1024 // 3)
    tracemalloc.start()
    try:
        counter = LineCounter()
        counter.feed(content)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert counter.count == len(content) // 3
    assert peak < 1.5 * len(content), peak


def test_the_gate_bounds_uploads_per_tenant_in_all_and_in_memory() -> None:
    limits = BatchConfig(max_uploads=2, max_tenant_uploads=1, upload_memory=100,
                         max_file_bytes=100)
    gate = UploadGate()
    with gate.enter("a", limits) as first:
        with pytest.raises(GatewayError) as same:
            with gate.enter("a", limits):
                pass
        assert (same.value.status, same.value.code) == (429, "too_many_uploads")
        assert same.value.headers["retry-after"] == "1"
        first.take(60)
        with gate.enter("b", limits) as second:
            with pytest.raises(GatewayError) as busy:
                with gate.enter("c", limits):
                    pass
            assert (busy.value.status, busy.value.code) == (503, "uploads_busy")
            second.take(40)
            with pytest.raises(GatewayError) as full:
                second.take(1)  # 101 bytes held together
            assert (full.value.status, full.value.code) == (503, "uploads_busy")
        assert gate.held == 60 and gate.reading == 1
    assert gate.held == 0 and gate.reading == 0
    with gate.enter("a", limits) as again:
        again.take(100)


@pytest.fixture
def stores(store_url: str) -> Iterator[list[BatchStore]]:
    """Four stores on one database: four gateway replicas."""
    opened = [BatchStore(store_url) for _ in range(4)]
    yield opened
    for store in opened:
        store.close()


@pytest.mark.parametrize("size", [0, 1, PART_BYTES, PART_BYTES + 1, 2 * PART_BYTES + 7])
def test_a_file_is_kept_in_parts_and_read_back_whole(stores: list[BatchStore],
                                                     size: int) -> None:
    content = bytes(random.Random(size).getrandbits(8) for _ in range(size % 4096)) \
        + b"x" * (size - size % 4096)
    record = stores[0].add_file("acme", "batch", "in.jsonl", bytearray(content))
    found = stores[1].file_parts("acme", record.id)
    assert found is not None
    parts = list(found[1])
    assert all(len(p) <= PART_BYTES for p in parts)
    assert len(parts) == -(-size // PART_BYTES)
    assert b"".join(parts) == content == stores[1].file_content("acme", record.id)
    assert stores[1].file_parts("other", record.id) is None
    assert stores[1].delete_file("acme", record.id)
    assert stores[0].file_content("acme", record.id) is None


def test_a_file_deleted_while_it_is_read_ends_its_read(stores: list[BatchStore]) -> None:
    record = stores[0].add_file("acme", "batch", "in.jsonl", b"x" * (2 * PART_BYTES))
    found = stores[0].file_parts("acme", record.id)
    assert found is not None
    assert len(next(found[1])) == PART_BYTES
    stores[1].delete_file("acme", record.id)
    with pytest.raises(Exception, match="deleted while it was read"):
        next(found[1])


def _race(work: list[threading.Thread]) -> None:
    for thread in work:
        thread.start()
    for thread in work:
        thread.join()


def test_four_replicas_adding_files_at_once_keep_exactly_max_files(
        stores: list[BatchStore]) -> None:
    kept: list[str] = []
    refused: list[StoreLimit] = []
    start = threading.Barrier(16)

    def add(store: BatchStore) -> None:
        start.wait()
        try:
            kept.append(store.add_file("acme", "batch", "in.jsonl", b"{}\n", max_files=5,
                                       max_bytes=10**9).id)
        except StoreLimit as exc:
            refused.append(exc)

    _race([threading.Thread(target=add, args=(stores[i % 4],)) for i in range(16)])
    assert len(kept) == 5 and len(refused) == 11
    assert {exc.key for exc in refused} == {"batch.max_files"}
    assert stores[0].stored("acme") == (5, 15)


def test_stored_bytes_count_outputs_and_refuse_what_would_pass(
        stores: list[BatchStore]) -> None:
    store = stores[0]
    store.add_file("acme", "batch", "in.jsonl", b"x" * 60, max_files=100, max_bytes=100)
    store.add_file("acme", "batch_output", "out.jsonl", b"y" * 30)  # a batch's output
    with pytest.raises(StoreLimit) as over:
        store.add_file("acme", "batch", "in.jsonl", b"x" * 11, max_files=100, max_bytes=100)
    assert (over.value.key, over.value.used) == ("batch.max_stored_bytes", 90)
    store.add_file("acme", "batch", "in.jsonl", b"x" * 10, max_files=100, max_bytes=100)
    store.add_file("globex", "batch", "in.jsonl", b"x" * 100, max_files=100, max_bytes=100)
    batch = BatchRecord(new_id("batch_"), "acme", "", "/v1/chat/completions", "file-x", "24h",
                        "validating", 1, 2)
    with pytest.raises(StoreLimit) as full:  # at the bound: its output would have no room
        store.add_batch(batch, max_unfinished=10, max_bytes=100)
    assert full.value.key == "batch.max_stored_bytes"


def test_four_replicas_creating_batches_at_once_keep_exactly_max_batches(
        stores: list[BatchStore]) -> None:
    made: list[str] = []
    start = threading.Barrier(16)

    def create(store: BatchStore, i: int) -> None:
        batch = BatchRecord(f"batch_{i}", "acme", "", "/v1/chat/completions", "file-x",
                            "24h", "validating", 1, 2)
        start.wait()
        try:
            store.add_batch(batch, max_unfinished=3, max_bytes=10**9)
            made.append(batch.id)
        except StoreLimit:
            pass

    _race([threading.Thread(target=create, args=(stores[i % 4], i)) for i in range(16)])
    assert len(made) == 3 and stores[0].count_unfinished("acme") == 3


def test_a_file_stored_before_parts_is_read_whole(stores: list[BatchStore]) -> None:
    store = stores[0]
    with store._transaction():  # a row as an older gateway wrote it: content inline
        store._execute("INSERT INTO batch_files (id, tenant, purpose, filename, bytes, "
                       "created_at, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       ("file-old", "acme", "batch", "in.jsonl", 3 * PART_BYTES, 1,
                        b"y" * (3 * PART_BYTES)))
    assert stores[1].file_content("acme", "file-old") == b"y" * (3 * PART_BYTES)
    assert stores[1].stored("acme") == (1, 3 * PART_BYTES)
    assert stores[1].delete_file("acme", "file-old")


@pytest.mark.parametrize(("batch", "message"), [
    ({"max_uploads": 0}, "batch.max_uploads: expected an integer >= 1"),
    ({"max_tenant_uploads": -1}, "batch.max_tenant_uploads: expected an integer >= 1"),
    ({"max_stored_bytes": "1GiB"}, "batch.max_stored_bytes: expected an integer >= 1"),
    ({"max_file_bytes": 2048, "upload_memory": 1024}, "batch.upload_memory: 1024 is less"),
])
def test_the_upload_keys_are_checked(batch: dict[str, object], message: str) -> None:
    from tokenpace.gateway import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config({"engines": ["http://e:1"], "ledger": "sqlite:///u.db", "batch": batch,
                      "tenants": [{"id": "a", "api_keys": ["sk-a"]}]})
    defaults = parse_config({"engines": ["http://e:1"], "ledger": "sqlite:///u.db",
                             "tenants": [{"id": "a", "api_keys": ["sk-a"]}]}).batch
    assert (defaults.max_uploads, defaults.max_tenant_uploads, defaults.upload_memory,
            defaults.max_stored_bytes) == (4, 1, 256 * 1024 * 1024, 1024 ** 3)


class _CountingLock:
    """The store's lock, counting its acquisitions (each a separate hold)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds = 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.holds += 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_large_file_is_written_a_part_per_hold_and_never_half_seen(
        stores: list[BatchStore]) -> None:
    """Five parts: the lock taken once per part and once for the row (other tenants' calls
    pass between); a write refused at its row leaves no part behind; parts of a write that
    never got its row (a gateway killed) are gone once a store opens."""
    store = stores[0]
    lock = _CountingLock()
    store._lock = lock  # type: ignore[assignment]
    content = b"q" * (4 * PART_BYTES + 5)
    record = store.add_file("acme", "batch", "in.jsonl", content, max_files=2,
                            max_bytes=10**9)
    assert lock.holds >= 6
    assert stores[1].file_content("acme", record.id) == content
    store.add_file("acme", "batch", "small.jsonl", b"x")
    with pytest.raises(StoreLimit):
        store.add_file("acme", "batch", "in.jsonl", content, max_files=2, max_bytes=10**9)
    parts = store._rows("SELECT COUNT(*) FROM batch_file_parts")[0][0]
    assert parts == 6  # the first file's five and the small one's
    with store._transaction():  # a write killed before its row
        store._insert_part("file-cut", 0, b"y" * PART_BYTES)
    assert stores[1].file_content("acme", "file-cut") is None
    BatchStore(store.url).close()
    assert store._rows("SELECT COUNT(*) FROM batch_file_parts WHERE file_id = ?",
                       ("file-cut",))[0][0] == 0
    assert stores[1].file_content("acme", record.id) == content

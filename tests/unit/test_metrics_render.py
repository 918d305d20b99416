"""A scrape's page is built on the event loop in slices: the same page as one
``generate_latest`` of everything, every family once and in one piece, and the loop gets a
turn between two slices, so requests in flight wait one slice, not the page. Counts of
turns and samples, not times."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenpace.gateway import metrics

TENANTS = [f"render-{i}" for i in range(300)]


@pytest.fixture
def busy_tenants() -> Iterator[list[str]]:
    """300 tenants with series in every kind of family (counters, gauges, histograms)."""
    for i, tenant in enumerate(TENANTS):
        metrics.child(metrics.REQUESTS, tenant, "default", "stop").inc()
        metrics.child(metrics.PROMPT_TOKENS, tenant, "default").inc(10 + i)
        metrics.child(metrics.INFLIGHT, tenant).set(i % 3)
        metrics.child(metrics.E2E_SECONDS, tenant).observe(0.01 * (i % 50))
        metrics.child(metrics.TTFT_SECONDS, tenant).observe(0.002 * (i % 7))
    metrics.child(metrics.MODEL_REQUESTS, "tiny", "stop").inc()  # no tenant label
    yield TENANTS
    for tenant in TENANTS:
        metrics.forget_tenant(tenant)


def lines(page: bytes) -> list[str]:
    """The page's lines, sorted; the process's own gauges left out (open file descriptors
    and CPU time change between two renders)."""
    return sorted(line for line in page.decode().splitlines()
                  if line and not line.startswith("process_"))


def test_the_sliced_page_is_the_whole_page(busy_tenants: list[str]) -> None:
    sliced = asyncio.run(metrics.render())
    assert lines(sliced) == lines(metrics.exposition())
    families = [f.name for f in text_string_to_metric_families(sliced.decode())]
    assert len(families) == len(set(families))  # each family once, in one piece
    text = sliced.decode()
    assert text.count("# HELP tokenpace_gateway_request_seconds ") == 1
    assert 'tokenpace_gateway_request_seconds_bucket{le="0.1",tenant="render-7"} 1.0' in text


def test_the_loop_gets_a_turn_between_slices(busy_tenants: list[str]) -> None:
    # This test's own series (other tests may leave more on the page, which can only add
    # slices): each is formatted in a slice of tenant series.
    samples = sum(1 for f in text_string_to_metric_families(metrics.exposition().decode())
                  for s in f.samples if s.labels.get("tenant", "").startswith("render-"))

    async def body() -> int:
        turns = 0
        done = False

        async def other_work() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        start = turns
        await metrics.render()
        done = True
        await task
        return turns - start

    turns = asyncio.run(body())
    # At least one turn per SLICE_SAMPLES samples of tenant series.
    assert samples > 10 * metrics.SLICE_SAMPLES
    assert turns >= samples // metrics.SLICE_SAMPLES - 2, (turns, samples)


def test_overlapping_gc_pauses_end_with_the_last() -> None:
    """A scrape (a task) and a reload (a thread) may pause the collector at once: it comes
    back when the last of them ends, and stays off if it was off before."""
    import gc

    from tokenpace.gateway.config import paused_gc

    assert gc.isenabled()
    first, second = paused_gc(), paused_gc()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second still runs
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # it was off: left off
    finally:
        gc.enable()

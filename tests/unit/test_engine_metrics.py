"""The engine's pacing series on its /metrics, in process: the middleware's page
(vLLM's, then ours), the merge over data-parallel ranks, the ``name[]`` filter and the
one-second reading shared by every scrape. The real engine is in tests/e2e/test_serve.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenpace.engine import _metrics
from tokenpace.engine._metrics import exposition, handle_metrics, merge

RANK0 = {"pacing": {"users": {"a": [10, 1, 3, 0.5, 20.0], 'q"u\\o\nte': [1, 0, 0, 0.0, None]},
                    "idle_waits": 2, "idle_wait_seconds": 0.25, "folded_users": 0}}
RANK1 = {"pacing": {"users": {"a": [5, 0, 1, 0.25, 20.0], "b": [7, 2, 0, 0.0, 100.0]},
                    "idle_waits": 1, "idle_wait_seconds": 0.5, "folded_users": 3}}
VLLM_PAGE = b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n" \
            b'vllm:num_requests_running{model_name="tiny"} 2.0\n'


def samples(page: bytes) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("user", "")): s.value
            for f in text_string_to_metric_families(page.decode()) for s in f.samples}


def test_ranks_are_summed_per_user_and_the_page_parses() -> None:
    merged = merge([RANK0, RANK1, {"pacing": None}])
    assert merged is not None
    got = samples(exposition(merged))
    assert got[("tokenpace_engine_output_tokens_total", "a")] == 15
    assert got[("tokenpace_engine_throttled_seconds_total", "a")] == 0.75
    assert got[("tokenpace_engine_rate_tokens_per_second", "b")] == 100
    assert got[("tokenpace_engine_output_tokens_total", 'q"u\\o\nte')] == 1  # escaped labels
    assert ("tokenpace_engine_rate_tokens_per_second", 'q"u\\o\nte') not in got  # not paced
    assert got[("tokenpace_engine_idle_waits_total", "")] == 3
    assert got[("tokenpace_engine_folded_users", "")] == 3
    assert merge([{"pacing": None}]) is None  # pacing off: no series at all


def test_lane_series_are_summed_per_priority() -> None:
    rank0 = {"pacing": {**RANK0["pacing"], "lanes": {"10": [5, 2, 0, 1], "0": [0, 0, 3, 0]}}}
    rank1 = {"pacing": {**RANK1["pacing"], "lanes": {"10": [1, 0, 0, 2]}}}
    merged = merge([rank0, rank1])
    assert merged is not None
    page = exposition(merged).decode()
    got = {(s.name, s.labels.get("priority", "")): s.value
           for f in text_string_to_metric_families(page) for s in f.samples}
    assert got[("tokenpace_engine_lane_held_request_steps_total", "10")] == 6
    assert got[("tokenpace_engine_lane_yielded_prompt_steps_total", "10")] == 2
    assert got[("tokenpace_engine_lane_admitted_total", "0")] == 3
    assert got[("tokenpace_engine_lane_held_requests", "10")] == 3
    # A rank without lanes (an older answer) adds nothing.
    assert merge([RANK0])["lanes"] == {}  # type: ignore[index]


def test_the_name_filter_keeps_only_the_families_it_names() -> None:
    merged = merge([RANK1])
    assert merged is not None
    page = exposition(merged, {"tokenpace_engine_output_tokens_total", "vllm:x"})
    assert {name for name, _ in samples(page)} == {"tokenpace_engine_output_tokens_total"}
    # Prometheus names a counter family without its _total as well.
    assert samples(exposition(merged, {"tokenpace_engine_idle_waits"}))
    assert exposition(merged, {"vllm:num_requests_running"}) == b""


class Engine:
    """The API server's engine client: counts utility calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def call_utility_all_async(self, method: str) -> list[dict[str, Any]]:
        assert method == _metrics.UTILITY_METHOD
        self.calls += 1
        return [RANK0, RANK1]


async def scrape(engine: Engine, query: bytes = b"",
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[dict, bytes, list]:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def vllm(scope: Any, receive: Any, send: Any) -> None:
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4"),
            (b"content-length", str(len(VLLM_PAGE)).encode())]})
        await send({"type": "http.response.body", "body": VLLM_PAGE})

    app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(engine_core=engine)))
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "GET", "path": "/metrics", "query_string": query,
             "headers": list(headers), "app": app}
    await handle_metrics(vllm, scope, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start, body, seen


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_metrics, "_cache", _metrics._Cache())


def test_the_page_is_vllms_then_ours_and_one_reading_serves_a_second() -> None:
    engine = Engine()

    async def body() -> None:
        start, page, seen = await scrape(engine, headers=(
            (b"accept-encoding", b"gzip"), (b"accept", b"application/openmetrics-text"),
            (b"authorization", b"Bearer k")))
        # vLLM was asked for its plain text page, uncompressed; other headers untouched.
        assert seen == [[(b"authorization", b"Bearer k")]]
        assert page.startswith(VLLM_PAGE)
        assert samples(page)[("tokenpace_engine_output_tokens_total", "b")] == 7
        assert dict(start["headers"])[b"content-length"] == str(len(page)).encode()
        await scrape(engine)
        assert engine.calls == 1  # within CACHE_S: the same reading
        _metrics._cache.at -= _metrics.CACHE_S
        await scrape(engine)
        assert engine.calls == 2

    asyncio.run(body())


def test_a_poll_for_vllms_gauges_does_not_ask_the_engine() -> None:
    engine = Engine()

    async def body() -> None:
        _, page, _ = await scrape(
            engine, b"name%5B%5D=vllm:num_requests_waiting&name%5B%5D=vllm:kv_cache_usage_perc")
        assert page == VLLM_PAGE and engine.calls == 0
        _, page, _ = await scrape(engine, b"name[]=tokenpace_engine_rate_tokens_per_second")
        assert {n for n, _ in samples(page)} == {"vllm:num_requests_running",
                                                 "tokenpace_engine_rate_tokens_per_second"}

    asyncio.run(body())

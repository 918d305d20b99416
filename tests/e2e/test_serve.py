"""`tokenpace serve` end to end: real servers on the tiny model, the official openai client.

Two servers run side by side for the whole module, one with vLLM's synchronous scheduling
and one with ``--async-scheduling``; every test checks both. Start-up costs ~30 s each, so
the tests share them and choose users with distinct limits instead of restarting.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests._engine_pool import ModuleEngines
from tests._servers import (Server, engine_series, first_request_short_prompt, free_port,
                            served_dtype, tokenpace_serve_argv, tree_cpu_seconds)
from tests.e2e._engine_log import all_dispatches, paced_rate, wait_for_engine_requests
from tests.e2e._streams import client, stream, streams, user_rate
from tests.e2e._timing import expect

pytestmark = pytest.mark.vllm

LIMITS = {"user-b": 100, "iso-a": 5, "iso-b": 100000, "idle": 1, "probe": 100000, "reload": 10}


@dataclass
class Paced:
    mode: str
    server: Server
    limits_file: Path
    event_log: Path


MODES = (("sync", "--no-async-scheduling"), ("async", "--async-scheduling"))


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    """One server per mode of ``MODES``, its files in ``home / mode``."""
    servers = []
    for mode, flag in MODES:
        (home / mode).mkdir()
        (home / mode / "limits.json").write_text(json.dumps(LIMITS))
        port = free_port()
        argv = tokenpace_serve_argv(
            tiny_model, port,
            "--default-user-output-tokens-per-second", "20",
            "--user-output-tokens-per-second", f"@{home / mode / 'limits.json'}",
            "--output-rate-event-log", str(home / mode / "events.jsonl"),
            "--max-num-seqs", "16", "--max-num-active-seqs", "4",
            flag,
        )
        servers.append(Server(argv, port, home / mode / "vllm.log"))
    return servers


@pytest.fixture(scope="module")
def paced(module_engines: ModuleEngines) -> list[Paced]:
    started = [Paced(mode, server, module_engines.home / mode / "limits.json",
                     module_engines.home / mode / "events.jsonl")
               for (mode, _), server in zip(MODES, module_engines.servers)]
    for p in started:  # through tokenpace serve, which picks float32 for the tiny model
        first_request_short_prompt(p.server)
    # The first steps of a fresh engine (each new batch size) are slow: warm it up
    # so that the timed tests measure pacing, not start-up.
    for p in started:
        asyncio.run(streams(p.server.base_url, [("probe", 8, 32)]))
    return started


def test_each_server_runs_the_paced_scheduler_it_was_asked_for(paced: list[Paced]) -> None:
    for p in paced:
        log = p.server.log_path.read_text(errors="replace")
        expected = "PacedAsyncScheduler" if p.mode == "async" else "PacedScheduler,"
        assert f"tokenpace: pacing output tokens with {expected}" in log, p.mode
        # tokenpace serve picks float32 for the tiny model (bfloat16 picks the
        # AMX attention kernel on AMX hosts, where the fixture's first request kills it).
        assert served_dtype(p.server) == "float32", p.mode


def test_each_user_gets_its_rate_with_all_tokens(paced: list[Paced]) -> None:
    """Rates and stream finishes at the engine (event log), token counts at both ends.

    user-b has four streams: one stream takes at most one token per engine step, and a
    busy 2-core CI machine does not always step 100 (or 50) times a second; with four,
    25 steps a second suffice. The rate is the limiter's (``paced_rate``): net of GCRA's
    burst, over the span less the time the engine was away (no dispatch for anyone while
    the user was allowed and fell behind its schedule). A loaded machine (load average 12
    on 2 cores) starved the engine for 0.03-8 s at a time in earlier runs; whole-span
    rates fell to 68 tok/s (user-b) and 16 (user-a) while ``paced_rate`` stayed within
    1% of the limit (0.2% in the final 10 runs per mode). Bound: within 3%; GCRA makes the upper side exact; a limiter 5%
    slow fails the lower side (tests/unit/test_engine_log_rate.py).
    """
    plan = [("user-a", 4, 100), ("user-b", 4, 250)]
    for p in paced:  # one at a time: two busy servers on two cores disturb each other's timing
        since = time.monotonic()
        results = asyncio.run(streams(p.server.base_url, plan))
        for r in results:
            assert r.completion_tokens == (100 if r.user == "user-a" else 250), p.mode
        found = wait_for_engine_requests(p.event_log, {"user-a", "user-b"}, since, 1400)
        a = [r for r in found if r.user == "user-a"]
        b = [r for r in found if r.user == "user-b"]
        charged = {"user-a": sum(len(r.times) for r in a), "user-b": sum(len(r.times) for r in b)}
        assert charged == {"user-a": 400, "user-b": 1000}, (p.mode, charged, p.event_log)
        everyone = all_dispatches(p.event_log, since)
        times_a = [t for r in a for t in r.times]
        rate_a = paced_rate(times_a, 20, everyone)
        rate_b = paced_rate([t for r in b for t in r.times], 100, everyone)
        series = {"mode": p.mode, "user_a": rate_a.as_series(), "user_b": rate_b.as_series(),
                  "client_rate_a": user_rate(results[:4], 20),
                  "client_rate_b": user_rate(results[4:], 100)}  # for comparison only
        logs = [p.server.log_path, p.event_log]
        for user, rate, limit in (("user-a", rate_a, 20), ("user-b", rate_b, 100)):
            for bound, upper in ((0.97 * limit, False), (1.03 * limit, True)):
                expect("rates", f"{p.mode} {user} paced rate ({limit} tok/s)", rate.paced_rate,
                       bound, upper=upper, logs=logs, **series)
        # The user's 4 streams share its rate in turn, so they finish together: within
        # 15% of the 20 s span (3 s); the rotation keeps them within a few tokens (0.2 s).
        span_a = max(times_a) - min(times_a)
        finishes = [r.last - min(times_a) for r in a]
        expect("rates", f"{p.mode} user-a finish spread / span", (max(finishes) - min(finishes))
               / span_a, 0.15, logs=logs, finishes_s=finishes, span_s=span_a, mode=p.mode)


ISO_TOKENS = 300
ISO_ROUNDS = 5
# With the throttled-slot handover broken, the other user's request waits for an active
# slot that 2000-token streams at 5 tok/s never free: the test fails at this timeout.
ISO_SHARED_TIMEOUT_S = 30.0


@dataclass
class Timed:
    """One request: sent at ``start`` (client); tokens dispatched at ``times`` (engine)."""

    start: float
    end: float  # the client's last byte
    times: tuple[float, ...] = ()

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def total(self) -> float:
        return self.times[-1] - self.start

    @property
    def step(self) -> float:
        """Median time between two of its tokens: the engine's step time while it ran.

        A median over 299 gaps: a CPU-starved engine that stalls for a few of them (0.3 s
        and more under load) does not move it; a slower step does."""
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:]))


async def _timed(api: openai.AsyncOpenAI, user: str, tokens: int) -> Timed:
    start = time.monotonic()
    record = await stream(api, user, tokens)
    assert record.completion_tokens == tokens
    return Timed(start, time.monotonic())


@dataclass
class Isolation:
    pairs: list[tuple[Timed, Timed]]  # (iso-b alone, iso-b next to the flood) per round
    probes: list[float]  # first-token times of probes next to the flood ...
    control: list[float]  # ... and of probes sent at the same instants to an idle server


async def _isolation(p: Paced, control: Paced) -> Isolation:
    """Rounds of (iso-b alone, iso-b next to 8 resident iso-a streams), back to back; in
    the last round, while the flood is still resident, paired probes (``control`` idle).

    Each pair is measured seconds apart, so the load of a shared machine, which drifts
    over tens of seconds, is nearly the same for both halves of a pair.
    """
    api = client(p.server.base_url)
    pairs: list[tuple[Timed, Timed]] = []
    probes: tuple[list[float], list[float]] = ([], [])
    try:
        for round_ in range(ISO_ROUNDS):
            alone = await _timed(api, "iso-b", ISO_TOKENS)
            flood = [asyncio.create_task(stream(api, "iso-a", 2000)) for _ in range(8)]
            try:
                await asyncio.sleep(2.0)  # 8 admissions at 5 tok/s: all resident, throttled
                assert not any(t.done() for t in flood), "the throttled streams should still run"
                try:
                    shared = await asyncio.wait_for(_timed(api, "iso-b", ISO_TOKENS),
                                                    ISO_SHARED_TIMEOUT_S)
                except TimeoutError:
                    pytest.fail(f"{p.mode}: a 300-token iso-b request did not finish in "
                                f"{ISO_SHARED_TIMEOUT_S:.0f} s next to the throttled streams "
                                f"(alone it took {alone.end - alone.start:.2f} s); "
                                f"server log: {p.server.log_path}")
                if round_ == ISO_ROUNDS - 1:
                    probes = await _paired_probe_ttfts(p, control)
                    assert not any(t.done() for t in flood), "the flood ended before the probes"
            finally:
                for t in flood:
                    t.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
            pairs.append((alone, shared))
    finally:
        await api.close()
    return Isolation(pairs, *probes)


def _attach_engine_times(p: Paced, pairs: list[tuple[Timed, Timed]]) -> None:
    """Each request's tokens from the event log: iso-b's requests run one at a time, so
    its charges between a request's send and its last byte are that request's."""
    timed = [t for pair in pairs for t in pair]
    found = wait_for_engine_requests(p.event_log, {"iso-b"}, timed[0].start,
                                     ISO_TOKENS * len(timed))
    for t in timed:
        t.times = tuple(x for r in found for x in r.times if t.start <= x <= t.end)
        assert len(t.times) == ISO_TOKENS, (p.mode, len(t.times), p.event_log)


def test_throttled_user_does_not_slow_another(paced: list[Paced]) -> None:
    """8 resident streams of a 5 tok/s user, 4 active slots: the other user keeps its pace.

    Measured at the source (event log), per round of one request alone and one next to
    the flood, back to back so both see the machine's load of the moment:
    - pace: the median time between the request's tokens at the engine (its step time),
      next to the flood at most 1.8x alone (median over 5 rounds; why 1.8 at the assertion). Not the
      client's first-to-last interval (a client that reads buffered chunks in a burst made
      it a few ms), and not the whole request's duration: at a load average of 17 on 2
      cores a CPU-starved engine stalled single requests 3.8x in earlier runs, and the
      median of 5 durations failed twice in 10; a median over 299 gaps ignores stalls
      (its median of 5 ratios stayed at or below 1.06 in 18 of 20 runs at load averages
      of 8-40; 1.24 and 1.38 once each; the 0.1 ms per throttled request and step that a
      mutation added gave 1.90).
      An engine that sleeps or skips the user while the flood is throttled, or a per-step
      cost of the throttled requests, slows every step: that fails here.
    - first token: 1-token probes sent next to the flood and, at the same instant, to the
      other (idle) server; send to the token's dispatch at each engine (event logs); the
      median of (probe - 1.5x control) at most 10 ms (one step of jitter). Paired, because
      a first token measured seconds apart from its baseline is the machine's noise at
      load: the median of 5 (shared - 1.5x alone) pairs of 300-token requests reached
      +0.18 s at a load average of 15 on 2 cores. An engine that sleeps while the flood is
      throttled and is not woken by a new request holds a probe until an iso-a token is
      due (up to 0.2 s at 5 tok/s). A broken slot handover never admits the request: the
      timeout above fails the test.
    """
    for p in paced:
        control = next(q for q in paced if q is not p)
        iso = asyncio.run(_isolation(p, control))
        pairs = iso.pairs
        _attach_engine_times(p, pairs)
        ratios = [s.step / a.step for a, s in pairs]
        ttft_excess = [d - 1.5 * c for d, c in zip(iso.probes, iso.control)]
        series = {
            "mode": p.mode,
            "alone_step_s": [a.step for a, _ in pairs],
            "shared_step_s": [s.step for _, s in pairs],
            "alone_total_s": [a.total for a, _ in pairs],
            "shared_total_s": [s.total for _, s in pairs],
            "alone_ttft_s": [a.ttft for a, _ in pairs],
            "shared_ttft_s": [s.ttft for _, s in pairs],
            "probe_ttft_s": iso.probes,
            "control_ttft_s": iso.control,
        }
        logs = [p.server.log_path, p.event_log]
        # 1.8: on a quiet machine the tiny model steps in ~1 ms, and the 8 resident
        # throttled requests add a fixed ~0.45 ms per step (a fresh-clone CI run measured a
        # median of 1.46 in async mode, rounds up to 1.63; the old 1/0.7 = 1.43 failed
        # there). A per-throttled-request cost of 0.1 ms per step (the mutation) adds 0.8 ms:
        # about 2.2 quiet, 1.90 at load 20; a sleeping or starving engine times out above.
        expect("isolation", f"{p.mode} median shared/alone step time",
               statistics.median(ratios), 1.8, logs=logs, **series)
        expect("isolation", f"{p.mode} median of probe TTFT - 1.5 x idle server's (s)",
               statistics.median(ttft_excess), 0.010, logs=logs, **series)


PROBES = 7
PROBE_SPACING_S = 0.3


async def _paired_probe_ttfts(p: Paced, control: Paced) -> tuple[list[float], list[float]]:
    """1-token probes sent at the same moment to ``p`` and to the idle ``control`` server:
    send to the engine's dispatch of the token, for each (event logs).

    Pairs cancel the machine's contention of the moment: at load averages of 20-40 on 2
    cores a probe took anywhere from 4 ms to 0.35 s (up to 20 s once), and the medians of
    5 or 7 probes before and during the throttled phase, taken seconds apart, crossed a
    bound of 1.5x + 10 ms in a third of earlier runs.
    """
    apis = client(p.server.base_url), client(control.server.base_url)
    sent = []
    try:
        for i in range(PROBES):
            start = time.monotonic()
            order = apis if i % 2 == 0 else apis[::-1]  # neither is always sent first
            await asyncio.gather(*(stream(api, "probe", 1) for api in order))
            sent.append(start)
            await asyncio.sleep(PROBE_SPACING_S)
    finally:
        for api in apis:
            await api.close()
    ttfts = []
    for server in (p, control):
        found = wait_for_engine_requests(server.event_log, {"probe"}, sent[0], PROBES)
        firsts = sorted(r.first for r in found)
        assert len(firsts) == PROBES, (server.mode, len(firsts), server.event_log)
        ttfts.append([f - s for s, f in zip(sent, firsts)])
    return ttfts[0], ttfts[1]


async def _idle(p: Paced, control: Paced) -> tuple[float, list[float], list[float]]:
    api = client(p.server.base_url)
    try:
        throttled = [asyncio.create_task(stream(api, "idle", 100)) for _ in range(8)]
        await asyncio.sleep(3.0)
        cpu0, t0 = tree_cpu_seconds(p.server.proc.pid), time.monotonic()
        await asyncio.sleep(10.0)
        cores = (tree_cpu_seconds(p.server.proc.pid) - cpu0) / (time.monotonic() - t0)
        during, idle_control = await _paired_probe_ttfts(p, control)
        for t in throttled:
            t.cancel()
        await asyncio.gather(*throttled, return_exceptions=True)
        return cores, during, idle_control
    finally:
        await api.close()


def test_all_throttled_server_idles_and_still_answers_at_once(paced: list[Paced]) -> None:
    """CPU of the server's process tree (at the source) and, at the engine, the time from
    a probe's send to its token's dispatch (event log), against a probe sent at the same
    moment to the other server, which has nothing to do. Margins: the busy loop this
    replaces used a whole core (1.0); 0.1 leaves the engine's 50 ms wake-ups and vLLM's
    own threads room on a loaded machine. An idle wait that new requests do not wake
    holds a probe until a throttled user is ready (here up to 1 s: 0.63-0.91 s in issue
    19's check); the median of the paired excess over 1.5x the control allows 10 ms."""
    for p in paced:
        control = next(q for q in paced if q is not p)
        cores, during, idle_control = asyncio.run(_idle(p, control))
        logs = [p.server.log_path, p.event_log]
        expect("idle", f"{p.mode} server cores while all throttled", cores, 0.1, logs=logs,
               mode=p.mode)
        excess = [d - 1.5 * c for d, c in zip(during, idle_control)]
        expect("idle", f"{p.mode} median of probe TTFT - 1.5 x idle server's (s)",
               statistics.median(excess), 0.010, logs=logs, mode=p.mode,
               during_s=during, control_s=idle_control)


def test_bench_idle_measures_a_throttled_server(paced: list[Paced], tmp_path: Path) -> None:
    """``tokenpace bench idle``'s measurement, run on this module's synchronous server, and
    its plot drawn from it. The bench's quick run starts two servers of its own (the idle
    wait and vLLM's busy loop: two minutes of CI) to show what the test above bounds more
    tightly in both modes; here its code runs, its figures are sane, and the idle wait
    keeps the throttled server well under the busy loop's core (0.5: a margin of 5x over
    the 0.1 above, which is bounded at the source)."""
    from tokenpace.bench import idle

    p = paced[0]
    case = asyncio.run(idle.measure(p.server, 1.0))
    logs = [p.server.log_path, p.event_log]
    assert set(case) == {"no_requests_cores", "throttled_cores", "fresh_ttft_ms_before",
                         "fresh_ttft_ms_during"}, case
    assert case["fresh_ttft_ms_before"] > 0 and case["fresh_ttft_ms_during"] > 0, case
    expect("idle", f"{p.mode} bench idle: cores while throttled", case["throttled_cores"], 0.5,
           logs=logs, case=case)
    idle.plot({"cases": {"idle_wait": case}}, tmp_path / "idle.png")
    assert (tmp_path / "idle.png").stat().st_size > 10_000


BAD_BODIES = [
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"vllm_xargs": {"output_rate_user": ""}}, "vllm_xargs.output_rate_user"),
    ({"vllm_xargs": {"output_rate_user": 42}}, "vllm_xargs.output_rate_user"),
    ({"vllm_xargs": {"output_rate_user": "x" * 257}}, "vllm_xargs.output_rate_user"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_BODIES)
def test_unpaceable_requests_get_400(paced: list[Paced], extra: dict, param: str) -> None:
    for p in paced:
        api = openai.OpenAI(base_url=f"{p.server.base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model="tiny", prompt="Hi", max_tokens=4, extra_body=extra)
        assert err.value.status_code == 400
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, body
        chat = httpx.post(
            f"{p.server.base_url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4, **extra},
            timeout=30,
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == param
        # The engine is unharmed: a good request still completes.
        ok = api.completions.create(model="tiny", prompt="Hi", max_tokens=4,
                                    extra_body={"vllm_xargs": {"output_rate_user": "probe"}})
        assert ok.usage is not None and ok.usage.completion_tokens == 4


def test_broken_json_body_is_vllms_400_not_a_crash(paced: list[Paced]) -> None:
    for p in paced:
        resp = httpx.post(f"{p.server.base_url}/v1/completions", content=b'{"model": "tiny",',
                          headers={"content-type": "application/json"}, timeout=30)
        assert resp.status_code == 400
        assert httpx.get(f"{p.server.base_url}/health", timeout=5).status_code == 200


def test_limits_file_edits_apply_without_restart(paced: list[Paced]) -> None:
    """Each request's rate at the engine (event log, net of the engine's absences as in
    the rates test): 80 tokens at 10 tok/s span 7.8 s, 120 at 40 tok/s 2.9 s; 5% is
    0.39 s and 0.15 s of lag, and GCRA cannot exceed the limit. A reload that did not
    apply paces at 10 instead of 40 tok/s; a broken file that was applied raises an
    error. Each engine absence keeps up to 0.1 s (the burst it used) in the span: with
    40 tokens at 10 tok/s a load average of 24 on 2 cores once measured 9.508 against the
    bound 9.5; 80 tokens halve that share (4 absences of 0.1 s are 5% of 7.8 s)."""
    async def run(p: Paced) -> None:
        url = p.server.base_url
        p.limits_file.write_text(json.dumps(LIMITS))  # as the module began (repeat runs)
        await asyncio.sleep(1.2)  # the engine looks at the file at most once a second
        await streams(url, [("reload", 1, 80)])
        p.limits_file.write_text(json.dumps({**LIMITS, "reload": 40}))
        await asyncio.sleep(1.2)
        await streams(url, [("reload", 1, 120)])
        p.limits_file.write_text('{"reload": 40, "oops"')  # an editor's half-saved file
        await asyncio.sleep(1.2)
        await streams(url, [("reload", 1, 120)])

    for p in paced:
        since = time.monotonic()
        asyncio.run(run(p))
        found = wait_for_engine_requests(p.event_log, {"reload"}, since, 320)
        assert [len(r.times) for r in found] == [80, 120, 120], (p.mode, p.event_log)
        everyone = all_dispatches(p.event_log, since)
        rates = [paced_rate(r.times, limit, everyone) for r, limit in zip(found, (10, 40, 40))]
        logs = [p.server.log_path, p.event_log]
        series = [r.as_series() for r in rates]
        for name, rate, limit in zip(("before", "after", "kept"), rates, (10, 40, 40)):
            for bound, upper in ((0.95 * limit, False), (1.05 * limit, True)):
                expect("reload", f"{p.mode} {name} paced rate ({limit} tok/s)", rate.paced_rate,
                       bound, upper=upper, logs=logs, mode=p.mode, rates=series)
        log = p.server.log_path.read_text(errors="replace")
        assert "keeping the last good limits" in log, p.mode


def test_the_engines_metrics_show_what_pacing_did(paced: list[Paced]) -> None:
    """Per user on the engine's /metrics, read before and after a run: the output
    tokens equal what the clients received (plus at most one step past a stop per stream
    under async scheduling), a user held back at 20 tok/s shows throttled request-steps
    and seconds, an unthrottled one none, and each user's rate in force."""
    for p in paced:
        before = engine_series(p.server)
        # Prometheus asks for gzip and OpenMetrics; the page must still carry our series.
        assert engine_series(p.server, **{"accept-encoding": "gzip",
                                           "accept": "application/openmetrics-text"})
        results = asyncio.run(streams(p.server.base_url,
                                      [("metrics-slow", 4, 15), ("probe", 2, 40)]))
        after = engine_series(p.server)

        def delta(name: str, user: str) -> float:
            return after.get((name, user), 0.0) - before.get((name, user), 0.0)

        for user, count in (("metrics-slow", 4), ("probe", 2)):
            received = sum(r.completion_tokens or 0 for r in results if r.user == user)
            counted = delta("tokenpace_engine_output_tokens_total", user)
            assert received <= counted <= received + (count if p.mode == "async" else 0), \
                (p.mode, user, received, counted)
        # 60 tokens at 20 tok/s (2 of them in the burst) take ~2.9 s; the slow user's
        # streams wait for quota nearly all of it. Bound: half of that.
        assert delta("tokenpace_engine_throttled_seconds_total", "metrics-slow") > 1.4, p.mode
        assert delta("tokenpace_engine_throttled_request_steps_total", "metrics-slow") > 0
        assert delta("tokenpace_engine_throttled_request_steps_total", "probe") == 0
        assert delta("tokenpace_engine_throttled_seconds_total", "probe") == 0
        assert after[("tokenpace_engine_rate_tokens_per_second", "metrics-slow")] == 20
        assert after[("tokenpace_engine_rate_tokens_per_second", "probe")] == 100000
        assert ("tokenpace_engine_idle_waits_total", "") in after

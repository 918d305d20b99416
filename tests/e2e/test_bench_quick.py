"""The quick modes of the real-server benchmarks run, write their JSON and plots, and
report numbers that make sense (so the benchmarks cannot rot)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e._bench_runs import BenchRuns
from tests.e2e._timing import expect

pytestmark = pytest.mark.vllm


COMMANDS = {"adapters": ("fleet", "--workload", "adapters")}
"""Tests named for a workload of another bench: the command they run (default: the name)."""
BENCHMARKS = {"adapters": "fleet-adapters"}
"""The ``benchmark`` each such bench writes in its JSON (default: the name)."""

EXCLUSIVE = {"pacing", "overhead"}
"""Benches that bound timings seen at the client: they run with no other bench beside them
(the others run two at a time, ``_bench_runs``)."""


def _args(name: str) -> tuple[str, ...]:
    """The bench's arguments: ``--quick``, or what its test asks for instead. Raises the
    test's skip (or failure) when a server it needs cannot run here."""
    if name == "overhead":  # --quick's workload, alternated 5 times (see its test)
        return ("--streams", "8", "--tokens", "64", "--repeats", "5")
    if name == "gateway":
        # With the Redis path when there is a redis-server (one engine start for both
        # gateways; the quick run's third path adds about 15 s) and the control arm (a
        # byte relay in front of the same engine: one more call in every pair, a few
        # seconds more).
        redis = ("--state", "redis") if _redis_for_bench() else ()
        return ("--quick", "--control", "byte-proxy", *redis)
    if name == "metering":
        from tests._postgres import require_postgres

        require_postgres()
    return ("--quick",)


@pytest.fixture(scope="module")
def benches(request: pytest.FixtureRequest, tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The bench commands of this module's selected tests, started (two at a time) when
    the first of them asks for its result: name -> (runs, output directory, whether it
    plots), or the skip or failure its test raises instead."""
    module = request.node.nodeid + "::"
    names = [item.name.removeprefix("test_bench_").removesuffix("_quick")
             for item in request.session.items if item.nodeid.startswith(module)
             and item.name.startswith("test_bench_")]
    runs = BenchRuns(slots=2)
    prepared: dict[str, object] = {}
    for name in dict.fromkeys(names):  # in the tests' order: each test waits for less
        try:
            args = _args(name)
        except BaseException as exc:  # pytest's skip and fail: raised by the test itself
            prepared[name] = exc
            continue
        out = tmp_path_factory.mktemp(f"bench-{name}")
        plot = name != "metering"
        argv = [sys.executable, "-m", "tokenpace.cli", "bench", *COMMANDS.get(name, (name,)),
                *args,
                "--model", str(tiny_model), "--json", str(out / f"{name}.json"),
                *(("--plot", str(out / f"{name}.png")) if plot else ())]
        runs.add(name, argv, out, exclusive=name in EXCLUSIVE)
        prepared[name] = (runs, out, plot)
    yield prepared
    runs.close()


def _bench(benches: dict[str, object], name: str) -> tuple[dict, Path]:
    """``tokenpace bench NAME --quick`` (or its test's arguments): its result, and the
    directory of its JSON and plot."""
    entry = benches[name]
    if isinstance(entry, BaseException):
        raise entry
    runs, out, plot = entry  # type: ignore[misc]
    done = runs.result(name)
    assert done.returncode == 0, (f"exit {done.returncode} after {done.wall_s} s:\n"
                                  + done.stdout[-3000:] + done.stderr[-3000:])
    assert not plot or (out / f"{name}.png").stat().st_size > 10_000
    result = json.loads((out / f"{name}.json").read_text())
    assert result["benchmark"] == BENCHMARKS.get(name, name)
    assert result["vllm"].startswith("0.32.")
    return result, out


def test_bench_pacing_quick(benches: dict[str, object]) -> None:
    result, out = _bench(benches, "pacing")
    assert [s["slow_streams"] for s in result["scenarios"]] == [1, 4]
    for scenario in result["scenarios"]:
        for user in scenario["users"]:
            assert user["tokens"] == user["streams"] * 40
            # 40-token streams are too short to measure a rate closely (the full run is in
            # docs/benchmarks/pacing.md, and tests/e2e/test_serve.py checks 3%): never above it.
            # Measured at the engine, where GCRA makes it exact (5% for rounding).
            expect("bench_quick", "pacing engine rate / limit", user["engine_rate"]
                   / user["limit"], 1.05, logs=[out / "pacing.json"], user=user)
            # Gaps at the engine: a busy client reads several chunks at once, which makes the
            # client's median gap of a short 100 tok/s stream collapse to ~0 on this box.
            # A paced user's tokens leave at the step after its quota returns: the median
            # gap is the ideal one plus up to a step, never half of it.
            expect("bench_quick", "pacing engine median gap / ideal gap",
                   user["engine_gap_p50_s"] / user["ideal_gap_s"], 0.5, upper=False,
                   logs=[out / "pacing.json"], user=user)


    # End users at 4 tok/s beside a stream of their user without one (20 tok/s in all):
    # paced, each is at 4 (client-side, over 40 tokens: 25% for chunks read together);
    # unpaced they would share the 20 three ways (6.7 each).
    [end_users] = result["end_users"]
    rates = {row["end_user"]: row["client_rate"] for row in end_users["streams"]}
    for name in ("reader-1", "reader-2"):
        expect("bench_quick", f"end user {name} client rate / 4 tok/s", rates[name] / 4.0,
               1.25, logs=[out / "pacing.json"], end_users=end_users)
    expect("bench_quick", "the stream without an end user / 12 tok/s",
           rates["(no end user)"] / 12.0, 0.8, upper=False, logs=[out / "pacing.json"],
           end_users=end_users)


def test_bench_overhead_quick(benches: dict[str, object]) -> None:
    # --quick's workload (8 streams of 64 tokens: about 0.2 s a run), alternated 5 times:
    # one pair of 0.2 s runs gave 0.33 at a load average of 13 on 2 cores in earlier
    # runs; the median of 5 adjacent pairs does not hang on one moment of the machine.
    result, out = _bench(benches, "overhead")  # --streams 8 --tokens 64 --repeats 5
    stock, paced = result["stock_tokens_per_s"], result["paced_tokens_per_s"]
    assert len(stock) == len(paced) == 5
    # A collapse check, not a performance claim (pacing that never throttles costs ~1%,
    # docs/benchmarks/pacing.md): the best of the 5 adjacent pairs. The engine on this 2-core box
    # runs in two modes, ~1.6k and ~8-13k tok/s, for seconds at a time, whichever server
    # it is; a fresh-clone CI run on 2026-12-01 had the paced server's runs in the slow one
    # and failed a bound on the median of the pairs. A paced server that throttles or
    # stalls everyone is slow in every pair.
    best = max(p / s for s, p in zip(stock, paced))
    expect("bench_quick", "overhead paced/stock, best of 5 pairs", best, 0.5, upper=False,
           logs=[out / "overhead.json"], stock=stock, paced=paced)


def _redis_for_bench() -> bool:
    """Whether the gateway bench also runs its Redis path: always in CI (a missing
    redis-server fails there, tests/_redis.py); elsewhere when redis-server is installed."""
    if os.environ.get("CI", "").lower() == "true" or shutil.which("redis-server"):
        from tests._redis import redis_server_binary

        redis_server_binary()
        return True
    return False


@pytest.mark.redis
def test_bench_gateway_quick(benches: dict[str, object]) -> None:
    result, out = _bench(benches, "gateway")  # --quick --control byte-proxy [--state redis]
    with_redis = _redis_for_bench()
    pairs, rounds = result["parameters"]["requests"], result["parameters"]["rounds"]
    paths = ("direct", "gateway", "byte_proxy", *(("gateway_redis",) if with_redis else ()))
    assert set(result["ttft_ms"]) == set(paths)
    for path in paths:
        assert len(result["ttft_ms"][path]) == pairs
        assert 0 < result["latency"][path]["ttft_ms_median"] <= result["latency"][path]["ttft_ms_p99"]
    # Both paths sent the engine the same work: greedy decoding of the same prompt gave the
    # same tokens in every pair (a path that changed the prompt, the sampling or the
    # length would not).
    assert result["same_output_pairs"] == pairs
    added = result["added_ttft_ms"]
    assert added["pairs"] == pairs and len(added["values"]) == pairs
    assert added["p1"] <= added["p50"]["value"] <= added["p99"]["value"]
    assert added["p50"]["interval95"][0] <= added["p50"]["interval95"][1]
    assert result["gateway_cpu_ms_per_request"]["median"] > 0
    assert result["gateway_cpu_us_per_chunk"]["median"] >= 0
    assert result["requests_per_gateway_cpu_second"]["median"] > 0
    assert len(result["burst_ttft_ms_median"]["gateway"]) == rounds
    assert result["burst_ttft_ratio"]["pairs"] == result["throughput_ratio"]["pairs"] == rounds
    # the gateway's ledger has every gateway burst round (found by its wall-clock span)
    in_gateway = result["burst_in_gateway"]
    assert len(in_gateway["queue_ms_max"]) == rounds
    assert all(t is not None and t > 0 for t in in_gateway["ttft_ms_median"]), in_gateway
    # A sanity bound, not a claim: the gateway's burst throughput against the byte proxy's
    # (the control arm: the same bursts, interleaved with the gateway's in each pair, so a
    # busy machine hits both). Against direct it is not bounded: in a CI run beside another
    # bench the quick run's 3 pairs gave gateway/direct 0.24 while gateway/byte proxy was
    # 1.04 (the byte proxy itself 0.32 of direct).
    expect("bench_quick", "gateway/byte-proxy throughput ratio",
           result["control"]["gateway_over_control"]["throughput_ratio"]["median"],
           0.3, upper=False, logs=[out / "gateway.json"])
    _check_control_path(result, pairs, rounds)
    if with_redis:
        _check_redis_path(result, pairs, rounds)


def _check_redis_path(result: dict, pairs: int, rounds: int) -> None:
    """The Redis gateway's figures: the same as the in-process gateway's, taken in the same
    pairs, plus what Redis adds and the Redis server's own CPU (sanity, not timing bounds)."""
    assert result["parameters"]["state"] == "redis"
    redis = result["redis"]
    assert redis["state"]["redis_server"].startswith("started by the bench")
    assert redis["same_output_pairs"] == pairs  # the Redis gateway relays the same tokens
    for key in ("added_ttft_ms", "added_total_ms", "redis_adds_ttft_ms", "redis_adds_total_ms"):
        figure = redis[key]
        assert figure["pairs"] == pairs and len(figure["values"]) == pairs, key
        assert figure["p1"] <= figure["p50"]["value"] <= figure["p99"]["value"], key
    # Redis adds to the in-process gateway exactly the difference of the two, pair by pair
    for adds, memory, shared in zip(redis["redis_adds_ttft_ms"]["values"],
                                    result["added_ttft_ms"]["values"],
                                    redis["added_ttft_ms"]["values"]):
        assert adds == pytest.approx(shared - memory, abs=0.002)
    for key in ("throughput_ratio", "burst_ttft_ratio", "throughput_ratio_to_gateway",
                "burst_ttft_ratio_to_gateway"):
        assert redis[key]["pairs"] == rounds and redis[key]["median"] > 0, key
    assert len(redis["burst_in_gateway"]["queue_ms_max"]) == rounds
    assert all(t is not None and t > 0 for t in redis["burst_in_gateway"]["ttft_ms_median"])
    assert redis["gateway_cpu_ms_per_request"]["median"] > 0
    assert redis["gateway_cpu_ms_per_request_fast_upstream"]["median"] > 0
    assert redis["requests_per_gateway_cpu_second"]["median"] > 0
    assert redis["gateway_cpu_us_per_chunk"]["median"] >= 0
    # the Redis server worked for the Redis gateway: its CPU per request is counted, and
    # each of the 3 CPU rounds has its reading
    for key in ("redis_server_cpu_ms_per_request",
                "redis_server_cpu_ms_per_request_fast_upstream"):
        assert len(redis[key]["values"]) == 3 and redis[key]["median"] > 0, key
    # ... and it took its slots there: at least one command per request (Redis counts the
    # scripts' inner calls too: ~13 per request in a full run), which a gateway keeping its
    # slots in process would not
    for key in ("redis_commands_per_request", "redis_commands_per_request_fast_upstream",
                "redis_commands_per_request_burst"):
        assert redis[key]["median"] >= 1, (key, redis[key])
    assert len(redis["redis_server_cpu_us_per_chunk_gross"]["values"]) == rounds
    assert len(redis["redis_server_cpu_ms_per_s_idle"]["values"]) == 3


def _check_control_path(result: dict, pairs: int, rounds: int) -> None:
    """The control arm's figures (sanity, not timing bounds)."""
    # The control arm ran in every pair and burst pair, with the same work (identical output
    # in every pair: a relay that dropped or changed bytes would not give it), and its
    # figures are reported against direct and under the gateway's; no timing is asserted.
    control = result["control"]
    assert result["parameters"]["control"] == "byte-proxy" and control["kind"] == "byte-proxy"
    assert len(result["ttft_ms"]["byte_proxy"]) == pairs
    assert control["same_output_pairs"] == pairs
    assert control["added_ttft_ms"]["pairs"] == control["added_total_ms"]["pairs"] == pairs
    assert len(result["burst_ttft_ms_median"]["byte_proxy"]) == rounds
    assert len(result["throughput_tok_s"]["byte_proxy"]) == rounds
    # the relay's CPU per round (process CPU ticks of 10 ms: a quick round may show 0)
    assert len(control["cpu_s_per_round"]) == rounds and min(control["cpu_s_per_round"]) >= 0
    for key in ("throughput_ratio", "burst_ttft_ratio"):
        assert control[key]["pairs"] == control["gateway_over_control"][key]["pairs"] == rounds
    assert control["gateway_over_control"]["added_ttft_ms"]["pairs"] == pairs


def test_bench_fairness_quick(benches: dict[str, object]) -> None:
    result, _ = _bench(benches, "fairness")
    assert result["capacity"]["cost_per_s"] > 0
    by_name = {w["name"]: w for w in result["workloads"]}
    assert set(by_name) == {"overload_1_2", "on_off", "short_long"}
    for workload in by_name.values():
        for policy in ("fcfs", "vtc"):
            data = workload["policies"][policy]
            assert data["throughput"]["output_tokens_per_s"] > 0
            assert all(t["started"] > 0 for t in data["tenants"].values()), data
    # No share is bounded here. A quick run is 6 s in 2 s windows with ~30 dispatch
    # decisions per policy, and on 2 cores beside the engine, two gateways and the load
    # generator its short_long figures swing with the machine: VTC minus FCFS (the short
    # tenant's share) in 12 s quick runs came out 0.23/0.23 on a quiet box (2026-12-02),
    # 0.09 and 0.29 with one busy-loop process beside it, and 0.09 and -0.01 in two CI
    # runs, while a VTC that orders as FCFS gives ~0: no bound separates the two in one
    # quick run. The order itself is checked without timing (tests/unit/test_fair_queue.py;
    # through a real gateway process, whose dispatch order an engine with one slot
    # records, in tests/gateway/test_fair_dispatch_http.py); the shares are measured by
    # the full 90 s bench (docs/benchmarks/fairness.md).
    for workload in by_name.values():
        for policy in ("fcfs", "vtc"):
            shares = [t["service_share"] for t in workload["policies"][policy]["tenants"].values()]
            assert abs(sum(shares) - 1) < 0.01 and all(0 < s < 1 for s in shares), workload


def test_bench_fleet_quick(benches: dict[str, object]) -> None:
    """The fleet bench runs end to end (two engines, four gateways: --quick leaves out the
    full run's idle third engine, tiny-code); its figures are measured in
    docs/benchmarks/fleet.md, not asserted here (a quick round is 4 s on 2 cores)."""
    result, _ = _bench(benches, "fleet")
    lone = result["lone"]
    assert set(lone["output_tokens_per_s"]) == {"direct", "by_hand", "pool", "pinned"}
    assert all(v[0] > 0 for v in lone["output_tokens_per_s"].values())
    assert lone["pool_over_direct"]["pairs"] == 1 and lone["pool_over_by_hand"]["pairs"] == 1
    for name, count in (("pair", 2), ("trio", 3)):
        assert len(result[name]["tenants"]) == count
        for routing in ("pool", "pinned"):
            shares = result[name][routing]["shares"]
            assert set(shares) == set(result[name]["tenants"])
            assert abs(sum(s["median"] for s in shares.values()) - 1) < 0.01
    assert all(us > 0 for n in result["choice_cost_us"].values() for us in n.values())
    # The paced tenant spread over both pool engines in both scenarios, the uneven one
    # with fewer streams on the second; its rate is measured, not bounded from below here.
    paced = result["paced"]
    for name in ("even", "uneven"):
        for r in paced[name]["rounds"]:
            assert len(r["placement"]) == 2 and all(r["placement"]), r
            assert r["rate_over_r"] > 0
    # Twelve streams, the first engine filled (8 on it) before any spilled. Not exactly
    # [8, 4]: on a loaded host a long stream's request can reach the gateway after a short
    # one has ended on the first engine, and then takes its place there ([9, 3] in CI).
    counts = [len(p) for p in paced["uneven"]["rounds"][0]["placement"]]
    assert sum(counts) == 12 and max(counts) >= 8, paced["uneven"]["rounds"][0]


def test_bench_mix_quick(benches: dict[str, object]) -> None:
    """The mixed load runs end to end: two engines, four gateways (one per arm), four
    tenants of different shapes, each served, figures in their ranges. No figure is bounded
    by timing: a quick arm has 8 s of window on 2 shared cores, where a tenant's one long
    request may wait through all of it; the goals (shares within 0.05, VTC's throughput
    against FCFS's) are measured by the full run (docs/benchmarks/mix.md)."""
    result, _ = _bench(benches, "mix")
    arms = result["arms"]
    assert set(arms) == {"vtc", "fcfs", "vtc_weighted", "vtc_lanes"}
    slots = 2 * result["parameters"]["max_inflight_per_engine"]
    for name, arm in arms.items():
        tenants = arm["tenants"]
        assert set(tenants) == {"short", "context", "generation", "agent"}, name
        assert abs(sum(t["service_share"] for t in tenants.values()) - 1) < 0.01, name
        assert all(t["service_share"] >= 0 for t in tenants.values()), name
        assert arm["output_tokens_per_s"] > 0 and arm["cost_per_s"] > 0, name
        assert 0 <= arm["mean_running"] <= slots and not arm["failed_requests"], name
        # None: no request that arrived in the window was dispatched in it (on a loaded
        # host the first long requests can hold every slot through a quick arm's 8 s)
        assert arm["prefix_hit_rate"] is None or 0 <= arm["prefix_hit_rate"] < 1, name
    for tenant in ("short", "context", "generation", "agent"):
        assert max(a["tenants"][tenant]["service_share"] for a in arms.values()) > 0, tenant
    # the shared document and the agents' tasks are found in the engines' prefix caches
    assert max(a["prefix_hit_rate"] or 0 for a in arms.values()) > 0
    assert max(a["engine_tokens_per_s"] or 0 for a in arms.values()) > 0
    assert arms["vtc_weighted"]["tenants"]["short"]["weight_share"] == 0.4
    assert set(result["goals"][0]) >= {"vtc_shares_met", "throughput_vtc_over_fcfs",
                                       "prefix_hit_vtc_on_fcfs_mix_over_fcfs"}


def test_bench_adapters_quick(benches: dict[str, object]) -> None:
    """``bench fleet --workload adapters --quick``: six LoRA adapters over two real
    engines, three arms each serving every tenant; the gateway's own placement loaded the
    adapters it was sent (nothing was loaded before its arm). No figure is bounded by
    timing: the goals (loaded-hit >= 0.95, tokens/s against pinned) are the full run's
    (docs/benchmarks/adapters.md)."""
    result, _ = _bench(benches, "adapters")
    arms = result["arms"]
    assert set(arms) == {"any", "pinned", "placed"}
    for name, [run] in arms.items():
        assert run["requests"] > 0 and run["output_tokens_per_s"] > 0, name
        assert run["error_count"] == 0, (name, run["errors"])
        assert abs(sum(run["shares"].values()) - 1) < 0.01, name
        assert all(share > 0 for share in run["shares"].values()), name
    [placed] = arms["placed"]
    assert 0 <= placed["loaded_hit"] <= 1 and placed["loads_per_minute"] > 0
    assert set(result["goals"]) >= {"loaded_hit_met", "shares_met",
                                    "throughput_placed_over_pinned_met"}


@pytest.mark.postgres
@pytest.mark.no_timing  # the last bench, alone by then: the next module's engines start beside it
def test_bench_metering_quick(benches: dict[str, object]) -> None:
    """Through a gateway SIGKILL, a Postgres outage, clients leaving mid-stream and two
    bad model names, the ledger holds exactly what the engines counted (their books of
    ended requests, what the gateway asks them), per tenant and per request. The event
    logs count one token more for a request aborted while a step of it ran (vLLM drops
    that step's token); every difference from them must be exactly that.

    Cost: about a minute on a 2-core machine, most of it the two engines' start-ups (its
    own, not shared with other tests) and 14 s of load; the first to deselect when CI time
    runs short (``-k "not metering"``)."""
    result, _ = _bench(benches, "metering")  # needs a Postgres (skips, or fails in CI)
    summary = {k: result[k] for k in ("tenants", "to_event_logs", "to_engine_books",
                                      "aborted_with_a_step_in_flight", "faults", "clients")}
    assert result["exact_to_engine_books"], summary
    for tenant in result["tenants"].values():
        assert tenant["engine_book_tokens"] == tenant["ledger_tokens"] > 0, summary
        assert 0 <= tenant["missing_tokens"] <= tenant["engine_requests"], summary
    logs = result["to_event_logs"]
    assert logs["client_ids_without_row"] == logs["engine_requests_without_row"] == 0, summary
    # each row that differs from the event log is one step in flight at its abort: +1
    assert logs["rows_count_differs"] == logs["rows_count_differs_tokens"] \
        <= result["aborted_with_a_step_in_flight"], summary
    assert result["book_differs_otherwise"] == 0, summary
    assert result["ids_twice"] == result["estimated_rows"] == 0, summary
    assert result["dead_letter_rows"] == result["unwritten_rows"] == 0, summary
    # the faults happened: a kill with the gateway back, the outage, clients that left
    [kill] = result["faults"]["kills"]
    assert kill["answering_after_s"] < 60 and result["faults"]["postgres_outage"], summary
    assert result["clients"]["with_request_id"] > 0, summary
    for bad in result["bad_models"]:  # refused, recorded, with no model name
        # an unknown model (404); the 6 MiB name may be refused for its length first (400,
        # a gateway that bounds model names)
        refused = (404,) if bad["model_chars"] < 256 else (400, 404)
        assert bad["status"] in refused and bad["row"] is not None, bad
        assert bad["row"]["model_chars"] == 0 and not bad["row"]["served"], bad

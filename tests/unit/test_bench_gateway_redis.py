"""`bench gateway --state redis`: the Redis gateway's configuration, its figures taken in
the same pairs as the in-process gateway's (what Redis adds is a per-pair difference), the
existing keys unchanged, and a clear error when redis-server is missing.

Fake records and CPU readings: no server, no timing."""

from __future__ import annotations

import os
from dataclasses import replace
import socket
import subprocess
import sys
from pathlib import Path

from tokenpace.bench._load import StreamRecord
from tokenpace.bench._redis_server import Usage
from tokenpace.bench.gateway import (
    DIRECT_SALT,
    REDIS_PATH,
    _Bursts,
    _Cpu,
    gateway_config,
    figures,
)
from tokenpace.gateway import load_config

# The top-level keys of the in-process run, which tests/e2e/test_bench_quick.py and the
# docs read: the Redis path adds a key, it changes none of these.
IN_PROCESS_KEYS = {
    "benchmark", "latency", "added_ttft_ms", "added_total_ms", "same_output_pairs",
    "gateway_cpu_ms_per_request", "gateway_cpu_us_per_chunk", "gateway_cpu_us_per_chunk_gross",
    "gateway_cpu_ms_per_request_fast_upstream", "throughput_tok_s", "throughput_ratio",
    "burst_ttft_ms_median", "burst_ttft_ratio", "burst_in_gateway",
    "load_generator_cpu_s_per_round", "requests_per_gateway_cpu_second", "ttft_ms",
}


def test_the_redis_gateway_is_the_same_gateway_with_state_in_redis(tmp_path: Path) -> None:
    plain, shared = tmp_path / "plain.yaml", tmp_path / "shared.yaml"
    plain.write_text(gateway_config("http://127.0.0.1:9", tmp_path / "a.db"))
    shared.write_text(gateway_config("http://127.0.0.1:9", tmp_path / "b.db",
                                      "redis://127.0.0.1:6390/0"))
    a, b = load_config(plain), load_config(shared)
    assert not a.state.shared
    assert b.state.url == "redis://127.0.0.1:6390/0" and b.state.timeout_s == 2.0
    assert b.state.on_failure == "closed"
    # the same engine and tenant (identity, limits); its salt differs, so that neither
    # gateway finds the other's prompt of a pair in the engine's cache, nor direct's
    assert a.engines == b.engines
    (ta,), (tb,) = a.tenants, b.tenants
    assert ta.id == tb.id == "bench"
    assert replace(ta, key_hashes=tb.key_hashes) == tb
    assert len({ta.cache_salt, tb.cache_salt, DIRECT_SALT}) == 3
    assert len(tb.cache_salt or "") == len(DIRECT_SALT)


def _records(phases: list[float], cost_ms: float, tokens: list[int]) -> list[StreamRecord]:
    """One record per pair: the engine's phase (shared by all paths) plus the path's cost."""
    return [StreamRecord(user="bench", start=0.0, token_times=[(p + cost_ms) / 1000,
                                                                (p + cost_ms + 4) / 1000],
                         token_ids=list(tokens)) for p in phases]


def _measurements(redis: bool) -> tuple[dict, _Bursts, _Cpu, dict]:
    phases = [5.0] * 7 + [21.0] * 9 + [60.0] * 4  # the engine's phases, met by every path
    paths = {"direct": 0.0, "gateway": 1.0, **({REDIS_PATH: 3.0} if redis else {})}
    seq = {path: _records(phases, cost, [7, 8]) for path, cost in paths.items()}
    gateways = [p for p in paths if p != "direct"]
    bursts = _Bursts.empty(list(paths), gateways)
    for direct_rate in (8000.0, 2000.0, 5000.0):
        for path in paths:
            bursts.rates[path].append(direct_rate * {"direct": 1.0, "gateway": 0.8,
                                                     REDIS_PATH: 0.6}[path])
            bursts.ttft[path].append(0.05 * {"direct": 1.0, "gateway": 1.2, REDIS_PATH: 1.5}[path])
            bursts.client_cpu.append(0.01)
        for path in gateways:
            bursts.cpu_gross[path].append(({"gateway": 0.04, REDIS_PATH: 0.06}[path], 4096))
        if redis:  # 1 us per chunk; 2 commands per request of the 32-stream round
            bursts.store.append((Usage(0.004096, 64), 4096))
    cpu = _Cpu({p: [] for p in gateways}, {p: [] for p in gateways})
    for machine in (1.0, 1.5, 1.2):  # the machine's load moves both gateways alike
        cpu.per_request["gateway"].append(0.0008 * machine)
        cpu.per_core["gateway"].append(2500 / machine)  # 0.4 ms per request
        if redis:
            cpu.per_request[REDIS_PATH].append(0.0008 * machine + 0.0003)
            cpu.per_core[REDIS_PATH].append(1000 / (0.4 * machine + 0.25))
            cpu.store.append((Usage(0.02, 400), 200))  # 0.1 ms and 2 commands per request
            cpu.store_fast.append((Usage(0.32, 8400), 4000))
            cpu.store_idle_per_s.append(0.0002)
    in_gateway = {p: {"queue_ms_max": [0.1] * 3} for p in gateways}
    return seq, bursts, cpu, in_gateway


def test_in_process_run_keeps_its_keys_and_has_no_redis_section() -> None:
    result = figures(*_measurements(redis=False), streams=32)
    assert set(result) == IN_PROCESS_KEYS
    assert result["added_ttft_ms"]["p50"]["value"] == 1.0
    assert result["same_output_pairs"] == 20


def test_redis_figures_are_paired_with_direct_and_with_the_in_process_gateway() -> None:
    result = figures(*_measurements(redis=True), streams=32)
    assert set(result) == IN_PROCESS_KEYS | {"redis"}
    # the in-process figures are the same as without the third path
    alone = figures(*_measurements(redis=False), streams=32)
    for key in ("added_ttft_ms", "gateway_cpu_ms_per_request", "throughput_ratio",
                "gateway_cpu_us_per_chunk", "requests_per_gateway_cpu_second"):
        assert result[key] == alone[key], key
    assert set(result["ttft_ms"]) == set(result["latency"]) == {"direct", "gateway", REDIS_PATH}
    redis = result["redis"]
    # the same figures, under the same names, for the Redis gateway against direct
    per_arm = IN_PROCESS_KEYS - {
        "benchmark", "latency", "throughput_tok_s", "burst_ttft_ms_median",
        "load_generator_cpu_s_per_round", "ttft_ms"}
    assert per_arm <= set(redis)
    assert redis["added_ttft_ms"]["p50"]["value"] == 3.0
    assert redis["same_output_pairs"] == 20
    # what Redis adds: within each pair, against the in-process gateway (the engine's
    # phases, 5 to 60 ms, cancel), not against direct
    adds = redis["redis_adds_ttft_ms"]
    assert adds["pairs"] == 20 and adds["p50"]["value"] == 2.0
    assert adds["p50"]["interval95"] == [2.0, 2.0]
    assert redis["throughput_ratio"]["median"] == 0.6
    assert redis["throughput_ratio_to_gateway"]["median"] == 0.75
    assert redis["burst_ttft_ratio_to_gateway"]["median"] == 1.25
    # gateway CPU: Redis's share per round, the machine's load cancelling within a round
    assert redis["gateway_cpu_ms_added_per_request"]["values"] == [0.3, 0.3, 0.3]
    assert redis["gateway_cpu_ms_added_per_request_fast_upstream"]["median"] == 0.25
    assert redis["gateway_cpu_ms_per_request_fast_upstream"]["values"] == [0.65, 0.85, 0.73]
    # the Redis server's own CPU, apart from the gateway's
    assert redis["redis_server_cpu_ms_per_request"]["median"] == 0.1
    assert redis["redis_server_cpu_ms_per_request_fast_upstream"]["median"] == 0.08
    assert redis["redis_server_cpu_us_per_chunk_gross"]["median"] == 1.0
    assert redis["redis_server_cpu_ms_per_s_idle"]["median"] == 0.2
    assert redis["redis_commands_per_request"]["median"] == 2.0
    assert redis["redis_commands_per_request_fast_upstream"]["median"] == 2.1
    assert redis["redis_commands_per_request_burst"]["median"] == 2.0
    # net CPU per chunk of the Redis gateway uses its own per-request CPU
    assert redis["gateway_cpu_us_per_chunk_gross"]["median"] == round(0.06 / 4096 * 1e6, 1)


def test_redis_usage_between_two_readings_leaves_out_the_first_reading() -> None:
    # Redis counts a command after it ran: the later INFO counts the earlier one.
    before, after = Usage(1.5, 100), Usage(1.75, 103)
    assert after.since(before) == Usage(0.25, 2)


def test_missing_redis_server_is_a_cli_error_that_names_the_flag(tmp_path: Path) -> None:
    # An empty PATH: no redis-server. The check runs before the engine starts (and before
    # the tiny model is written to the cache given here).
    env = dict(os.environ, PATH=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "tokenpace.cli", "bench", "gateway",
                           "--state", "redis", "--quick"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert "tokenpace bench gateway: error: --state redis needs redis-server" in done.stderr
    assert "--redis URL" in done.stderr
    assert not (tmp_path / "cache").exists()


def test_unreachable_redis_url_is_a_cli_error_before_anything_starts(tmp_path: Path) -> None:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "tokenpace.cli", "bench", "gateway", "--redis",
                           f"redis://127.0.0.1:{port}/0", "--quick"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "tokenpace bench gateway: error: --redis: cannot use this Redis" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cache").exists()

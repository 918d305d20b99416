"""LoRA adapters through the gateway over two real vLLM engines of the tiny model
(``tokenpace serve --enable-lora --max-loras 2``, run-time loading allowed), with adapters
the project writes itself (``tiny_model.write_tiny_adapter``; no hub).

What only real engines show: the gateway loads an adapter through vLLM's
``/v1/load_lora_adapter`` on the engine it sends the request to, and the engine then
lists it; a sixth adapter over two engines of two places each makes the gateway unload
the least recently used one (the engines never list more than two); a tenant's own adapter
is a 404 for others; the ledger row names the adapter, charged at its base's cost; the
prompt of a capped tenant is counted by its base on an engine that does not hold it; two
replicas sharing Redis send an adapter one of them loaded to where it is loaded, at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests._engine_pool import ModuleEngines
from tests._redis import RedisServer
from tests._servers import Server, free_port, tokenpace_serve_argv
from tests.gateway.conftest import GatewayProcess
from tokenpace.tiny_model import write_tiny_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.no_timing]  # no time bound is asserted here

OWNER, OTHER = "sk-lora-owner", "sk-lora-other"
ADAPTERS = [f"ad{i}" for i in range(6)]
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
              "--max-cpu-loras", "4")


def ENGINES(tiny_model: Path, home: Path) -> list[Server]:  # noqa: N802 (tests/_engine_pool.py)
    for i, name in enumerate(ADAPTERS):
        write_tiny_adapter(home / name, seed=i)
    servers = []
    for n in range(2):
        port = free_port()
        servers.append(Server(tokenpace_serve_argv(tiny_model, port, *LORA_FLAGS), port,
                              home / f"vllm-{n}.log",
                              env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}))
    return servers


@pytest.fixture(scope="module")
def engines(module_engines: ModuleEngines) -> tuple[list[Server], Path]:
    return module_engines.servers, module_engines.home


def gateway_config(engines: tuple[list[Server], Path], home: Path) -> dict[str, Any]:
    servers, adapters_home = engines
    return {
        "engines": [{"url": s.base_url, "max_inflight": 8, "max_adapters": 2}
                    for s in servers],
        "models": [{"name": "tiny", "cost": {"prompt": 0.5, "completion": 2.0}}],
        "adapters": [{"name": name, "base": "tiny", "path": str(adapters_home / name),
                      **({"tenants": ["owner"]} if name == "ad0" else {})}
                     for name in ADAPTERS],
        "ledger": f"sqlite:///{home / 'usage.db'}",
        "tenants": [{"id": "owner", "api_keys": [OWNER], "max_input_tokens": 200,
                     "budgets": [{"tokens": 100000, "per": "1d"}]},
                    {"id": "other", "api_keys": [OTHER]}],
    }


@pytest.fixture(scope="module")
def gateway(engines: tuple[list[Server], Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    home = tmp_path_factory.mktemp("lora-gateway")
    gw = GatewayProcess(home, gateway_config(engines, home)).start()
    try:
        yield gw
    finally:
        gw.stop()


def listed(server: Server) -> set[str]:
    data = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def complete(gw: GatewayProcess, key: str, model: str) -> openai.types.Completion:
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=60)
    return api.completions.create(model=model, prompt="the lamp in the window",
                                  max_tokens=4)


def test_an_adapter_is_loaded_where_its_request_goes_and_charged_as_its_base(
        engines: tuple[list[Server], Path], gateway: GatewayProcess) -> None:
    servers, _ = engines
    assert all(not listed(s) for s in servers), "nothing loaded before its first request"
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=OWNER, max_retries=0, timeout=60)
    raw = api.completions.with_raw_response.create(model="ad0", prompt="the lamp",
                                                   max_tokens=4)
    out = raw.parse()
    assert out.model == "ad0" and out.usage.completion_tokens == 4
    holders = [s for s in servers if "ad0" in listed(s)]
    assert len(holders) == 1, "loaded on the engine the request went to, only there"
    row = gateway.row(raw.headers["x-request-id"])
    assert (row.tenant, row.model, row.served) == ("owner", "ad0", True)
    assert row.cost == pytest.approx(0.5 * out.usage.prompt_tokens + 2.0 * 4)
    # The owner's tenant was counted before dispatch (max_input_tokens): by its base,
    # on an engine that need not hold the adapter; the count matches the engine's usage.
    assert row.prompt_tokens == out.usage.prompt_tokens
    # Sent again: it stays where it is loaded (nothing else in flight), no second load.
    loads = gateway.metric("tokenpace_gateway_adapter_loads_total", outcome="ok") or 0
    for _ in range(3):
        assert complete(gateway, OWNER, "ad0").model == "ad0"
    assert (gateway.metric("tokenpace_gateway_adapter_loads_total", outcome="ok") or 0) == loads
    assert gateway.metric("tokenpace_gateway_adapter_dispatches_total", adapter="ad0",
                          loaded="true") == 3


def test_a_tenants_own_adapter_is_not_found_for_another_and_listed_for_it(
        gateway: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        complete(gateway, OTHER, "ad0")
    assert err.value.code == "model_not_found"
    mine = httpx.get(f"{gateway.url}/v1/models", headers={"authorization": f"Bearer {OWNER}"},
                     timeout=10).json()["data"]
    theirs = httpx.get(f"{gateway.url}/v1/models",
                       headers={"authorization": f"Bearer {OTHER}"}, timeout=10).json()["data"]
    by_id = {m["id"]: m for m in mine}
    assert by_id["ad0"]["parent"] == "tiny" and by_id["ad1"]["root"] == "tiny"
    assert "ad0" not in {m["id"] for m in theirs} and "ad5" in {m["id"] for m in theirs}


def test_more_adapters_than_places_evict_the_least_recently_used(
        engines: tuple[list[Server], Path], gateway: GatewayProcess) -> None:
    servers, _ = engines
    for name in ADAPTERS[1:]:  # five more over two engines of two places each
        assert complete(gateway, OWNER, name).model == name
        assert all(len(listed(s)) <= 2 for s in servers), [listed(s) for s in servers]
    assert (gateway.metric("tokenpace_gateway_adapter_unloads_total") or 0) >= 2
    held = set().union(*(listed(s) for s in servers))
    assert ADAPTERS[-1] in held and len(held) == 4
    # An evicted adapter is served again: loaded back where it costs least.
    gone = next(name for name in ADAPTERS if name not in held)
    assert complete(gateway, OWNER, gone).model == gone
    assert any(gone in listed(s) for s in servers)
    assert not gateway.metric("tokenpace_gateway_adapter_loads_total", outcome="failed")


def wait_word(redis: RedisServer, url: str, adapter: str) -> None:
    """Until some replica's word on ``adapter`` at engine ``url`` is in Redis (its share
    sends one every 0.25 s; bounded at 30 s for a loaded host)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url, decode_responses=True)
    deadline = time.monotonic() + 30
    while not any(f.startswith(f"{adapter}|") for f in client.hgetall(f"tokenpace:a:{url}")):
        assert time.monotonic() < deadline, "no replica's word on the adapter reached Redis"
        time.sleep(0.05)
    client.close()


def test_replicas_send_an_adapter_one_loaded_to_where_it_is(
        engines: tuple[list[Server], Path], gateway: GatewayProcess, tmp_path: Path) -> None:
    """Two more replicas over the same engines, sharing a ``redis-server``: an adapter
    that neither engine holds is loaded by one replica; the other's requests for it, sent
    at once (well before its next health check could list it), go to that engine: no
    second load, and only one engine lists it."""
    servers, _ = engines
    redis = RedisServer(tmp_path / "redis").start()
    replicas: list[GatewayProcess] = []
    try:
        for n in range(2):
            home = tmp_path / f"replica-{n}"
            home.mkdir()
            config = gateway_config(engines, home)
            config["state"] = {"url": redis.url, "timeout": "1s"}
            replicas.append(GatewayProcess(home, config).start())
        r0, r1 = replicas
        held = set().union(*(listed(s) for s in servers))
        name = next(n for n in ADAPTERS[1:] if n not in held)
        assert complete(r0, OWNER, name).model == name
        assert r0.metric("tokenpace_gateway_adapter_loads_total", outcome="ok") == 1
        holders = [s for s in servers if name in listed(s)]
        assert len(holders) == 1
        wait_word(redis, holders[0].base_url, name)  # r0's word, at the source
        for _ in range(3):
            assert complete(r1, OWNER, name).model == name
        assert not r1.metric("tokenpace_gateway_adapter_loads_total", outcome="ok")
        assert r1.metric("tokenpace_gateway_adapter_dispatches_total", adapter=name,
                         loaded="true") == 3
        assert [s for s in servers if name in listed(s)] == holders
    finally:
        for gw in replicas:
            gw.stop()
        redis.stop()

"""Engines that join and leave a running gateway: a reload's engine list, and
engines named by DNS (``engines[].discovery: dns``), one per address, re-resolved. The real
Dispatcher, a fake clock, and an injected resolver in place of DNS."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tokenpace.gateway import ConfigError, parse_config
from tokenpace.gateway.config import EngineConfig, keep_engine_keys
from tokenpace.gateway.dispatch import Dispatcher
from tokenpace.gateway.fleet import Discovery, engine_at
from tokenpace.gateway.tenants import Tenants

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


def config(*engines: object, **top: object):  # type: ignore[no-untyped-def]
    return parse_config({
        "engines": list(engines),
        "tenants": [{"id": f"t{i}", "api_keys": [f"k{i}"]} for i in range(40)],
        "ledger": "sqlite:///unused.db", **top,
    })


def chat(url: str, **more: object) -> dict[str, object]:
    return {"url": url, "max_inflight": 2, "models": ["chat"], **more}


def setup(*urls: str) -> tuple[Dispatcher, Tenants]:
    cfg = config(*(chat(u) for u in urls))
    return Dispatcher(cfg, lambda: 100.0), Tenants(cfg, lambda: 100.0)


# -- the dispatcher's engine list ---------------------------------------------------------


def test_an_engine_added_joins_its_pool_and_takes_requests_at_once() -> None:
    async def main() -> None:
        dispatcher, tenants = setup(A)
        pool = dispatcher.pools["chat"]
        tenant = tenants.get("t0")
        full = [await dispatcher.acquire(tenant, pool, 5.0, 1.0, 1.0) for _ in range(2)]
        waiting = asyncio.ensure_future(dispatcher.acquire(tenant, pool, 5.0, 1.0, 1.0))
        await asyncio.sleep(0)
        assert not waiting.done()  # A is full
        added, removed = dispatcher.fleet.set_engines(config(chat(A), chat(C)).engines)
        assert [e.url for e in added] == [C] and removed == []
        assert [e.url for e in pool.engines] == [A, C]
        assert (await waiting).engine.url == C  # the waiter went as C joined
        for w in [*full, waiting.result()]:
            dispatcher.release(w)
    asyncio.run(main())


def test_an_engine_removed_gets_nothing_new_and_its_requests_finish() -> None:
    async def main() -> None:
        dispatcher, tenants = setup(A, B)
        pool = dispatcher.pools["chat"]
        running = [await dispatcher.acquire(tenants.get(f"t{i}"), pool, 5.0, 1.0, 1.0)
                   for i in range(4)]
        gone = next(e for e in dispatcher.engines if e.url == B)
        assert gone.inflight == 2
        added, removed = dispatcher.fleet.set_engines(config(chat(A)).engines)
        assert added == [] and removed == [gone]
        assert [e.url for e in pool.engines] == [A] and gone.pools == []
        assert [e.url for e in dispatcher.engines] == [A]
        for waiter in running:  # B's requests finish and release their slots as usual
            dispatcher.release(waiter)
        assert gone.inflight == 0
        for i in range(40):  # every tenant's next request goes to A
            waiter = await dispatcher.acquire(tenants.get(f"t{i}"), pool, 5.0, 1.0, 1.0)
            assert waiter.engine.url == A
            dispatcher.release(waiter)
    asyncio.run(main())


def test_adding_an_engine_moves_only_the_tenants_whose_first_engine_it_is() -> None:
    """Rendezvous hashing: a tenant keeps its engine unless the new one ranks first for it
    (about 1/N of tenants), so prefix caches mostly stay warm."""
    dispatcher, _ = setup(A, B)
    pool = dispatcher.pools["chat"]
    before = {f"t{i}": dispatcher.engine_for(f"t{i}", pool).url for i in range(40)}
    dispatcher.fleet.set_engines(config(chat(A), chat(B), chat(C)).engines)
    after = {t: dispatcher.engine_for(t, pool).url for t in before}
    moved = [t for t in before if after[t] != before[t]]
    assert moved and all(after[t] == C for t in moved)
    assert len(moved) < 30  # 40/3 expected


def test_a_kept_engine_takes_its_new_settings_and_keeps_its_state() -> None:
    dispatcher, _ = setup(A)
    engine = dispatcher.engines[0]
    engine.learned_capacity = 7
    dispatcher.fleet.set_engines(config(chat(A, max_inflight=9)).engines)
    assert dispatcher.engines == [engine]
    assert engine.config.max_inflight == 9 and engine.learned_capacity == 7


def test_an_engine_without_models_waits_to_be_learned_then_joins() -> None:
    dispatcher, _ = setup(A)
    added, _ = dispatcher.fleet.set_engines(config(chat(A), {"url": C}).engines)
    assert dispatcher.fleet.unlearned() == added
    assert [e.url for e in dispatcher.pools["chat"].engines] == [A]
    dispatcher.fleet.set_models(added[0], frozenset({"chat"}))
    assert [e.url for e in dispatcher.pools["chat"].engines] == [A, C]


# -- configuration ------------------------------------------------------------------------


def test_engine_keys_are_kept_by_url_when_engines_are_added_or_removed() -> None:
    running = config(chat(A, api_key="ka"), chat(B, api_key="kb"))
    reloaded = keep_engine_keys(config(chat(C, api_key="kc"), chat(B)), running)
    assert [(e.url, e.api_key) for e in reloaded.engines] == [(C, "kc"), (B, "kb")]
    with pytest.raises(ConfigError, match=r"engines\[1\].api_key"):
        keep_engine_keys(config(chat(C), chat(B, api_key="other")), running)


@pytest.mark.parametrize("entry, message", [
    ({"url": "http://engines:8000", "discovery": "srv"}, r"engines\[0\].discovery: expected 'dns'"),
    ({"url": "https://engines:8000", "discovery": "dns"}, r"needs a plain http://host:port"),
    ({"url": "http://engines:8000/v1", "discovery": "dns"}, r"needs a plain http://host:port"),
])
def test_discovery_settings_are_checked(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(entry)


def test_discovery_interval_is_a_duration() -> None:
    assert config(chat(A), discovery_interval="30s").discovery_interval_s == 30.0
    assert config(chat(A)).discovery_interval_s == 10.0
    with pytest.raises(ConfigError, match="discovery_interval"):
        config(chat(A), discovery_interval="soon")


# -- DNS discovery ------------------------------------------------------------------------


class Resolver:
    """DNS as a test sets it: a name's addresses, or an error."""

    def __init__(self) -> None:
        self.names: dict[str, list[str] | Exception] = {}
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.names[host]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


NAMED = {"url": "http://vllm.ns.svc:8000", "discovery": "dns", "max_inflight": 3,
         "models": ["chat"], "api_key": "sk-e"}


def test_each_address_of_a_name_is_an_engine_with_the_entrys_settings() -> None:
    resolver = Resolver()
    resolver.names["vllm.ns.svc"] = ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::5"]
    cfg = config(chat(A), NAMED)
    engines = asyncio.run(Discovery(resolver).engines(cfg.engines))
    assert [e.url for e in engines] == [A, "http://10.0.0.1:8000", "http://10.0.0.2:8000",
                                        "http://[fd00::5]:8000"]
    assert resolver.asked == [("vllm.ns.svc", 8000)]
    found = engines[1]
    assert (found.max_inflight, found.models, found.api_key, found.discovery,
            found.discovered_from) == (3, ("chat",), "sk-e", None, "http://vllm.ns.svc:8000")
    assert found == engine_at(cfg.engines[1], "10.0.0.1")


def test_addresses_come_and_go_with_the_answers() -> None:
    resolver = Resolver()
    discovery = Discovery(resolver)
    cfg = config(NAMED)
    resolver.names["vllm.ns.svc"] = ["10.0.0.1", "10.0.0.2"]
    first = asyncio.run(discovery.engines(cfg.engines))
    resolver.names["vllm.ns.svc"] = ["10.0.0.2", "10.0.0.3"]  # a pod replaced
    second = asyncio.run(discovery.engines(cfg.engines))
    assert [e.url for e in first] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert [e.url for e in second] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def test_a_failed_resolution_keeps_the_last_answer_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    resolver = Resolver()
    discovery = Discovery(resolver, timeout_s=0.05)
    cfg = config(NAMED)
    resolver.names["vllm.ns.svc"] = ["10.0.0.1", "10.0.0.2"]
    good = asyncio.run(discovery.engines(cfg.engines))
    caplog.set_level(logging.WARNING, logger="tokenpace.gateway")
    for failure in (OSError("Name or service not known"), OSError("Name or service not known")):
        resolver.names["vllm.ns.svc"] = failure
        assert asyncio.run(discovery.engines(cfg.engines)) == good
    resolver.names["vllm.ns.svc"] = []  # an answer without an address: not trusted either
    assert asyncio.run(discovery.engines(cfg.engines)) == good

    async def never(host: str, port: int) -> list[str]:
        await asyncio.sleep(10)
        return []
    slow = Discovery(never, timeout_s=0.05)
    assert asyncio.run(slow.engines(cfg.engines)) == []  # nothing known yet: no engine
    warnings = [r.getMessage() for r in caplog.records if "cannot resolve" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once per failing streak and discovery
    assert "keeping its 2 engine(s)" in warnings[0]


def test_an_entry_a_reload_removed_is_forgotten_and_known_needs_no_resolution() -> None:
    resolver = Resolver()
    discovery = Discovery(resolver)
    resolver.names["vllm.ns.svc"] = ["10.0.0.1"]
    asyncio.run(discovery.engines(config(NAMED).engines))
    assert [e.url for e in discovery.known(config(NAMED, chat(A)).engines)] == [
        "http://10.0.0.1:8000", A]
    asyncio.run(discovery.engines(config(chat(A)).engines))
    assert discovery.known(config(NAMED).engines) == []


def test_a_real_name_resolves_through_the_system_resolver() -> None:
    """``localhost`` names this machine on every host (its IPv6 address may be there too)."""
    engines = asyncio.run(Discovery().engines(
        config({"url": "http://localhost:8000", "discovery": "dns"}).engines))
    assert "http://127.0.0.1:8000" in [e.url for e in engines]
    assert all(isinstance(e, EngineConfig) and e.discovered_from == "http://localhost:8000"
               for e in engines)


def test_an_engine_back_before_its_requests_ended_counts_them_in_its_slots() -> None:
    async def main() -> None:
        dispatcher, tenants = setup(A, B)
        pool = dispatcher.pools["chat"]
        running = [await dispatcher.acquire(tenants.get(f"t{i}"), pool, 5.0, 1.0, 1.0)
                   for i in range(4)]
        gone = next(e for e in dispatcher.engines if e.url == B)
        dispatcher.fleet.set_engines(config(chat(A)).engines)
        added, _ = dispatcher.fleet.set_engines(config(chat(A), chat(B)).engines)
        assert added == [gone] and gone.inflight == 2 and not gone.has_room()
        assert gone in pool.engines
        for waiter in running:
            dispatcher.release(waiter)
        # Gone again with nothing in flight: a later return is a fresh engine.
        dispatcher.fleet.set_engines(config(chat(A)).engines)
        dispatcher.fleet.set_engines(config(chat(A)).engines)
        added, _ = dispatcher.fleet.set_engines(config(chat(A), chat(B)).engines)
        assert added[0] is not gone and added[0].inflight == 0
    asyncio.run(main())

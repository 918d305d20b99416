"""Cache-local engine choice, in process: the conversation key and the
real Dispatcher's choice with it (a conversation's home within ``conversation_affinity`` of
the least loaded; a new conversation by its rendezvous order within ``pool_affinity``), and
what it leaves alone (the fair queue's order, paced and pinned tenants)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from tokenpace.gateway import ConfigError, parse_config
from tokenpace.gateway.dispatch import Dispatcher, Waiter
from tokenpace.gateway.tenants import Tenants
from tokenpace.gateway.wire import conversation_key, parse_request

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


# -- the key ------------------------------------------------------------------------------


def chat(*turns: str, system: str = "You are helpful.") -> Any:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return parse_request("chat", {"model": "m", "messages": messages})


def test_every_turn_of_a_conversation_has_its_key() -> None:
    first = conversation_key(chat("plan a trip"), "t")
    later = conversation_key(chat("plan a trip", "sure: where?", "Lisbon", "ok", "and back"), "t")
    assert first is not None and len(first) == 16 and first == later


def test_conversations_and_tenants_have_keys_of_their_own() -> None:
    base = conversation_key(chat("plan a trip"), "t")
    assert conversation_key(chat("write a poem"), "t") != base  # same system prompt
    assert conversation_key(chat("plan a trip", system="Be terse."), "t") != base
    assert conversation_key(chat("plan a trip"), "u") != base  # tenants' caches are apart


def test_a_re_encoded_body_keeps_its_key() -> None:
    a = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    b = parse_request("chat", {"messages": [{"content": "x", "role": "user"}], "model": "m"})
    assert conversation_key(a, "t") == conversation_key(b, "t")


def test_completions_responses_and_messages() -> None:
    opening = "a system prompt and a first question, " * 8  # 304 characters
    one = parse_request("completion", {"model": "m", "prompt": opening})
    two = parse_request("completion", {"model": "m", "prompt": opening + "an answer. more"})
    assert conversation_key(one, "t") == conversation_key(two, "t")  # the first 256 chars
    other = parse_request("completion", {"model": "m", "prompt": "another " + opening})
    assert conversation_key(other, "t") != conversation_key(one, "t")
    ids = parse_request("completion", {"model": "m", "prompt": list(range(100))})
    assert conversation_key(ids, "t") == conversation_key(
        parse_request("completion", {"model": "m", "prompt": list(range(64)) + [7]}), "t")
    batch = parse_request("completion", {"model": "m", "prompt": ["abc", "def"]})
    assert conversation_key(batch, "t") == conversation_key(
        parse_request("completion", {"model": "m", "prompt": "abc"}), "t")
    r1 = parse_request("responses", {"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": "hi"}]})
    r2 = parse_request("responses", {"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"}]})
    assert conversation_key(r1, "t") == conversation_key(r2, "t")
    m1 = parse_request("messages", {"model": "m", "max_tokens": 5, "system": "s", "messages": [
        {"role": "user", "content": "a"}]})
    m2 = parse_request("messages", {"model": "m", "max_tokens": 5, "system": "other",
                                    "messages": [{"role": "user", "content": "a"}]})
    assert conversation_key(m1, "t") != conversation_key(m2, "t")


# -- the choice ---------------------------------------------------------------------------


def setup(tenants: list[dict[str, Any]] | None = None, max_inflight: int = 16,
          **top: Any) -> tuple[Dispatcher, Tenants]:
    config = parse_config({
        "engines": [{"url": u, "max_inflight": max_inflight, "models": ["chat"],
                     "api_key": "sk-engine"} for u in URLS],
        "tenants": tenants or [{"id": "a", "api_keys": ["ka"]}, {"id": "b", "api_keys": ["kb"]}],
        "ledger": "sqlite:///unused.db", **top,
    })
    clock = lambda: 0.0  # noqa: E731
    return Dispatcher(config, clock), Tenants(config, clock)


def key(i: int, tenant: str = "a") -> bytes:
    found = conversation_key(chat(f"conversation {i}"), tenant)
    assert found is not None
    return found


def acquire(dispatcher: Dispatcher, tenants: Tenants, tenant: str,
            affinity: bytes | None) -> asyncio.Task[Waiter]:
    return asyncio.ensure_future(dispatcher.acquire(
        tenants.get(tenant), dispatcher.pools["chat"], 60.0, 1.0, 1.0, affinity=affinity))


def test_a_conversations_turns_stay_on_one_engine_while_it_has_room() -> None:
    """Twelve conversations, 32 slots: each conversation's eight turns land on one engine,
    and both engines get some. First all at once (each turn released before the next
    round), then one turn at a time in a different order each round (where a choice by
    tenant and load alone sends everything to the tenant's engine)."""
    async def main() -> None:
        dispatcher, tenants = setup()
        seen: dict[int, set[str]] = {i: set() for i in range(12)}
        for _ in range(8):
            turns = [acquire(dispatcher, tenants, "a", key(i)) for i in range(12)]
            await asyncio.sleep(0)
            for i, task in enumerate(turns):
                waiter = task.result()
                assert waiter.engine is not None
                seen[i].add(waiter.engine.url)
            for task in turns:
                dispatcher.release(task.result())
        order = list(range(12))
        for round_ in range(8):
            random.Random(round_).shuffle(order)
            for i in order:
                task = acquire(dispatcher, tenants, "a", key(i))
                await asyncio.sleep(0)
                waiter = task.result()
                assert waiter.engine is not None
                seen[i].add(waiter.engine.url)
                dispatcher.release(waiter)
        assert all(len(urls) == 1 for urls in seen.values()), seen
        per_engine = [sum(URLS[j] in urls for urls in seen.values()) for j in range(2)]
        # First turns placed within pool_affinity (2) of the least loaded: 12 split 6/6 to
        # 7/5 (by hash alone, 8/4 or worse 39% of the time).
        assert abs(per_engine[0] - per_engine[1]) <= 2, per_engine
    asyncio.run(main())


def first_engine_keys(dispatcher: Dispatcher, n: int) -> tuple[Any, list[bytes]]:
    """The engine key(0) hashes to, and ``n`` more keys that hash to it."""
    pool = dispatcher.pools["chat"]
    first = Dispatcher(dispatcher._config, lambda: 0.0)._conversation_engine(
        "a", pool, key(0))
    assert first is not None
    same = [k for k in (key(i) for i in range(1, 400))
            if Dispatcher(dispatcher._config, lambda: 0.0)._conversation_engine(
                "a", pool, k).url == first.url][:n]
    return next(e for e in pool.engines if e.url == first.url), same


async def turns_within(dispatcher: Dispatcher, tenants: Tenants, keys: list[bytes],
                       mine: Any, bound: int) -> tuple[int, int]:
    """A turn of each conversation in ``keys`` at once, each checked to leave ``mine`` at
    most ``bound`` (+1 for the turn just placed) ahead of the other engine; the two
    engines' counts in flight at the end (the turns are then cancelled)."""
    other = next(e for e in dispatcher.pools["chat"].engines if e is not mine)
    tasks = []
    for k in keys:
        tasks.append(acquire(dispatcher, tenants, "a", k))
        await asyncio.sleep(0)
        assert mine.inflight <= other.inflight + bound + 1, (mine.inflight, other.inflight)
    counts = (mine.inflight, other.inflight)
    for task in tasks:
        task.cancel()
    return counts


def test_new_conversations_are_placed_within_pool_affinity() -> None:
    """New conversations that all hash to one engine: it takes their first turns while it
    is at most ``pool_affinity`` (2) ahead of the other, the rest go to the other engine
    (nothing of a new conversation is cached yet: placed for balance)."""
    async def main() -> None:
        dispatcher, tenants = setup(pool_affinity=2, conversation_affinity=8)
        mine, same = first_engine_keys(dispatcher, 20)
        assert await turns_within(dispatcher, tenants, same, mine, 2) == (11, 9)
    asyncio.run(main())


def test_a_conversation_keeps_its_engine_within_conversation_affinity() -> None:
    """Conversations whose home is one engine: their turns stay there while it is at most
    ``conversation_affinity`` (3) ahead of the other, even with ``pool_affinity`` 0; past
    that a turn goes to the least loaded engine."""
    async def main() -> None:
        dispatcher, tenants = setup(pool_affinity=0, conversation_affinity=3)
        mine = dispatcher.pools["chat"].engines[0]
        keys = [key(i) for i in range(10)]
        for k in keys:
            dispatcher._remember_home("a", k, mine)
        assert await turns_within(dispatcher, tenants, keys, mine, 3) == (7, 3)
    asyncio.run(main())


def test_every_replica_makes_the_same_choice() -> None:
    """The order depends only on the key and the urls: two dispatchers (two replicas)
    send each conversation to the same engine at the same load."""
    one, _ = setup()
    two, _ = setup()
    for i in range(50):
        a = one._conversation_engine("a", one.pools["chat"], key(i))
        b = two._conversation_engine("a", two.pools["chat"], key(i))
        assert a is not None and b is not None and a.url == b.url


def test_a_down_engine_moves_only_its_conversations() -> None:
    dispatcher, _ = setup()
    pool = dispatcher.pools["chat"]
    before = {i: dispatcher._conversation_engine("a", pool, key(i)) for i in range(40)}
    down = pool.engines[0]
    dispatcher.fleet.set_health(down, False)
    for i, engine in before.items():
        now = dispatcher._conversation_engine("a", pool, key(i))
        assert now is not None and now is not down
        if engine is not down:
            assert now is engine


def test_tenant_locality_is_the_previous_choice() -> None:
    """``locality: tenant``: the key is ignored, the tenant's engine and pool_affinity
    decide (as test_pool_dispatch shows without a key)."""
    async def main() -> None:
        dispatcher, tenants = setup(locality="tenant", pool_affinity=2)
        pool = dispatcher.pools["chat"]
        first = dispatcher.preferred(tenants.get("a"), pool)
        tasks = [acquire(dispatcher, tenants, "a", key(i)) for i in range(6)]
        await asyncio.sleep(0)
        other = next(e for e in pool.engines if e is not first)
        assert first is not None and (first.inflight, other.inflight) == (4, 2)
        for task in tasks:
            task.cancel()
    asyncio.run(main())


def test_a_paced_tenant_keeps_its_engine_order() -> None:
    """A paced tenant fills its first engine whatever its conversations: all its
    conversations stay on one engine until it is full (its rate split moves no share), that
    is, up to the slots it keeps for other tenants (``reserved_slots``, 1 of 8 here)."""
    async def main() -> None:
        dispatcher, tenants = setup([{"id": "a", "api_keys": ["ka"],
                                      "output_tokens_per_second": 50}], max_inflight=8)
        first = dispatcher.engine_for("a", dispatcher.pools["chat"])
        tasks = [acquire(dispatcher, tenants, "a", key(i)) for i in range(7)]
        await asyncio.sleep(0)
        assert first.reserve == 1 and first.inflight == 7
        for task in tasks:
            task.cancel()
    asyncio.run(main())


def test_the_fair_queue_still_shares_by_weight() -> None:
    """Two backlogged tenants of weights 1 and 3, each request its own conversation: the
    engine choice comes after the fair queue's, so the slots still go 1:3."""
    async def main() -> None:
        dispatcher, tenants = setup([{"id": "a", "api_keys": ["ka"], "weight": 1},
                                     {"id": "b", "api_keys": ["kb"], "weight": 3}],
                                    max_inflight=2)
        waiting = [acquire(dispatcher, tenants, t, key(i, t)) for i in range(60) for t in "ab"]
        await asyncio.sleep(0)
        granted: dict[str, int] = {"a": 0, "b": 0}
        done: set[int] = set()
        for _ in range(40):
            for j, task in enumerate(waiting):
                if task.done() and j not in done:
                    done.add(j)
                    waiter = task.result()
                    granted[waiter.tenant.id] += 1
                    dispatcher.release(waiter)
                    break
            await asyncio.sleep(0)
        assert 0.18 <= granted["a"] / sum(granted.values()) <= 0.32, granted
        for task in waiting:
            task.cancel()
    asyncio.run(main())


def test_lanes_go_first_whatever_the_homes() -> None:
    """The engine is chosen after the fair queue chose the request: with both engines
    full, the slot that frees on the engine the waiting batch-lane turns call home goes
    to the interactive lane's new conversation first."""
    async def main() -> None:
        dispatcher, tenants = setup(
            [{"id": "bulk", "api_keys": ["kb"], "lane": "batch"},
             {"id": "live", "api_keys": ["kl"], "lane": "interactive"}], max_inflight=1,
            lanes=[{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 10}])
        home = dispatcher.pools["chat"].engines[0]
        bulk = [key(i, "bulk") for i in range(4)]
        for k in bulk:
            dispatcher._remember_home("a", k, home)
        running = [acquire(dispatcher, tenants, "bulk", k) for k in bulk[:2]]
        await asyncio.sleep(0)
        assert {t.result().engine.url for t in running} == set(URLS)  # home full: spilled
        waiting = [acquire(dispatcher, tenants, "bulk", k) for k in bulk[2:]]
        live = acquire(dispatcher, tenants, "live", key(9, "live"))
        await asyncio.sleep(0)
        assert not live.done() and not any(t.done() for t in waiting)
        dispatcher.release(next(t for t in running if t.result().engine is home).result())
        await asyncio.sleep(0)
        assert live.done() and live.result().engine is home
        assert not any(t.done() for t in waiting)
        for task in (*waiting, live):
            task.cancel()
    asyncio.run(main())


@pytest.mark.parametrize(("top", "message"), [
    ({"locality": "prefix"}, "locality: expected 'conversation'"),
    ({"locality": None}, "locality: expected 'conversation'"),
])
def test_bad_locality_settings_are_refused(top: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setup(**top)


def test_a_conversation_that_spilled_stays_where_it_went() -> None:
    """Its prefix is cached on the engine it spilled to: its next turns go there while
    that engine is within the bound, even once its first engine has room again."""
    async def main() -> None:
        dispatcher, tenants = setup(pool_affinity=0, conversation_affinity=0)
        conv = key(0)
        first = acquire(dispatcher, tenants, "a", conv)
        await asyncio.sleep(0)
        home = first.result().engine
        dispatcher.release(first.result())
        dispatcher._remember_home("a", key(1), home)  # another conversation of that engine
        held = acquire(dispatcher, tenants, "a", key(1))
        await asyncio.sleep(0)
        assert held.result().engine is home
        spilled = acquire(dispatcher, tenants, "a", conv)  # home 1 ahead of 0: spills
        await asyncio.sleep(0)
        assert spilled.result().engine is not home
        for task in (held, spilled):
            dispatcher.release(task.result())
        again = acquire(dispatcher, tenants, "a", conv)  # nothing in flight now
        await asyncio.sleep(0)
        assert again.result().engine is spilled.result().engine
        dispatcher.release(again.result())
    asyncio.run(main())


def test_the_remembered_conversations_are_bounded_per_tenant() -> None:
    """A tenant's conversations evict its own oldest homes, never another tenant's: tenant
    a opens 25 conversations under a bound of 10 per tenant and 15 in all; b's one home,
    made first, stays."""
    dispatcher, tenants = setup(max_conversation_homes=15, max_conversation_homes_per_tenant=10)

    async def main() -> None:
        for tenant, conversation in [("b", key(0, "b"))] + [("a", key(i)) for i in range(25)]:
            task = acquire(dispatcher, tenants, tenant, conversation)
            await asyncio.sleep(0)
            dispatcher.release(task.result())
    asyncio.run(main())
    assert len(dispatcher._homes) == 11
    assert list(dispatcher._homes.of("a")) == [key(i) for i in range(15, 25)]  # the latest kept
    assert list(dispatcher._homes.of("b")) == [key(0, "b")]

"""Conversation homes shared by replicas (``locality: conversation`` with
``state`` in Redis), against a real ``redis-server``: the engine one replica placed or moved
a conversation to is where every replica sends its next turns; a store that does not
answer costs the choice nothing but the other replicas' moves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tests._redis import RedisServer, require_redis_client
from tests.state._replicas import Replica, with_replicas

require_redis_client()

from tokenpace.gateway import parse_config  # noqa: E402
from tokenpace.gateway.dispatch import Lease  # noqa: E402
from tokenpace.gateway.wire import conversation_key, parse_request  # noqa: E402

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def config(**top: Any) -> Any:
    return parse_config({
        "engines": [{"url": u, "max_inflight": 16, "models": ["m"]} for u in URLS],
        "tenants": [{"id": "u", "api_keys": ["k"]}],
        "ledger": "sqlite:///unused.db",
        "pool_affinity": 0, "conversation_affinity": 0, **top,
    })


def key(i: int) -> bytes:
    found = conversation_key(parse_request("chat", {"model": "m", "messages": [
        {"role": "user", "content": f"conversation {i}"}]}), "u")
    assert found is not None
    return found


def run(redis_server: RedisServer, body: Callable[[list[Replica]], Awaitable[None]],
        **top: Any) -> None:
    """``body`` with two replicas' dispatchers, each with its own store connection."""
    with_replicas(redis_server, lambda: config(**top), body)


async def turn(rep: Replica, affinity: bytes | None) -> Lease:
    dispatcher, tenants, _ = rep
    return await dispatcher.lease(tenants.get("u"), dispatcher.pools["m"], 10.0, 1.0, 1.0,
                                  affinity=affinity).acquire()


def test_a_conversation_moved_by_one_replica_goes_there_at_every_replica(
        redis_server: RedisServer) -> None:
    """Replica 0 places a conversation, then moves it (its engine got busy); replica 1,
    which never saw it, sends its next turn to the engine it was moved to, and so does
    replica 0 after replica 1 moved it back."""
    async def body(reps: list[Replica]) -> None:
        (d0, _, s0), (d1, _, s1) = reps
        conv = key(0)
        first = await turn(reps[0], conv)
        home = first.engine
        first.release()
        # Another request of the tenant busy on the home engine: the next turn, one
        # request ahead with conversation_affinity 0, moves to the other engine.
        busy = await turn(reps[0], None)
        if busy.engine.url != home.url:  # the tenant's own engine is the other one
            extra = await turn(reps[0], None)
            busy.release()
            busy = extra
        assert busy.engine.url == home.url
        moved = await turn(reps[0], conv)
        assert moved.engine.url != home.url
        moved.release()
        busy.release()
        await s0.flush()  # the home goes with the store's next flush
        at_one = await turn(reps[1], conv)
        assert at_one.engine.url == moved.engine.url  # not where the key alone points
        at_one.release()
        # Replica 1 moves it back (its own request busy on the new home) ...
        held = [await turn(reps[1], None) for _ in range(2)]
        on_new = [w for w in held if w.engine.url == moved.engine.url]
        assert on_new
        for w in held:
            if w not in on_new:
                w.release()
        back = await turn(reps[1], conv)
        assert back.engine.url == home.url
        for w in (back, *on_new):
            w.release()
        await s1.flush()
        # ... and replica 0, whose own table still says the other engine, follows.
        again = await turn(reps[0], conv)
        assert again.engine.url == home.url
        again.release()
    run(redis_server, body)


def test_new_conversations_are_placed_once_for_every_replica(
        redis_server: RedisServer) -> None:
    """First turns are placed for balance (by load within pool_affinity); wherever one
    replica placed a conversation, the other sends its later turns there."""
    async def body(reps: list[Replica]) -> None:
        (d0, _, s0), (d1, _, _) = reps
        held = [await turn(reps[0], key(i)) for i in range(10)]
        placed = {i: w.engine.url for i, w in enumerate(held)}
        assert len(set(placed.values())) == 2  # spread by load, not all on one engine
        for w in held:
            w.release()
        await s0.flush()
        for i, url in placed.items():
            later = await turn(reps[1], key(i))
            assert later.engine.url == url, i
            later.release()
    run(redis_server, body)


def test_the_choice_goes_on_when_the_store_does_not_answer(
        redis_server: RedisServer) -> None:
    """With Redis gone (``on_state_failure: open`` would admit under fallback limits), a
    conversation's turn is placed from this replica's own table: the read fails fast and
    the turn stays where this replica sent the last one."""
    async def body(reps: list[Replica]) -> None:
        d0, _, s0 = reps[0]
        conv = key(3)
        first = await turn(reps[0], conv)
        first.release()
        await s0.flush()
        redis_server.stop()
        for _ in range(3):
            try:
                await d0._read_home("u", d0.pools["m"], conv)
            except Exception as exc:  # pragma: no cover - the assertion names it
                raise AssertionError(f"a failed read must not fail the choice: {exc!r}")
        engine = d0._conversation_engine("u", d0.pools["m"], conv)
        assert engine is not None and engine.url == first.engine.url
    run(redis_server, body)

"""LoRA adapters in the gateway, without an engine: the ``adapters`` section, what an
engine's /v1/models and /metrics say about them, the adapters an engine holds, where a
request for one goes, and loading it against a real HTTP server that answers as vLLM does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tokenpace.gateway import parse_config
from tokenpace.gateway.config import ConfigError, EngineConfig
from tokenpace.gateway.dispatch._adapter_share import AdapterShare
from tokenpace.gateway.fleet import (
    AdapterLoadFailed,
    AdapterNote,
    AdapterSet,
    EngineSlots,
    ensure_loaded,
    place_adapter,
)
from tokenpace.gateway.fleet._load import _MAX_LORA
from tokenpace.gateway.fleet._monitor import _model_ids


def _config(adapters: list[Any], **extra: Any) -> Any:
    return parse_config({
        "engines": [{"url": "http://127.0.0.1:1", "models": ["base"]}],
        "ledger": "sqlite:///unused.db",
        "models": [{"name": "base", "aliases": ["b"], "cost": {"prompt": 2, "completion": 3}}],
        "tenants": [{"id": "t", "api_keys": ["k"], "models": ["base", "mine"]}],
        "adapters": adapters, **extra,
    })


def test_adapters_section_parses_and_costs_fall_back_to_the_base() -> None:
    config = _config([{"name": "mine", "base": "b", "path": "/a/mine", "tenants": ["t"]},
                      {"name": "cheap", "base": "base", "path": "/a/cheap",
                       "cost": {"prompt": 0.5, "completion": 1}}])
    mine = config.adapter("mine")
    assert mine is not None and mine.base == "base" and mine.path == "/a/mine"
    assert mine.serves("t") and not mine.serves("other")
    assert config.adapter("cheap").serves("anyone")
    assert config.cost_of("mine") == config.cost_of("base")  # the base's own cost
    assert config.cost_of("cheap").prompt == 0.5
    assert config.adapter("base") is None and config.adapter_affinity == 4


@pytest.mark.parametrize("adapters, message", [
    ([{"base": "base", "path": "/p"}], "adapters[0].name: required"),
    ([{"name": "x", "path": "/p"}], "adapters[0].base: required"),
    ([{"name": "x", "base": "base"}], "adapters[0].path: required"),
    ([{"name": "x", "base": "base", "path": 3}], "adapters[0].path"),
    ([{"name": "b", "base": "base", "path": "/p"}], "already a model, an alias or an adapter"),
    ([{"name": "x", "base": "base", "path": "/p"}, {"name": "x", "base": "base", "path": "/q"}],
     "adapters[1].name"),
    ([{"name": "x", "base": "base", "path": "/p"}, {"name": "y", "base": "x", "path": "/q"}],
     "adapters[1].base"),
    ([{"name": "x", "base": "base", "path": "/p", "tenants": "t"}], "adapters[0].tenants"),
    ([{"name": "x", "base": "base", "path": "/p", "rank": 3}], "rank"),
])
def test_bad_adapters_are_refused_with_their_place(adapters: list[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _config(adapters)


def test_a_tenant_allow_list_may_name_an_adapter_but_not_an_unknown_model() -> None:
    with pytest.raises(ConfigError):
        _config([{"name": "other", "base": "base", "path": "/p"}])  # "mine" is unknown


def test_models_listing_tells_adapters_from_models() -> None:
    listing = {"object": "list", "data": [
        {"id": "tiny", "parent": None}, {"id": "a0", "parent": "tiny", "root": "/x"},
        {"id": "odd"}, {"no": "id"}]}
    names, adapters = _model_ids(json.dumps(listing).encode())
    assert names == {"tiny", "odd"} and adapters == {"a0": "tiny"}
    assert _model_ids(b'{"data": []}') is None and _model_ids(b"nope") is None


def test_max_lora_is_read_from_the_lora_gauge() -> None:
    page = (b'vllm:num_requests_running{engine="0"} 1.0\n'
            b'vllm:lora_requests_info{max_lora="3",running_lora_adapters="a0",'
            b'waiting_lora_adapters=""} 1.79e+09\n')
    found = _MAX_LORA.search(page)
    assert found is not None and found.group(1) == b"3"


def test_adapter_set_keeps_lru_order_and_picks_an_idle_victim() -> None:
    held = AdapterSet()
    held.listed(["a", "b", "c"])
    assert len(held) == 3 and "a" in held
    held.used("a")  # a: most recently used, one in flight
    assert list(held.held)[-1] == "a"
    assert held.victim(keep="x") in {"b", "c"}
    held.used("b"), held.used("c")
    assert held.victim(keep="x") is None, "all busy: none (a request not sent yet would 404)"
    held.done("b")
    assert held.victim(keep="x") == "b", "the least recently used idle one"
    assert held.victim(keep="b") is None
    held.listed(["b"])  # another replica unloaded a and c
    assert list(held.held) == ["b"]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_changes_say_what_this_replica_did_and_beat_for_requests_in_flight() -> None:
    clock = _Clock()
    held = AdapterSet(clock)
    held.loaded("a")
    held.used("a")
    clock.now = 101.0
    held.used("b")
    held.done("b")
    held.unloaded("c")
    assert held.changes() == {"a": AdapterNote("busy", 101.0), "b": AdapterNote("idle", 101.0),
                              "c": AdapterNote("gone", 101.0)}
    clock.now = 102.0
    assert held.changes() == {"a": AdapterNote("busy", 102.0)}, "a heartbeat, nothing else"
    held.done("a")
    assert held.changes() == {"a": AdapterNote("idle", 102.0)}
    assert held.changes() == {}


def test_other_replicas_words_add_protect_and_remove_adapters() -> None:
    clock = _Clock()
    held = AdapterSet(clock)
    held.listed(["a", "b"])
    clock.now = 110.0
    held.used("a")
    held.done("a")
    # Another replica loaded c and has requests in flight for it; it used b after a.
    held.shared([("c", AdapterNote("busy", 110.5)), ("b", AdapterNote("idle", 110.5))],
                now=111.0, busy_s=1.0)
    assert set(held.held) == {"a", "b", "c"}
    assert held.busy_elsewhere == {"c"}
    assert held.victim(keep="x") == "a", "b was used later (elsewhere), c is busy there"
    # Its heartbeat for c stops (it died): c is no longer protected after busy_s.
    held.shared([("c", AdapterNote("busy", 110.5))], now=111.6, busy_s=1.0)
    assert held.busy_elsewhere == set()
    # It unloads a after this replica's last use: a is not held any more; a "gone" older
    # than this replica's own use, or than the engine's last listing, changes nothing.
    held.shared([("a", AdapterNote("gone", 112.0)), ("b", AdapterNote("gone", 105.0))],
                now=112.5, busy_s=1.0)
    assert "a" not in held and "b" in held
    clock.now = 113.0
    held.listed(["a", "b", "c"])  # the engine lists a again (a restart with its flags)
    held.shared([("a", AdapterNote("gone", 112.0))], now=113.5, busy_s=1.0)
    assert "a" in held
    # This replica's own unload stands over older words that it is used.
    held.unloaded("c")
    held.shared([("c", AdapterNote("idle", 112.9))], now=114.0, busy_s=1.0)
    assert "c" not in held
    held.shared([("c", AdapterNote("busy", 113.9))], now=114.0, busy_s=1.0)
    assert "c" in held, "used elsewhere after this replica unloaded it: loaded again there"


def test_share_words_decode_without_the_replicas_own() -> None:
    share = AdapterShare(store=None, replica="me")  # type: ignore[arg-type]
    fields = {"a|other": "busy:1000500", "a|me": "gone:1000600", "b|x|other": "idle:1000000",
              "bad": "busy:1", "c|other": "sleepy:1", "d|other": "busy:x"}
    assert share.decode(fields, offset=900.0) == [
        ("a", AdapterNote("busy", 100.5)), ("b|x", AdapterNote("idle", 100.0))]


def _engine(url: str, inflight: int, holds: tuple[str, ...] = (), max_adapters: int = 2,
            ) -> EngineSlots:
    engine = EngineSlots(EngineConfig(url=url, max_adapters=max_adapters))
    engine.inflight = inflight
    engine.adapters.listed(holds)
    return engine


def test_placement_keeps_an_adapter_where_it_is_within_the_bound() -> None:
    e1, e2 = _engine("http://e1", 5, ("a",)), _engine("http://e2", 2)
    assert place_adapter([e1, e2], "a", 4) is e1  # 5 <= 2 + 4: stays
    e1.inflight = 7
    assert place_adapter([e1, e2], "a", 4) is e2  # too busy: spreads to e2's free place
    full = _engine("http://e3", 2, ("x", "y"))
    assert place_adapter([e1, full], "a", 4) is e1  # no free place: evicts nothing
    assert place_adapter([e2], "a", 4) is e2  # nowhere held: loaded there


def test_placement_of_a_new_adapter_prefers_an_engine_with_room() -> None:
    full = _engine("http://full", 1, ("x", "y"))
    room = _engine("http://room", 3, ("z",))
    # Loading on ``full`` evicts one: counted as adapter_affinity (4) busier, 5 > 3.
    assert place_adapter([full, room], "new", 4) is room
    room.inflight = 6
    assert place_adapter([full, room], "new", 4) is full
    assert place_adapter([], "new", 4) is None
    # Held only on an engine that is full now, and every engine with room would evict:
    # wait for the holder (None), unless the holder does not accept requests.
    busy = _engine("http://busy", 8, ("new",))
    assert place_adapter([full], "new", 4, [full, busy]) is None
    busy.draining = True
    assert place_adapter([full], "new", 4, [full, busy]) is full
    assert place_adapter([room], "new", 4, [room, busy]) is room  # a free place: load


class _FakeVllm:
    """A real HTTP server (uvicorn over a socket) that answers the two LoRA routes as
    vLLM does: 200, or 400 "already been loaded", and counts the calls."""

    def __init__(self, fail: bool = False) -> None:
        self.loaded: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        name = json.loads(body)["lora_name"]
        self.calls.append((scope["path"], name))
        await asyncio.sleep(0.05)
        if self.fail:
            status, text = 500, b"boom"
        elif scope["path"].endswith("/load_lora_adapter"):
            status, text = (400, b"already been loaded") if name in self.loaded else (200, b"ok")
            self.loaded.add(name)
        else:
            status, text = (200, b"ok") if name in self.loaded else (404, b"not found")
            self.loaded.discard(name)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": text})


async def _serve(app: _FakeVllm) -> tuple[Any, str]:
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return (server, task), f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_loads_are_shared_evict_the_lru_idle_adapter_and_failures_raise() -> None:
    async def main() -> None:
        app = _FakeVllm()
        (server, task), url = await _serve(app)
        try:
            engine = _engine(url, 0, max_adapters=2)
            async with httpx.AsyncClient(base_url=url) as client:
                # Three requests for one adapter at once: one load.
                got = await asyncio.gather(*(ensure_loaded(engine, client, "a", "/p/a")
                                             for _ in range(3)))
                assert sorted(got) == [False, False, True]
                assert app.calls == [("/v1/load_lora_adapter", "a")]
                assert await ensure_loaded(engine, client, "b", "/p/b")
                engine.adapters.used("b")  # b busy; a idle (least recently used anyway)
                assert await ensure_loaded(engine, client, "c", "/p/c")
                assert ("/v1/unload_lora_adapter", "a") in app.calls
                assert set(engine.adapters.held) == {"b", "c"} and app.loaded == {"b", "c"}
                # Loaded elsewhere already (another replica): vLLM's 400 counts as held.
                app.loaded.add("d")
                engine.adapters.done("b")
                assert await ensure_loaded(engine, client, "d", "/p/d")
                assert "d" in engine.adapters and len(engine.adapters) == 2
                app.fail = True
                with pytest.raises(AdapterLoadFailed, match="HTTP 500"):
                    await ensure_loaded(engine, client, "e", "/p/e")
                assert "e" not in engine.adapters and not engine.adapters.loading
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())


def test_bench_popularity_and_shares() -> None:
    from tokenpace.bench.adapters import shares, zipf_weights

    weights = zipf_weights(6, 1.0)
    assert sum(weights) == pytest.approx(1.0)
    assert weights == sorted(weights, reverse=True)
    assert weights[0] / weights[-1] == pytest.approx(6.0)
    assert shares({"a": 3, "b": 1}) == {"a": 0.75, "b": 0.25}
    assert shares({"a": 0}) == {"a": 0.0}


def test_an_engines_404_for_an_adapter_is_not_an_answer() -> None:
    from tokenpace.gateway.relay import not_taken

    missing = b'{"error":{"message":"The model `ad1` does not exist.","code":404}}'
    assert not_taken(404, missing, adapter=True) == (True, False)
    assert not_taken(404, missing) == (False, False), "a model's 404 is the client's answer"
    assert not_taken(404, b"other", adapter=True) == (False, False)
    assert not_taken(200, b"", adapter=True) == (False, False)

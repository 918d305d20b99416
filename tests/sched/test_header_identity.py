"""Identity from a trusted proxy's header, paced by vLLM's real scheduler.

A request's sampling parameters go through the API server's ``AsyncLLM.add_request``
wrapper (``_header_identity``) as vLLM's endpoints send them, with the header identity the
guard read (or none), and then to the real paced scheduler. The body claims one user;
the scheduler must pace the header's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams

from tests.sched._harness import NS, Sim, make_sim, max_in_window
from tokenpace.engine._header_identity import HeaderIdentity, enter, install_header_identity, leave
from tokenpace.engine._hooks import _wrap

pytestmark = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])

RATE = 10.0
SECONDS = 6


class _ApiServer:
    """The part of vLLM's ``AsyncLLM`` the wrapper uses: its configuration, and
    ``add_request`` receiving the request's sampling parameters."""

    def __init__(self, section: dict[str, Any]) -> None:
        self.vllm_config = SimpleNamespace(additional_config={"tokenpace": section})
        self.sent: list[SamplingParams] = []

    async def add_request(self, request_id: str, prompt: Any, params: Any, **_: Any) -> None:
        self.sent.append(params)


install_header_identity(_ApiServer, _wrap)


def _through_api_server(server: _ApiServer, body_xargs: dict[str, Any],
                        identity: HeaderIdentity | None) -> dict[str, Any] | None:
    """The ``extra_args`` the engine receives for a body's ``vllm_xargs``."""
    params = SamplingParams(max_tokens=1, extra_args=dict(body_xargs))

    async def handle() -> None:
        token = enter(identity) if identity is not None else None
        try:
            await server.add_request("r", "prompt", params)
        finally:
            if token is not None:
                leave(token)

    asyncio.run(handle())
    return server.sent[-1].extra_args


def _add(sim: Sim, server: _ApiServer, rid: str, body_user: str,
         identity: HeaderIdentity | None) -> None:
    extra = _through_api_server(server, {"output_rate_user": body_user}, identity)
    sim.add(rid, None, xargs=extra, max_tokens=1000)


def _user_of(sim: Sim, rid: str) -> str:
    return sim.scheduler._user_of(sim.scheduler.requests[rid])  # type: ignore[attr-defined]


def _times(sim: Sim, rids: set[str]) -> list[int]:
    return [t for _, t, _, rid in sim.dispatched if rid in rids]


def _paced_at(times: list[int], rate: float) -> None:
    """GCRA's bound in every window, and the whole rate used."""
    assert len(times) >= rate * SECONDS - 1, len(times)
    for window_s in (0.5, 1.0, SECONDS):
        assert max_in_window(times, int(window_s * NS)) <= (window_s + 0.1) * rate + 1


def test_the_header_names_the_user_whatever_the_body_says(tiny_model: Path,
                                                          is_async: bool) -> None:
    """Two tenants each claim "victim" in the body: each is paced as itself (10 tok/s
    each), and the real "victim" keeps its own 10 tok/s."""
    server = _ApiServer({"default_user_output_tokens_per_second": RATE,
                         "user_header": "x-tenant"})
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={"default_user_output_tokens_per_second": RATE})
    _add(sim, server, "a", "victim", HeaderIdentity("team-a"))
    _add(sim, server, "b", "victim", HeaderIdentity("team-b"))
    _add(sim, server, "v", "someone-else", HeaderIdentity("victim"))
    assert [_user_of(sim, r) for r in "abv"] == ["team-a", "team-b", "victim"]
    sim.run(SECONDS)
    for rid in "abv":
        _paced_at(_times(sim, {rid}), RATE)


def test_without_the_header_the_body_cannot_choose(tiny_model: Path, is_async: bool) -> None:
    """No header (and a guard that never ran) is anonymous: the body's two different
    users share the anonymous quota of 10 tok/s instead of getting 10 each."""
    server = _ApiServer({"default_user_output_tokens_per_second": RATE,
                         "user_header": "x-tenant"})
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={"default_user_output_tokens_per_second": RATE})
    _add(sim, server, "x", "user-x", HeaderIdentity())
    _add(sim, server, "y", "user-y", None)
    assert _user_of(sim, "x") == _user_of(sim, "y") == "__anonymous__"
    sim.run(SECONDS)
    _paced_at(_times(sim, {"x", "y"}), RATE)


def test_without_identity_headers_the_body_still_names_the_user(tiny_model: Path,
                                                                is_async: bool) -> None:
    """The wrapper changes nothing for an engine without ``user_header``."""
    server = _ApiServer({"default_user_output_tokens_per_second": RATE})
    sim = make_sim(tiny_model, is_async=is_async,
                   pacing={"default_user_output_tokens_per_second": RATE})
    _add(sim, server, "x", "user-x", HeaderIdentity("ignored"))
    assert _user_of(sim, "x") == "user-x"

"""Identity from a trusted proxy's headers: the configuration, the guard's
reading of the headers, and how they replace what a body's ``vllm_xargs`` said.

The scheduler's side (a real vLLM scheduler pacing the header's user) is in
tests/sched/test_header_identity.py; a real nginx in front of a real engine in
tests/e2e/test_proxy_identity.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tokenpace.engine import PacingConfig, PacingConfigError
from tokenpace.engine._guard import RequestGuard
from tokenpace.engine._header_identity import (
    HeaderIdentity,
    HeaderRefused,
    apply_identity,
    current,
    enter,
    leave,
    read_identity,
)

RATE = {"default_user_output_tokens_per_second": 10}


def config(**keys: Any) -> PacingConfig:
    return PacingConfig.from_section({**RATE, **keys})


# -- configuration ------------------------------------------------------------------------


def test_header_names_are_stored_lower_case() -> None:
    cfg = config(user_header="X-Tenant-Id", application_header="X-App",
                 end_user_header="x-end-user", require_user_header=True)
    assert (cfg.user_header, cfg.application_header, cfg.end_user_header) == (
        "x-tenant-id", "x-app", "x-end-user")
    assert cfg.identity_headers and cfg.require_user_header
    assert not config().identity_headers


@pytest.mark.parametrize(("keys", "message"), [
    ({"user_header": ""}, "must be an HTTP header name"),
    ({"user_header": "x tenant"}, "must be an HTTP header name"),
    ({"user_header": "x-tenant:"}, "must be an HTTP header name"),
    ({"user_header": 5}, "must be an HTTP header name"),
    ({"user_header": "Authorization"}, "carries the HTTP exchange itself"),
    ({"user_header": "content-length"}, "carries the HTTP exchange itself"),
    ({"end_user_header": "proxy-authorization"}, "carries the HTTP exchange itself"),
    ({"user_header": "x-a", "application_header": "X-A"}, "must be different headers"),
    ({"require_user_header": True}, "needs 'user_header'"),
    ({"user_header": "x-a", "require_user_header": "yes"}, "must be true or false"),
])
def test_bad_header_configuration_is_refused_naming_the_key(keys: dict, message: str) -> None:
    with pytest.raises(PacingConfigError, match=message):
        config(**keys)


def test_a_header_without_pacing_is_refused() -> None:
    with pytest.raises(PacingConfigError, match="'user_header'.* needs 'default_user_output"):
        PacingConfig.from_section({"user_header": "x-tenant"})
    assert PacingConfig.from_section({"trusted_gateway": True, "user_header": "x-t"}).user_header


# -- reading the headers ------------------------------------------------------------------


def headers(**values: str) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"engine"), *((k.replace("_", "-").encode(), v.encode("latin-1"))
                                    for k, v in values.items())]


def test_each_level_from_its_header() -> None:
    cfg = config(user_header="x-tenant", application_header="x-app", end_user_header="x-eu")
    got = read_identity(headers(x_tenant="team-a", x_app=" bot ", x_eu="alice"), cfg)
    assert got == HeaderIdentity("team-a", "bot", "alice")
    assert read_identity(headers(), cfg) == HeaderIdentity(None, None, None)


@pytest.mark.parametrize(("given", "message"), [
    ([(b"x-tenant", b"a"), (b"x-tenant", b"b")], "given more than once"),
    ([(b"x-tenant", b"")], "must not be empty"),
    ([(b"x-tenant", b"   ")], "must not be empty"),
    ([(b"x-tenant", b"u" * 257)], "at most 256"),
])
def test_unusable_headers_are_refused_naming_the_header(given: list, message: str) -> None:
    with pytest.raises(HeaderRefused, match=message) as err:
        read_identity(given, config(user_header="x-tenant"))
    assert err.value.param == "x-tenant"


def test_a_required_header_that_is_missing_is_refused() -> None:
    cfg = config(user_header="x-tenant", require_user_header=True)
    with pytest.raises(HeaderRefused, match="'x-tenant' is required"):
        read_identity(headers(x_other="a"), cfg)
    assert read_identity(headers(x_tenant="a"), cfg).user == "a"


# -- the header replaces the body -----------------------------------------------------------


BODY = {"output_rate_user": "mallory", "output_rate_application": "mallory-app",
        "output_rate_end_user": "eve", "other": 1}
RATES = {"output_rate_tokens_per_second": 999, "output_rate_version": 7,
         "output_rate_end_user_tokens_per_second": 99,
         "output_rate_application_tokens_per_second": 98,
         "output_rate_application_end_user_tokens_per_second": 97}


@pytest.mark.parametrize(("keys", "identity", "expected"), [
    # the header's value wins over the body's
    ({"user_header": "x-t"}, HeaderIdentity("alice"),
     {**BODY, "output_rate_user": "alice"}),
    # a missing header: anonymous at that level, whatever the body said
    ({"user_header": "x-t"}, HeaderIdentity(),
     {k: v for k, v in BODY.items() if k != "output_rate_user"}),
    # the guard did not run (no middleware): the same as a missing header
    ({"user_header": "x-t"}, None, {k: v for k, v in BODY.items() if k != "output_rate_user"}),
    # each level with a header of its own; levels without one keep the body's
    ({"user_header": "x-t", "end_user_header": "x-e"}, HeaderIdentity("alice", None, "bob"),
     {**BODY, "output_rate_user": "alice", "output_rate_end_user": "bob"}),
    ({"user_header": "x-t", "application_header": "x-a"}, HeaderIdentity("alice", None),
     {k: v for k, v in {**BODY, "output_rate_user": "alice"}.items()
      if k != "output_rate_application"}),
])
def test_the_headers_replace_the_levels_they_govern(keys: dict, identity: HeaderIdentity | None,
                                                    expected: dict) -> None:
    params = SimpleNamespace(extra_args={**BODY, **RATES})
    shared = params.extra_args
    apply_identity(params, identity, config(**keys))
    assert params.extra_args == expected  # no rate field: only the gateway's are kept
    assert shared == {**BODY, **RATES}  # the body's dict is not changed (it may be shared)


@pytest.mark.parametrize("keys", [{"user_header": "x-t"},
                                  {"user_header": "x-t", "trusted_gateway": True}])
def test_only_the_trusted_gateways_request_keeps_its_fields(keys: dict) -> None:
    params = SimpleNamespace(extra_args={**BODY, **RATES})
    apply_identity(params, HeaderIdentity(gateway=True), config(**keys))
    assert params.extra_args == {**BODY, **RATES}
    params = SimpleNamespace(extra_args={**BODY, **RATES})
    apply_identity(params, HeaderIdentity("alice"), config(**keys))
    assert params.extra_args == {**BODY, "output_rate_user": "alice"}


def test_no_extra_args_at_all() -> None:
    params = SimpleNamespace(extra_args=None)
    apply_identity(params, HeaderIdentity("alice"), config(user_header="x-t"))
    assert params.extra_args == {"output_rate_user": "alice"}
    params = SimpleNamespace(extra_args=None)
    apply_identity(params, HeaderIdentity(), config(user_header="x-t"))
    assert params.extra_args is None


# -- the guard hands the identity to the request's handling ---------------------------------


class _Recorder:
    """Downstream app: answers with the identity it sees, also from a task it starts (as
    Starlette's streaming responses run in a task of their own)."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        child = await asyncio.create_task(_identity_in_task())
        body = json.dumps({"here": current(), "child": child}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


async def _identity_in_task() -> HeaderIdentity | None:
    return current()


def _vllm_app(inner: Any, additional: dict | None, api_keys: list[str] | None = None) -> Any:
    """What vLLM's Starlette app does for the guard: ``scope["app"]`` with its config and
    parsed arguments (``--api-key``)."""
    app = SimpleNamespace(state=SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config=additional),
        args=SimpleNamespace(api_key=api_keys)))

    async def call(scope: dict, receive: Any, send: Any) -> None:
        scope["app"] = app
        await inner(scope, receive, send)

    return call


def _request(additional: dict | None, method: str = "POST",
             header_values: dict[str, str] | None = None,
             raw_headers: list[tuple[str, str]] | None = None,
             api_keys: list[str] | None = None) -> httpx.Response:
    guard = RequestGuard(_Recorder())
    sent = [("content-type", "application/json"), *(header_values or {}).items(),
            *(raw_headers or ())]

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_vllm_app(guard, additional, api_keys))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
            return await c.request(method, "/v1/completions", headers=sent,
                                   content=b'{"prompt": "x"}' if method == "POST" else None)

    return asyncio.run(go())


def test_the_guard_sets_the_identity_for_the_request_and_its_tasks() -> None:
    section = {**RATE, "user_header": "x-tenant", "end_user_header": "x-end-user"}
    resp = _request({"tokenpace": section}, header_values={"X-Tenant": "team-a",
                                                           "x-end-user": "alice"})
    assert resp.status_code == 200
    assert resp.json() == {"here": ["team-a", None, "alice", False],
                           "child": ["team-a", None, "alice", False]}
    resp = _request({"tokenpace": section})
    assert resp.json()["here"] == [None, None, None, False]  # absent: anonymous, not refused


def test_without_identity_headers_the_guard_sets_nothing() -> None:
    assert _request({"tokenpace": RATE}, header_values={"x-tenant": "a"}).json()["here"] is None
    assert _request(None).json()["here"] is None


def test_the_guard_refuses_a_post_with_an_unusable_header() -> None:
    section = {**RATE, "user_header": "x-tenant", "require_user_header": True}
    resp = _request({"tokenpace": section})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "x-tenant" and "is required" in error["message"]
    resp = _request({"tokenpace": section}, raw_headers=[("x-tenant", "a"), ("x-tenant", "b")])
    assert resp.status_code == 400 and "more than once" in resp.json()["error"]["message"]
    # a GET generates nothing: it passes (with no identity)
    resp = _request({"tokenpace": section}, method="GET")
    assert resp.status_code == 200 and resp.json()["here"] == [None, None, None, False]


def test_only_a_keyed_request_without_identity_headers_is_the_trusted_gateways() -> None:
    """``--user-header`` with ``--trusted-gateway``: the gateway (the engine's key, no
    identity header) keeps its body's fields; a client behind the proxy (the header, with
    or without the key the proxy adds) and a request without the key do not."""
    section = {"trusted_gateway": True, "user_header": "x-tenant", "require_user_header": True}
    keys = ["sk-engine"]
    gateway = {"authorization": "Bearer sk-engine"}

    def here(**kwargs: Any) -> Any:
        resp = _request({"tokenpace": section}, api_keys=keys, **kwargs)
        return resp.status_code, resp.json().get("here")

    assert here(header_values=gateway) == (200, [None, None, None, True])
    assert here(header_values={**gateway, "x-tenant": "team-a"}) == (
        200, ["team-a", None, None, False])
    assert here(header_values={"authorization": "Bearer sk-wrong"})[0] == 400  # required
    assert here(header_values={"x-tenant": "team-a"}) == (200, ["team-a", None, None, False])
    # Without trusted_gateway the key makes no gateway.
    plain = {**RATE, "user_header": "x-tenant"}
    resp = _request({"tokenpace": plain}, api_keys=keys, header_values=gateway)
    assert resp.json()["here"] == [None, None, None, False]


def test_context_is_left_after_the_request() -> None:
    token = enter(HeaderIdentity("x"))
    assert current() == HeaderIdentity("x")
    leave(token)
    assert current() is None

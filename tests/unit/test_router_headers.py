"""``engines[].headers``: the headers a router in front of engines (llm-d's inference
gateway) reads, checked at load, compiled per engine, rendered per request."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from tokenpace.gateway.config import ConfigError, parse_config
from tokenpace.gateway.engines import RouterHeaders, compile_router_headers, wire_safe
from tokenpace.gateway.fleet import Connections, engine_at

LLM_D = {"x-gateway-inference-fairness-id": "{tenant}",
         "x-gateway-inference-objective": "{lane}"}


def config(headers: Any, url: str = "http://llm-d-gateway.inference:80",
           **engine: Any) -> dict[str, Any]:
    return {"engines": [{"url": url, "headers": headers, **engine}],
            "tenants": [{"id": "team-a", "api_keys": ["sk-a"]}],
            "ledger": "sqlite:///unused.db"}


# -- loading -------------------------------------------------------------------------


def test_headers_load_as_lower_case_pairs_in_order() -> None:
    engine = parse_config(config({"X-Gateway-Inference-Fairness-Id": "{tenant}",
                                  "x-llm-d-inference-objective": "lane-{lane}",
                                  "x-braces": "{{literal}}"})).engines[0]
    assert engine.headers == (("x-gateway-inference-fairness-id", "{tenant}"),
                              ("x-llm-d-inference-objective", "lane-{lane}"),
                              ("x-braces", "{{literal}}"))
    assert parse_config(config(None)).engines[0].headers == ()
    assert parse_config(config({})).engines[0].headers == ()


@pytest.mark.parametrize("headers, message", [
    ("x", "engines[0].headers: expected a mapping, got str"),
    ({"x y": "{tenant}"}, "engines[0].headers: 'x y' is not a header name"),
    ({"x:y": "{tenant}"}, "engines[0].headers: 'x:y' is not a header name"),
    ({"": "{tenant}"}, "engines[0].headers: '' is not a header name"),
    ({"Host": "x"}, "engines[0].headers.host: not allowed (the gateway sets it from the "
                    "engine's url)"),
    ({"content-length": "1"}, "engines[0].headers.content-length: not allowed"),
    ({"content-type": "text/plain"}, "engines[0].headers.content-type: not allowed"),
    ({"transfer-encoding": "chunked"}, "engines[0].headers.transfer-encoding: not allowed"),
    ({"connection": "close"}, "engines[0].headers.connection: not allowed (it is hop-by-hop"),
    ({"keep-alive": "1"}, "engines[0].headers.keep-alive: not allowed (it is hop-by-hop)"),
    ({"te": "trailers"}, "engines[0].headers.te: not allowed (it is hop-by-hop)"),
    ({"trailer": "x"}, "engines[0].headers.trailer: not allowed (it is hop-by-hop)"),
    ({"upgrade": "h2c"}, "engines[0].headers.upgrade: not allowed (it is hop-by-hop)"),
    ({"Proxy-Authorization": "x"}, "engines[0].headers.proxy-authorization: not allowed "
                                   "(it is hop-by-hop (proxy-*))"),
    ({"authorization": "Bearer x"}, "engines[0].headers.authorization: not allowed (give "
                                    "the engine's key as api_key"),
    ({"x-request-id": "{tenant}"}, "engines[0].headers.x-request-id: not allowed (the "
                                   "gateway sends its request id there)"),
    ({"x-a": "1", "X-A": "2"}, "engines[0].headers.x-a: given twice"),
    ({"x-a": 5}, "engines[0].headers.x-a: expected a string template"),
    ({"x-a": None}, "engines[0].headers.x-a: expected a string template"),
    ({"x-a": ""}, "engines[0].headers.x-a: empty"),
    ({"x-a": "a\r\nx-evil: 1"}, "engines[0].headers.x-a: printable ASCII only"),
    ({"x-a": "caf\u00e9"}, "engines[0].headers.x-a: printable ASCII only"),
    ({"x-a": " {tenant}"}, "engines[0].headers.x-a: leading or trailing spaces"),
    ({"x-a": "{tenant"}, "engines[0].headers.x-a: expected '}' before end of string"),
    ({"x-a": "a}b"}, "engines[0].headers.x-a: Single '}' encountered"),
    ({"x-a": "{user}"}, "engines[0].headers.x-a: unknown placeholder {user} in '{user}'; "
                        "known: {tenant}, {application}, {lane}, {model}, {end_user}"),
    ({"x-a": "{}"}, "engines[0].headers.x-a: unknown placeholder {}"),
    ({"x-a": "{0}"}, "engines[0].headers.x-a: unknown placeholder {0}"),
    ({"x-a": "{tenant.id}"}, "engines[0].headers.x-a: unknown placeholder {tenant.id}"),
    ({"x-a": "{tenant!r}"}, "engines[0].headers.x-a: unknown placeholder {tenant!r}"),
    ({"x-a": "{tenant:>9}"}, "engines[0].headers.x-a: unknown placeholder {tenant:>9}"),
    ({f"x-{i}": "{tenant}" for i in range(33)}, "engines[0].headers: at most 32 headers, "
                                                "got 33"),
])
def test_bad_headers_are_refused_naming_the_header(headers: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config(headers))
    assert str(caught.value).startswith(message), str(caught.value)


def test_thirty_two_headers_are_allowed() -> None:
    headers = {f"x-{i}": "{tenant}" for i in range(32)}
    assert len(parse_config(config(headers)).engines[0].headers) == 32


def test_headers_are_compared_so_a_reload_sees_a_change() -> None:
    a = parse_config(config(LLM_D)).engines[0]
    b = parse_config(config({**LLM_D, "x-gateway-inference-objective": "{tenant}"})).engines[0]
    assert a == parse_config(config(LLM_D)).engines[0]
    assert a != b


def test_engines_found_by_dns_inherit_their_entrys_headers() -> None:
    entry = parse_config(config(LLM_D, url="http://vllm.inference:8000",
                                discovery="dns")).engines[0]
    found = engine_at(entry, "10.0.0.7")
    assert found.url == "http://10.0.0.7:8000" and found.headers == entry.headers


# -- rendering -----------------------------------------------------------------------


def render(headers: dict[str, str], tenant: str = "team-a", application: str | None = None,
           lane: str = "interactive", model: str = "llama", end_user: str | None = None
           ) -> dict[str, str]:
    pairs = parse_config(config(headers)).engines[0].headers
    return RouterHeaders(pairs).render(tenant, application, lane, model, end_user)


def test_each_placeholder_renders_its_value() -> None:
    assert render(LLM_D) == {"x-gateway-inference-fairness-id": "team-a",
                             "x-gateway-inference-objective": "interactive"}
    assert render({"x-all": "{tenant}/{application}/{lane}/{model}/{end_user}"},
                  application="chat", end_user="bob") == {
        "x-all": "team-a/chat/interactive/llama/bob"}
    assert render({"x-lit": "fixed"}) == {"x-lit": "fixed"}


def test_double_braces_are_literal_braces() -> None:
    assert render({"x-b": "{{{tenant}}}-{{lane}}"}) == {"x-b": "{team-a}-{lane}"}


def test_a_header_that_renders_empty_is_left_out() -> None:
    headers = {"x-app": "{application}", "x-user": "{end_user}", "x-t": "{tenant}"}
    assert render(headers) == {"x-t": "team-a"}
    assert render(headers, application="chat", end_user="u1") == {
        "x-app": "chat", "x-user": "u1", "x-t": "team-a"}
    # Only a wholly empty value is left out: a literal around an empty value stays.
    assert render({"x-app": "app-{application}"}) == {"x-app": "app-"}


def test_a_hostile_end_user_cannot_reach_the_wire_raw() -> None:
    got = render({"x-user": "{end_user}"}, end_user="bob\r\nx-evil: 1")
    assert got == {"x-user": "bob%0D%0Ax-evil: 1"}
    assert "\r" not in got["x-user"] and "\n" not in got["x-user"]
    # NUL, other controls, DEL, non-ASCII (as UTF-8) and '%' itself are encoded too, so an
    # encoded value reads back unambiguously.
    assert wire_safe("a\x00b\x1fc\x7fd") == "a%00b%1Fc%7Fd"
    assert wire_safe("jos\u00e9 \u2028") == "jos%C3%A9 %E2%80%A8"
    assert wire_safe("100%") == "100%25"
    assert wire_safe("plain id-1.2_~!*'()/:@=") == "plain id-1.2_~!*'()/:@="
    # Ids from the configuration get the same treatment.
    assert render(LLM_D, tenant="t\u00e9", lane="l%") == {
        "x-gateway-inference-fairness-id": "t%C3%A9", "x-gateway-inference-objective": "l%25"}


def test_compile_reads_the_end_user_only_where_a_template_names_it() -> None:
    assert compile_router_headers(()) is None
    compiled = compile_router_headers((("x-t", "{tenant}"),))
    assert compiled is not None and not compiled.needs_end_user
    compiled = compile_router_headers((("x-t", "{tenant}"), ("x-u", "u={end_user}")))
    assert compiled is not None and compiled.needs_end_user
    with pytest.raises(ValueError, match="unknown placeholder"):
        RouterHeaders((("x-t", "{nobody}"),))


# -- per engine ----------------------------------------------------------------------


def test_each_engine_compiles_its_own_headers_and_a_reload_replaces_them() -> None:
    """Compiled once when the engine's connections open; an engine whose headers a reload
    changes keeps its connections (requests in flight go on) and takes the new headers."""
    parsed = parse_config({
        "engines": [{"url": "http://router:80", "headers": LLM_D}, "http://vllm:8000"],
        "tenants": [{"id": "team-a", "api_keys": ["sk-a"]}],
        "ledger": "sqlite:///unused.db"})
    routed, plain = parsed.engines

    async def run() -> None:
        connections = Connections()
        try:
            connections.open(routed)
            connections.open(plain)
            upstream = connections.upstreams[routed.url]
            compiled = upstream.router_headers
            assert compiled is not None and compiled.templates == routed.headers
            assert connections.upstreams[plain.url].router_headers is None
            connections.open(routed)  # the same settings again (a discovery round)
            assert upstream.router_headers is compiled
            changed = dataclasses.replace(
                routed, headers=(("x-llm-d-inference-fairness-id", "{tenant}"),))
            connections.open(changed)
            assert connections.upstreams[routed.url] is upstream  # the same connections
            assert upstream.router_headers is not None
            assert upstream.router_headers.render("t", None, "l", "m", None) == {
                "x-llm-d-inference-fairness-id": "t"}
            connections.open(dataclasses.replace(routed, headers=()))
            assert upstream.router_headers is None
        finally:
            await connections.close()

    asyncio.run(run())

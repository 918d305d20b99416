"""A generated battery of hostile request bodies: the gateway answers every one, never 5xx.

Real HTTP to a real gateway process in front of the in-process engine. Bodies are valid
requests with fields replaced by arbitrary JSON (lone surrogates, NaN and Infinity, huge
numbers, wrong types, deep nesting), re-encoded in several ways, sometimes cut short or
garbled. Every answer must be below 500 and, unless it is a stream or a success, carry an
OpenAI-style JSON error. The engine answers what it cannot read with a 400, as vLLM does.

``TOKENPACE_HOSTILE_BODIES`` sets the number of bodies (CI runs the default; the
examples are derandomized, so a run is reproducible).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway._engine import EngineServer, FakeEngine
from tests.gateway.conftest import KEY_A, GatewayProcess, base_config

BODIES = int(os.environ.get("TOKENPACE_HOSTILE_BODIES", "2000"))

# Text with every code point, lone surrogates included (Hypothesis leaves them out by
# default and draws them rarely), and text made mostly of troublemakers.
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.text(st.sampled_from(["a", "\ud800", "\udfff", "\x00", "\u00e9", "\U0001f600", '"',
                             "\\", "\n"]), max_size=6),
)
NUMBERS = st.one_of(
    st.integers(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream",
          "stream_options", "temperature", "top_p", "stop", "seed", "logprobs",
          "chat_template_kwargs", "tools", "tool_choice", "vllm_xargs", "priority", "user",
          "cache_salt", "add_special_tokens", "response_format")


@st.composite
def messages(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        return draw(JSON)
    return [{"role": draw(st.sampled_from(["user", "system", "assistant", "tool"]) | TEXT),
             "content": draw(TEXT | JSON)} for _ in range(draw(st.integers(1, 3)))]


@st.composite
def request(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": "fake", "max_tokens": draw(st.integers(1, 4))}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    body["stream"] = draw(st.booleans())
    for name in draw(st.lists(st.sampled_from(FIELDS) | TEXT, max_size=4)):
        if name == "messages":
            body[name] = draw(messages())
        elif name == "prompt":
            body[name] = draw(TEXT | st.lists(st.integers(-5, 600), max_size=4) | JSON)
        else:
            body[name] = draw(JSON)
    style = draw(st.sampled_from(["ascii", "utf-8", "utf-16", "cut", "garbled", "nested"]))
    if style == "ascii":
        raw = json.dumps(body).encode()
    elif style == "nested":
        depth = draw(st.integers(10, 5000))
        raw = json.dumps(body)[:-1].encode() + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    else:
        text = json.dumps(body, ensure_ascii=False)
        raw = text.encode("utf-16" if style == "utf-16" else "utf-8", "surrogatepass")
        if style == "cut":
            raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
        elif style == "garbled":
            at = draw(st.integers(0, len(raw)))
            raw = raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


def test_hostile_bodies_never_get_a_server_error(tmp_path: Path) -> None:
    engine = EngineServer(FakeEngine(token_delay_s=0.0)).start()
    config = base_config(engine.url, tmp_path / "usage.db", max_output_tokens=4,
                         max_input_tokens=2000, budgets=[{"tokens": 50000, "per": "1s"}])
    gw = GatewayProcess(tmp_path, config).start()
    seen: Counter[int] = Counter()
    failures: list[str] = []
    try:
        with httpx.Client(base_url=gw.url, timeout=30,
                          headers={"authorization": f"Bearer {KEY_A}",
                                   "content-type": "application/json"}) as http:

            @settings(max_examples=BODIES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(request())
            def send(case: tuple[str, bytes]) -> None:
                path, raw = case
                resp = http.post(path, content=raw)
                seen[resp.status_code] += 1
                streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
                if resp.status_code >= 500:
                    failures.append(f"{resp.status_code} {path} {raw[:300]!r}: {resp.text[:300]}")
                elif resp.status_code != 200 and not streamed:
                    error = resp.json().get("error")
                    assert isinstance(error, dict) and error.get("message"), resp.text

            send()
    finally:
        log = gw.log()
        gw.stop()
        engine.stop()
    print(f"{sum(seen.values())} bodies, answers by status: {dict(sorted(seen.items()))}")
    assert not failures, f"{len(failures)} server errors, e.g. {failures[:3]}\n{log}"
    assert sum(seen.values()) >= BODIES
    # The battery must reach the engine, not only the parser: a good share is served.
    assert seen[200] >= BODIES // 10, seen
    assert "Traceback" not in log, log

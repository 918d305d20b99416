"""What a body's bytes can cost a real gateway process: a parse bomb costs about the parsed
body in memory, and a model name of megabytes is refused with a short answer and a short
ledger row.

Asserted on sizes (the gateway's peak resident memory, answer and row lengths), never on
time. The margins are stated where measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.gateway._engine import EngineServer
from tests.gateway.conftest import KEY_A, KEY_B, GatewayProcess, base_config

EMOJI = "\\ud83d\\ude00"  # an ordinary emoji sent escaped: the body is walked for surrogates
MIB = 1024 * 1024


def _peak_rss(gw: GatewayProcess) -> int:
    """The gateway process's peak resident memory so far (``VmHWM``), in bytes."""
    assert gw.server is not None
    for line in Path(f"/proc/{gw.server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _post(gw: GatewayProcess, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", content=content, timeout=120,
                      headers={"authorization": f"Bearer {KEY_B}",
                               "content-type": "application/json"})


def test_a_parse_bomb_costs_about_its_parsed_body(engine: EngineServer, make_gateway: Any,
                                                  tmp_path: Path) -> None:
    config = base_config(engine.url, tmp_path / "usage.db")
    config["tenants"][1]["max_body_bytes_per_second"] = 64 * MIB  # memory, not the rate
    gw = make_gateway(config)
    # 4 MiB: an escaped emoji, then 1.4 million items of a mixed list (walked item by
    # item). The request names no served model, so it ends at the 404 after parsing.
    head = '{"model": "no-such-model", "messages": [{"role": "user", "content": "%s"}], ' \
           '"pad": [' % EMOJI
    items = (4 * MIB - len(head)) // 6
    bomb = (head + "0,0.5," * items + "0]}").encode()
    assert _post(gw, "/v1/chat/completions", b'{"model": "warm-up", "messages": []}'
                 ).status_code == 400
    before = _peak_rss(gw)
    for _ in range(2):
        resp = _post(gw, "/v1/chat/completions", bomb)
        assert resp.status_code == 404, resp.text[:500]
        assert resp.json()["error"]["code"] == "model_not_found"
    grown = _peak_rss(gw) - before
    # The parsed body is ~30 MiB here (pointers, floats), the raw and decoded text 8 MiB;
    # measured: 40 MiB of growth; a walk that built a path per item: 364 MiB.
    assert grown < 160 * MIB, f"peak resident memory grew {grown / MIB:.0f} MiB"
    rows = gw.rows(3)
    assert [r.finish_reason for r in rows[-2:]] == ["rejected:model_not_found"] * 2


def test_a_huge_model_name_is_refused_with_a_short_answer_and_row(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    huge = "m" * (4 * MIB)
    gw = make_gateway(base_config(engine.url, tmp_path / "usage.db"))
    resp = _post(gw, "/v1/chat/completions",
                 b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
                 % huge.encode())
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "model")
    assert "max_model_name_chars" in error["message"] and len(resp.content) < 1024
    rows = gw.rows(1)
    assert rows[-1].finish_reason == "rejected:bad_request" and len(rows[-1].model) <= 256
    # /tokenize takes the same bound (its body within max_tokenize_bytes).
    resp = httpx.post(f"{gw.url}/tokenize", json={"model": huge[:MIB // 2], "prompt": "hi"},
                      timeout=60, headers={"authorization": f"Bearer {KEY_B}"})
    assert resp.status_code == 400 and len(resp.content) < 1024, resp.text[:500]
    assert "max_model_name_chars" in resp.json()["error"]["message"]
    # A path the gateway does not serve is echoed clipped too.
    resp = httpx.get(f"{gw.url}/{'p' * 60_000}", timeout=30)
    assert resp.status_code == 404 and len(resp.content) < 2048
    gw.stop()

    # Raised far enough to reach the lookup, the name is refused there (404), echoed
    # clipped by the generation routes and /tokenize alike; the row keeps 256 characters.
    config = base_config(engine.url, tmp_path / "usage.db")
    config["max_model_name_chars"] = 8 * MIB
    gw = make_gateway(config)
    huge = huge[:MIB // 2]  # within max_tokenize_bytes
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})):
        resp = httpx.post(f"{gw.url}{path}", json={"model": huge, **body}, timeout=60,
                          headers={"authorization": f"Bearer {KEY_B}"})
        assert resp.status_code == 404, resp.text[:500]
        assert len(resp.content) < 1024
    rows = gw.rows(2)
    assert rows[-1].finish_reason == "rejected:model_not_found" and len(rows[-1].model) <= 256


def test_a_batch_of_many_prompts_is_refused_before_any_is_counted(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    # Without max_tokens the gateway counts every prompt of a batch with its own engine
    # call (/tokenize) to fill it in: 20,000 one-letter prompts would be 20,000 calls.
    gw = make_gateway(base_config(engine.url, tmp_path / "usage.db"))
    calls = len(engine.engine.other_calls)
    resp = httpx.post(f"{gw.url}/v1/completions", timeout=60,
                      headers={"authorization": f"Bearer {KEY_B}"},
                      json={"model": "fake", "prompt": ["a"] * 20_000})
    assert resp.status_code == 400, resp.text[:500]
    assert resp.json()["error"]["param"] == "prompt"
    assert [p for p, _ in engine.engine.other_calls[calls:] if p == "/tokenize"] == []


def test_a_tenant_sending_bodies_faster_than_its_byte_rate_is_refused_before_reading(
        engine: EngineServer, make_gateway: Any, tmp_path: Path) -> None:
    # team-b may send 1 KiB of request body a second: its first 16 KiB body starts (16 s
    # owed), the next ones are refused until the debt is back within 2 s (14 s: far more
    # than this test takes, whatever the machine's load). team-a (the default, 1 MiB/s)
    # is not held up by team-b's debt.
    config = base_config(engine.url, tmp_path / "usage.db")
    config["tenants"][1]["max_body_bytes_per_second"] = 1024
    gw = make_gateway(config)
    body = ('{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], '
            '"pad": "%s"}'
            % ("x" * 16 * 1024)).encode()
    first = _post(gw, "/v1/chat/completions", body)
    assert first.status_code == 404, first.text[:300]
    for _ in range(3):
        refused = _post(gw, "/v1/chat/completions", body)
        assert refused.status_code == 429, refused.text[:300]
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "max_body_bytes_per_second (1024 bytes a second)" in error["message"]
        assert int(refused.headers["retry-after"]) >= 10
    other = httpx.post(f"{gw.url}/v1/chat/completions", content=body, timeout=60,
                       headers={"authorization": f"Bearer {KEY_A}",
                                "content-type": "application/json"})
    assert other.status_code == 404, other.text[:300]
    rows = gw.rows(5)
    assert [r.finish_reason for r in rows[-5:]].count("rejected:body_rate") == 3

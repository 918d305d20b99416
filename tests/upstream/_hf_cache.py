"""An offline Hugging Face hub cache holding the model configs vLLM's scheduler tests read.

vLLM's ``tests/v1/core`` builds ``ModelConfig("facebook/opt-125m")`` and a few other hub
models; ``ModelConfig`` reads ``config.json`` (and, for multimodal models, the processor
and a tokenizer to size the encoder budget) from the hub. Nothing here can reach the hub,
so this module writes a hub cache (``models--org--name/snapshots/<rev>/...`` with
``refs/main``) holding configs written by hand from the models' published shapes, and
tokenizers built locally (llava's processor needs one whose ``<image>`` is id 32000). No
weights: the scheduler tests never load a model (the end-to-end files, which do, are not
run: see ``run_upstream.NOT_RUN``).

Use: ``write_hf_cache(root)`` then run with ``HF_HOME=root``, ``HF_HUB_OFFLINE=1``,
``TRANSFORMERS_OFFLINE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The revision named by refs/main; any 40-hex string works for an offline cache.
REVISION = "0" * 40
# Bumped whenever a config below changes, so a cached tree is rewritten.
FORMAT = 6


def _opt(hidden: int, layers: int, heads: int, ffn: int, proj: int, before: bool) -> dict:
    return {
        "architectures": ["OPTForCausalLM"], "model_type": "opt",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "ffn_dim": ffn, "word_embed_proj_dim": proj, "do_layer_norm_before": before,
        "max_position_embeddings": 2048, "vocab_size": 50272, "activation_function": "relu",
        "enable_bias": True, "layer_norm_elementwise_affine": True, "dropout": 0.1,
        "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
        "prefix": "</s>", "torch_dtype": "float16", "use_cache": True,
    }


LLAVA_IMAGE_TOKEN = 32000
LLAVA_PAD_TOKEN = 32001

QWEN_VL_SPECIAL = {  # Qwen2.5-VL's special tokens and their ids
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": _opt(768, 12, 12, 3072, 768, True),
    "facebook/opt-350m": _opt(1024, 24, 16, 4096, 512, False),
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": False, "vocab_size": 151936, "bos_token_id": 151643,
        "eos_token_id": 151643, "torch_dtype": "bfloat16", "use_cache": True,
    },
    # vLLM 0.32's ModelConfig() default model.
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "tie_word_embeddings": True, "vocab_size": 151936,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 28, "use_cache": True,
    },
    # vLLM 0.33's test_streaming_lookahead_hashes_follow_recomputed_kv (a hybrid model).
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_theta": 10000000, "partial_rotary_factor": 0.25, "vocab_size": 151936,
        "tie_word_embeddings": False, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "mlp_only_layers": [], "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    # test_priority_scheduler_random (needs torchvision for its video processor).
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 128000, "max_window_layers": 70, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": True, "vocab_size": 151936, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280,
            "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
            "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "ignore_index": -100, "image_token_index": LLAVA_IMAGE_TOKEN,
        "pad_token_id": LLAVA_PAD_TOKEN, "projector_hidden_act": "gelu",
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False, "torch_dtype": "float16",
        "text_config": {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32064,
            "torch_dtype": "float16",
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
            "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
            "patch_size": 14, "projection_dim": 768, "vocab_size": 32000,
        },
    },
}

# Extra files per model (beside config.json).
EXTRA_FILES: dict[str, dict[str, Any]] = {
    "llava-hf/llava-1.5-7b-hf": {
        "preprocessor_config.json": {
            "crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
            "resample": 3, "rescale_factor": 0.00392156862745098,
            "size": {"shortest_edge": 336},
        },
        "processor_config.json": {
            "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
            "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default",
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 32001},
    },
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "preprocessor_config.json": {
            "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        },
        "generation_config.json": {"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
    },
    "facebook/opt-125m": {"generation_config.json": {"bos_token_id": 2, "eos_token_id": 2,
                                                      "pad_token_id": 1}},
    "facebook/opt-350m": {"generation_config.json": {"bos_token_id": 2, "eos_token_id": 2,
                                                      "pad_token_id": 1}},
}


def _word_level_tokenizer(vocab_size: int, special: dict[str, int], unk: str, **kwargs: Any):
    """A fast tokenizer whose vocabulary has ``vocab_size`` ids, special tokens at given ids.

    Word-level over whitespace: every word maps to some id (unknown words to ``unk``), which
    is all the processors need (they count and place the special tokens).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for token, index in special.items():
        vocab.pop(f"w{index}", None)
        vocab[token] = index
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": [t for t in special if t != unk]})
    return fast


def _tokenizers() -> dict[str, Any]:
    llava = _word_level_tokenizer(
        32000, {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": LLAVA_IMAGE_TOKEN,
                "<pad>": LLAVA_PAD_TOKEN}, "<unk>",
        bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    llava.chat_template = (
        "{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    qwen_vl = _word_level_tokenizer(
        151643, {"<unk>": 0, **QWEN_VL_SPECIAL}, "<unk>",
        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    qwen_vl.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return {"llava-hf/llava-1.5-7b-hf": llava, "Qwen/Qwen2.5-VL-3B-Instruct": qwen_vl}


def _snapshot(root: Path, repo_id: str) -> Path:
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION, encoding="utf-8")
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def write_hf_cache(root: str | Path) -> Path:
    """Write the offline cache under ``root`` (the ``HF_HOME``); quick when already there."""
    root = Path(root)
    marker = root / "tokenpace-upstream-hf-cache.json"
    try:
        if json.loads(marker.read_text(encoding="utf-8")).get("format") == FORMAT:
            return root
    except (OSError, ValueError):
        pass
    for repo_id, config in CONFIGS.items():
        snapshot = _snapshot(root, repo_id)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        for name, content in EXTRA_FILES.get(repo_id, {}).items():
            (snapshot / name).write_text(json.dumps(content, indent=1), encoding="utf-8")
    for repo_id, tokenizer in _tokenizers().items():
        tokenizer.save_pretrained(_snapshot(root, repo_id))
    marker.write_text(json.dumps({"format": FORMAT}), encoding="utf-8")
    return root


if __name__ == "__main__":  # python tests/upstream/_hf_cache.py DIR
    import sys

    print(write_hf_cache(sys.argv[1]))

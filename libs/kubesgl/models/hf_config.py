"""Reads HF config fields whose spelling differs across checkpoints and transformers versions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers-5 `rope_parameters` or legacy `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return float(params["rope_theta"]), scaling
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def eos_token_ids(config: Any) -> tuple[int, ...]:
    return _as_ids(getattr(config, "eos_token_id", None))


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """eos ids from generation_config.json (chat models list several there); () when absent."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    return _as_ids(json.loads(path.read_text()).get("eos_token_id"))


def num_experts_of(config: Any) -> int:
    """Qwen3-MoE spells it `num_experts`; transformers 5 saves `num_local_experts`."""
    return getattr(config, "num_experts", None) or config.num_local_experts

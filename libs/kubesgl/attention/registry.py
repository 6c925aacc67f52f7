"""Attention backend selection by name (`--attn`): one name, a `prefill,decode` pair, or `auto`."""

from __future__ import annotations

from typing import Any

import torch

from kubesgl.attention.base import AttentionBackend


def create_backend(name: str, *, device: torch.device, **shape: Any) -> AttentionBackend:
    """Builds the backend `name` for a runner; `shape` carries head counts, dtype and capacity limits."""
    from kubesgl.attention.torch_backend import TorchAttention

    if name in ("auto", "torch"):
        return TorchAttention()
    raise ValueError(f"unknown or unavailable attention backend {name!r}")

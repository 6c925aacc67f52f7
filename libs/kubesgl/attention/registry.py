"""Builds the attention backend named by `--attn`: one name, `prefill,decode` for a hybrid, or `auto`."""

from __future__ import annotations

import importlib.util

import torch

from kubesgl.attention.base import AttentionBackend
from kubesgl.attention.errors import BackendUnavailableError
from kubesgl.attention.hybrid_backend import HybridAttention

BACKEND_NAMES = ("torch", "triton", "flashinfer", "fa3", "triton-split", "triton-planned")


HALF_DTYPES = (torch.float16, torch.bfloat16)  # what FlashInfer's kernels are built for


def resolve_auto(device: torch.device, dtype: torch.dtype) -> str:
    """On CUDA: FlashInfer's prefill with our planned Triton decode (faster than FlashInfer's decode on ragged
    and equal batches alike on the H200: 25.7k vs 24.1k tok/s offline), or Triton for both without FlashInfer
    or for a float32 model (FlashInfer has no float32 kernels); elsewhere the torch reference."""
    if device.type != "cuda":
        return "torch"
    if dtype in HALF_DTYPES and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer,triton"
    return "triton"


def create_backend(
    name: str,
    *,
    device: torch.device | str,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    scale: float | None = None,
) -> AttentionBackend:
    """`scale` (default head_dim ** -0.5) must match the layers' softmax scale; FlashInfer plans with it.

    Raises ValueError for an unknown name and BackendUnavailableError when the backend's package or
    device is missing here.
    """
    device = torch.device(device)
    spec = name.strip().lower()
    if spec == "auto":  # first: what it resolves to may be a hybrid
        spec = resolve_auto(device, dtype)
    if "," in spec:
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) != 2 or "auto" in parts or not all(parts):
            raise ValueError(
                f"attention backend {name!r}: a hybrid is 'prefill,decode', e.g. 'flashinfer,triton'"
            )
        if parts[0] == parts[1]:
            spec = parts[0]
        else:
            kw = dict(
                device=device,
                page_size=page_size,
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                scale=scale,
            )
            return HybridAttention(create_backend(parts[0], **kw), create_backend(parts[1], **kw))
    if spec == "torch":
        from kubesgl.attention.torch_backend import TorchAttention

        return TorchAttention()
    if spec in ("triton", "triton-split", "triton-planned"):
        from kubesgl.attention.triton_backend import DEFAULT_DECODE_SCHEDULE, TritonAttention

        schedule = spec.partition("-")[2] or DEFAULT_DECODE_SCHEDULE  # the decode work split (triton_backend)
        return TritonAttention(
            device=device,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            decode_schedule=schedule,
        )
    if spec == "flashinfer":
        from kubesgl.attention.flashinfer_backend import FlashInferAttention

        if dtype not in HALF_DTYPES:  # FlashInfer would fail deep in its JIT with a KeyError
            raise BackendUnavailableError(
                f"attention backend 'flashinfer' needs a float16 or bfloat16 model, got {dtype}: "
                "use --dtype bfloat16, or --attn triton / torch"
            )

        return FlashInferAttention(
            device=device,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            scale=scale,
        )
    if spec == "fa3":
        from kubesgl.attention.fa3_backend import FA3Attention

        return FA3Attention(device=device)
    raise ValueError(
        f"unknown attention backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}, 'auto', "
        "or 'prefill,decode' (e.g. 'flashinfer,triton')"
    )

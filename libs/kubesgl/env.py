"""Every environment switch the library reads, in one place, read when asked (so a test's setenv is seen).

Settings that have a flag are flags; these are the few that are not: a debugging or profiling switch, where
the demo model is built, and the API key a client sends. NATS credentials (`runtime.nats_conn.NatsSettings`)
and OpenTelemetry's own OTEL_* variables are read where they are used, from a mapping a test can give.
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = ("1", "true", "True")
_FALSE = ("0", "false", "False")


def disable_overlap_scheduling() -> bool:
    """KUBESGL_DISABLE_OVERLAP_SCHEDULING (or Mini-SGLang's MINISGL_DISABLE_OVERLAP_SCHEDULING) = 1/true."""
    off = os.environ.get(
        "KUBESGL_DISABLE_OVERLAP_SCHEDULING", os.environ.get("MINISGL_DISABLE_OVERLAP_SCHEDULING")
    )
    return off in _TRUE


def step_profile() -> bool:
    """KUBESGL_STEP_PROFILE set and not 0: the engine times each phase of its steps (engine/step_profile.py)."""
    return os.environ.get("KUBESGL_STEP_PROFILE", "") not in ("", "0")


def step_log() -> str | None:
    """KUBESGL_STEP_LOG=path: the engine appends one JSON line per step to `path` (engine/step_log.py)."""
    return os.environ.get("KUBESGL_STEP_LOG") or None


def disable_pdl() -> bool:
    """KUBESGL_DISABLE_PDL = 1/true: our Triton kernels launch without programmatic dependent launch
    (kernels/pdl.py); for ablations and for drivers that refuse it."""
    return os.environ.get("KUBESGL_DISABLE_PDL") in _TRUE


def fused_mlp() -> bool:
    """KUBESGL_FUSED_MLP = 1/true: dense MLPs of up to 16 rows run as one Triton kernel (kernels/fused_mlp.py)."""
    return os.environ.get("KUBESGL_FUSED_MLP") in _TRUE


def gemv() -> bool:
    """Projections of up to 4 rows run as one Triton GEMV kernel on CUDA (kernels/gemv.py) unless KUBESGL_GEMV =
    0/false (cuBLAS then, for ablations)."""
    return os.environ.get("KUBESGL_GEMV") not in _FALSE


def gemv_silu() -> bool:
    """With the GEMV on, a dense MLP's gate_up projection of up to 4 rows and its SiLU·mul run as one kernel
    (kernels/gemv.py) unless KUBESGL_GEMV_SILU = 0/false."""
    return os.environ.get("KUBESGL_GEMV_SILU") not in _FALSE


def gemv_norm() -> bool:
    """With the GEMV on, the RMSNorm before a decoder's qkv and gate_up projections of up to 4 rows runs inside
    the projection's kernel (kernels/gemv.py) unless KUBESGL_GEMV_NORM = 0/false."""
    return os.environ.get("KUBESGL_GEMV_NORM") not in _FALSE


def skinny_gemm() -> bool:
    """Projections of 5-256 rows run as the mid-batch Triton GEMM on Hopper where its measured table has their
    shape (kernels/gemv.py) unless KUBESGL_SKINNY_GEMM = 0/false (cuBLAS then, for ablations)."""
    return os.environ.get("KUBESGL_SKINNY_GEMM") not in _FALSE


def skinny_configs() -> str | None:
    """KUBESGL_SKINNY_CONFIGS=path: the mid-batch GEMM's table from a sweep's JSON (benchmark/skinny_sweep.py
    --table) instead of the built-in one."""
    return os.environ.get("KUBESGL_SKINNY_CONFIGS") or None


def cache_dir() -> Path:
    """Where the demo model is built: $KUBESGL_CACHE, else ~/.cache/kubesgl."""
    return Path(os.environ.get("KUBESGL_CACHE") or Path.home() / ".cache" / "kubesgl")


def api_key(openai_fallback: bool = False) -> str | None:
    """The key a client sends the gateway: $KUBESGL_API_KEY (else, when asked, $OPENAI_API_KEY)."""
    key = os.environ.get("KUBESGL_API_KEY")
    if openai_fallback:
        return key or os.environ.get("OPENAI_API_KEY")
    return key


def torch_compile_cache_dir() -> Path:
    """Inductor's cache under --enable-torch-compile (compiled kernels and graphs, so a restart skips most of
    the compile): $KUBESGL_TORCH_COMPILE_CACHE, else inductor/ in `cache_dir()`. An explicit
    $TORCHINDUCTOR_CACHE_DIR wins over both."""
    return Path(os.environ.get("KUBESGL_TORCH_COMPILE_CACHE") or cache_dir() / "inductor")


def torch_compile_dynamic() -> bool:
    """KUBESGL_TORCH_COMPILE_DYNAMIC=1/true: compile once with the batch dimension dynamic instead of once per
    batch size (a measurement switch: compile time against step time)."""
    return os.environ.get("KUBESGL_TORCH_COMPILE_DYNAMIC") in _TRUE

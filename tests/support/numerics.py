"""How far apart two floating-point evaluations of one value may land: a tolerance from the dtype and the size
of the sums, never from what one CPU happened to round to.

Two evaluations of the same formula differ when their sums run in another order: another batch shape (a GEMM's
row count picks its kernel: one row runs a GEMV, a few rows another blocking, so a request scored alone and the
same request inside a batch round differently), another thread count, another SIMD width
(ATEN_CPU_CAPABILITY), another backend (HF transformers' ops against ours). Neither order is the right one, so
a test comparing them needs the size of that difference.

The bound used is the probabilistic one of Higham & Mary ("A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4): a length-n sum or dot product computed in any order
has relative error at most ``lam * sqrt(n) * u`` (u the dtype's unit roundoff) with probability at least
``1 - 2 n exp(-lam**2 / 2)``; with ``LAMBDA = 8`` that is ~1e-11 for the sums here, so a failure means a real
difference, not rounding. The worst-case bound (n * u) is the same with sqrt(n) replaced by n: sound but so
loose that it would hide real errors.

Where two runs are bit-identical (the same kernels on the same shapes in the same process) tests say so and
compare exactly instead.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import torch

LAMBDA = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the distance from 1 to the next representable number (2**-24 for float32, 2**-8 for bf16)."""
    return torch.finfo(dtype).eps / 2


def reorder_bound(dtype: torch.dtype, n: int) -> float:
    """Relative error a length-`n` reduction in `dtype` may pick up from its summation order alone."""
    return LAMBDA * math.sqrt(max(n, 1)) * unit_roundoff(dtype)


def forward_rounding_steps(config: dict, context: int) -> int:
    """The rounding steps along one token's path through a decoder-only transformer (HF config dict) with
    `context` tokens attended: the reduction lengths of every norm, projection, attention sum and residual on
    the way from the embedding to the logits, added up (errors of sequential stages add).

    Each layer's error is taken as relative to that layer's output: in a pre-norm residual decoder every
    stage reads a normalized input, so no stage amplifies what the earlier ones got wrong beyond its weights'
    norms, which the logit scale below carries."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    qk_norm = head_dim if config.get("model_type", "").startswith("qwen3") else 0
    routing = config.get("num_experts_per_tok", 0) + (hidden if config.get("num_experts") else 0)  # gate, mix
    attention = (
        hidden + qk_norm + head_dim + 2 * context + heads * head_dim
    )  # norm, qkv, qk-norm, QK, softmax, PV, o
    mlp = 2 * hidden + inter + routing  # norm, gate/up, down, (router + expert mix)
    return config["num_hidden_layers"] * (attention + mlp + 2) + 2 * hidden  # + final norm, LM head


@cache
def _checkpoint(model_dir: str) -> tuple[dict, float]:
    """The checkpoint's config and an upper bound on any of its logits (Cauchy-Schwarz through the final RMSNorm
    and the LM head): the size the logits' rounding errors are relative to."""
    from safetensors import safe_open

    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for name in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
                if name in names:
                    weights[name] = st.get_tensor(name).float()
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    # |z_v| = |(g * x_hat) . w_v| <= max|g| * ||x_hat|| * ||w_v||, and RMSNorm makes ||x_hat|| = sqrt(hidden).
    scale = (
        weights["model.norm.weight"].abs().max().item()
        * math.sqrt(head.shape[1])
        * head.norm(dim=1).max().item()
    )
    return config, scale


def logits_tolerance(model_dir: str | Path, context: int, dtype: torch.dtype = torch.float32) -> float:
    """The largest difference two `dtype` forward passes of the checkpoint may show in one logit when only their
    summation orders differ (batch shape, threads, SIMD width, backend)."""
    config, scale = _checkpoint(str(model_dir))
    return reorder_bound(dtype, forward_rounding_steps(config, context)) * scale


def logprob_tolerance(model_dir: str | Path, context: int, dtype: torch.dtype = torch.float32) -> float:
    """The same for a log-probability, log_softmax(z)[t] = z_t - logsumexp(z): the error of z_t plus that of the
    logsumexp (the largest logit's error, plus the vocab-long sum's own rounding, relative to a sum >= 1)."""
    config, _ = _checkpoint(str(model_dir))
    return 2 * logits_tolerance(model_dir, context, dtype) + reorder_bound(dtype, config["vocab_size"])


def assert_topk_matches(got_ids: list[int], ref_logprobs: torch.Tensor, tol: float) -> None:
    """`got_ids` are the reference row's top len(got_ids) entries, best first, where entries closer than `tol`
    may come in either order (rounding alone can swap a near-tie): the i-th id's reference value is the
    reference's i-th largest value, within tol."""
    k = len(got_ids)
    want = ref_logprobs.topk(k).values.tolist()
    have = ref_logprobs[got_ids].tolist()
    assert len(set(got_ids)) == k, got_ids
    for i, (h, w) in enumerate(zip(have, want, strict=True)):
        assert abs(h - w) <= tol, (
            f"rank {i}: token {got_ids[i]} has {h}, the reference's rank-{i} value is {w}"
        )


# Where the bound above is vacuous: two bfloat16 runs of one checkpoint whose kernels differ (another batch
# shape, another attention backend) round every stage's output to bf16's 8 significant bits, so their logits
# differ by a few units in the last place of the logits' own size; the summation-order bound above, with a
# Cauchy-Schwarz scale, puts that difference above the logits themselves. A top-2 gap within BF16_TIE_ULPS of
# bf16's spacing at the step's largest logit is a tie either run may break its own way.
BF16_TIE_ULPS = 4


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at magnitude |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def bf16_tie(top_logit: float) -> float:
    """The top-2 gap under which two bf16 evaluations of a step may pick different greedy tokens."""
    return BF16_TIE_ULPS * bf16_ulp(top_logit)


def elementwise_bound(dtype: torch.dtype, roundings: int) -> float:
    """Norm-wise relative error of an elementwise formula of `roundings` sequential roundings (each operation,
    and each libm transcendental at <= 1 ulp, rounds once) whose terms do not cancel."""
    return roundings * unit_roundoff(dtype)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A seeded standard normal CPU tensor times `scale`, in `dtype`: the kernel tests' inputs."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32, after checking the shapes agree and `out` is finite."""
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()

"""Shared helpers for engine tests: HF greedy reference and tie-tolerant comparison."""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's argmax continuation by full re-forward each step, and the top-2 logit gap at each step."""
    ids = list(prompt)
    out, gaps = [], []
    for _ in range(n):
        device = next(hf_model.parameters()).device
        logits = hf_model(torch.tensor([ids], device=device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
    return out, gaps


@torch.no_grad()
def hf_top_logits(hf_model: torch.nn.Module, prompt: list[int], out: list[int]) -> list[float]:
    """The largest logit magnitude at each step of `out` after `prompt`, from one teacher-forced forward: the
    size a bf16 run's rounding is relative to (support.numerics.bf16_tie)."""
    device = next(hf_model.parameters()).device
    logits = hf_model(torch.tensor([prompt + out], device=device)).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)].abs().max(dim=-1).values.tolist()


def assert_greedy_match(
    ours: list[int], ref: list[int], gaps: list[float], tie: float | Sequence[float]
) -> None:
    """Equal at every step, except that a near-tie in HF's logits ends the comparison (both are right). `tie`:
    the largest top-2 gap that rounding alone can flip, twice a logit's tolerance (support.numerics); one for
    every step, or one per step (bf16_tie of each step's largest logit)."""
    ties = [tie] * len(gaps) if isinstance(tie, float | int) else list(tie)
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if gaps[i] < ties[i]:
            return
        assert a == b, f"step {i}: ours {a} != HF {b} (gap {gaps[i]:.3g}); ours={ours} ref={ref}"
    assert len(ours) == len(ref), f"length differs: {len(ours)} vs {len(ref)}"

"""Shared helpers for engine tests: HF greedy reference and tie-tolerant comparison."""

from __future__ import annotations

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


def assert_greedy_match(ours: list[int], ref: list[int], gaps: list[float], tie: float) -> None:
    """Equal at every step, except that a near-tie in HF's logits ends the comparison (both are right). `tie`:
    the largest top-2 gap that rounding alone can flip, twice a logit's tolerance (support.numerics)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if gaps[i] < tie:
            return
        assert a == b, f"step {i}: ours {a} != HF {b} (gap {gaps[i]:.3g}); ours={ours} ref={ref}"
    assert len(ours) == len(ref), f"length differs: {len(ours)} vs {len(ref)}"

"""A step's results on the device and their read-back: `StepResult.to_host` is the one place the host waits for
the device; `PendingSample` is a launched step whose grammar rows still wait for their token bitmask."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kubesgl.engine.plan import BatchPlan, StepTokens
from kubesgl.engine.transfer import to_device
from kubesgl.values.outputs import TokenLogprob


@dataclass
class StepResult:
    """Device-side results of one step; `to_host` is the only place the host waits for the device."""

    plan: BatchPlan
    tokens: torch.Tensor  # [num sampled]
    chosen_lp: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_lp: torch.Tensor | None
    event: torch.cuda.Event | None = None
    prompt: PromptLogprobs | None = None

    def to_host(self) -> StepTokens:
        if self.event is not None:
            self.event.synchronize()
        toks = self.tokens.tolist()
        prompt = self.prompt.to_host(self.plan) if self.prompt is not None else {}
        if self.chosen_lp is None and len(toks) == len(self.plan.sample):  # every row sampled, no logprobs
            return StepTokens(toks, [None] * len(toks), prompt)
        chosen = self.chosen_lp.tolist() if self.chosen_lp is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lp = self.top_lp.tolist() if self.top_lp is not None else None
        out_tokens: list[int] = []
        out_lps: list[TokenLogprob | None] = []
        j = 0
        for sample, n_top in zip(self.plan.sample, self.plan.top_logprobs, strict=True):
            if not sample:
                out_tokens.append(-1)
                out_lps.append(None)
                continue
            out_tokens.append(toks[j])
            if chosen is not None and n_top is not None:
                top = tuple(zip(top_ids[j][:n_top], top_lp[j][:n_top], strict=True)) if n_top else ()
                out_lps.append(TokenLogprob(toks[j], chosen[j], top))
            else:
                out_lps.append(None)
            j += 1
        return StepTokens(out_tokens, out_lps, prompt)


# Prompt positions scored per slice: [rows, vocab] float32 logits of a whole 8k-token chunk would be gigabytes.
_PROMPT_LOGITS_ROWS = 512


@dataclass
class PromptLogprobs:
    """Device-side prompt-token logprobs of one step, the plan's PromptLogprobRows concatenated in order."""

    chosen: torch.Tensor  # [positions] the logprob of each target
    top_ids: torch.Tensor | None  # [positions, max top]
    top_lp: torch.Tensor | None

    @classmethod
    def compute(
        cls,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        plan: BatchPlan,
        row_starts: np.ndarray,
    ) -> PromptLogprobs:
        """Scores the plan's prompt rows from the step's hidden states (`row_starts`: each row's first token
        in `hidden`); every TP rank runs it alike (compute_logits gathers the vocab across ranks)."""
        rows = plan.prompt_logprobs
        index = np.concatenate(
            [row_starts[r.row] + r.offset + np.arange(len(r.targets), dtype=np.int64) for r in rows]
        )
        targets = [t for r in rows for t in r.targets]
        io = to_device([*index.tolist(), *targets], torch.int64, hidden.device)
        index_t, targets_t = io.view(2, -1)
        n_top = max(r.top for r in rows)
        chosen, top_ids, top_lp = [], [], []
        for a in range(0, len(targets), _PROMPT_LOGITS_ROWS):
            b = a + _PROMPT_LOGITS_ROWS
            logprobs = torch.log_softmax(compute_logits(hidden[index_t[a:b]]).float(), dim=-1)
            chosen.append(logprobs.gather(1, targets_t[a:b, None]).squeeze(1))
            if n_top:
                lp, ids = logprobs.topk(n_top, dim=-1)
                top_lp.append(lp)
                top_ids.append(ids)
        if not n_top:
            return cls(torch.cat(chosen), None, None)
        return cls(torch.cat(chosen), torch.cat(top_ids), torch.cat(top_lp))

    def to_cpu(self) -> PromptLogprobs:
        """Asynchronous copies; StepResult's event marks when they are done."""
        chosen, top_ids, top_lp = (
            t.to("cpu", non_blocking=True) if t is not None else None
            for t in (self.chosen, self.top_ids, self.top_lp)
        )
        assert chosen is not None
        return PromptLogprobs(chosen, top_ids, top_lp)

    def to_host(self, plan: BatchPlan) -> dict[int, list[TokenLogprob]]:
        chosen = self.chosen.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lp = self.top_lp.tolist() if self.top_lp is not None else None
        out: dict[int, list[TokenLogprob]] = {}
        j = 0
        for r in plan.prompt_logprobs:
            entries = []
            for t in r.targets:
                top = ()
                if r.top and top_ids is not None and top_lp is not None:
                    top = tuple(zip(top_ids[j][: r.top], top_lp[j][: r.top], strict=True))
                entries.append(TokenLogprob(t, chosen[j], top))
                j += 1
            out[r.row] = entries
        return out


@dataclass
class PendingSample:
    """A launched step's sampler inputs; returned unsampled when grammar rows wait for their bitmask."""

    plan: BatchPlan
    logits: torch.Tensor  # [num sampled, V] float32
    slots_t: torch.Tensor
    seq_lens_t: torch.Tensor
    prompt: PromptLogprobs | None = None

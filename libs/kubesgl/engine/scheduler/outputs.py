"""Outputs: a finished step's sampled tokens (and prompt logprobs) applied to their requests, the stop checks,
and what each request reports."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kubesgl.engine.plan import BatchPlan, StepTokens
from kubesgl.engine.request import Req, ReqState
from kubesgl.engine.scheduler.limits import SchedulerCounters, SchedulerLimits
from kubesgl.engine.scheduler.memory import Memory
from kubesgl.errors import KubesglError
from kubesgl.kv.prefix_cache import CacheHandle
from kubesgl.structured.matcher import GrammarRejectedToken
from kubesgl.values.outputs import FinishReason, RequestOutput, TokenLogprob
from kubesgl.values.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class HandedOff:
    """A prefill-role request after its first token: what the decode instance needs to go on, and the lock on
    its prompt's cached `pages` (full pages only) that holds their KV until the transfer ends."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    output: RequestOutput  # its first token(s) and prompt logprobs, not yet reported to anyone
    logprobs: list[TokenLogprob]
    pages: list[int]
    lock: CacheHandle | None


class Outputs:
    def __init__(
        self, limits: SchedulerLimits, memory: Memory, reqs: dict[str, Req], counters: SchedulerCounters
    ) -> None:
        self.limits = limits
        self.memory = memory
        self.reqs = reqs
        self.counters = counters
        self._finished_unreported: list[Req] = []
        self.handed_off: list[HandedOff] = []  # taken by the prefill role (Scheduler.take_handed_off)

    @property
    def has_unreported(self) -> bool:
        return bool(self._finished_unreported)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Ends the request (its memory goes back); its output goes with the next `process` or `drain`."""
        if req.state is ReqState.RUNNING:
            self.memory.release(req)
        req.finish(reason)
        self._finished_unreported.append(req)

    def process(self, plan: BatchPlan, reqs: list[Req], out: StepTokens) -> list[RequestOutput]:
        """Applies a finished step's sampled tokens; returns the outputs it produced (incl. aborts)."""
        eos = self.limits.eos_token_ids
        touched: list[Req] = []
        prefilled = plan.num_extend  # rows before it are prefill chunks, after it decode rows
        for rows in plan.prompt_logprobs:
            req = reqs[rows.row]  # even if preempted since: a launched step's logits are valid
            if not req.finished:
                req.prompt_logprobs += out.prompt_logprobs[rows.row]
        for i, req in enumerate(reqs):
            if not plan.sample[i]:
                final_chunk = (
                    i < prefilled and plan.prefix_lens[i] + plan.extend_lens[i] == req.prefill_target
                )
                if final_chunk and req.max_new_tokens == 0 and not req.finished:
                    self.finish(req, FinishReason.LENGTH)  # prefill only (max_tokens 0): its prompt is done
                continue
            req.pending -= 1
            if req.finished:
                continue  # finished while this step was in flight; its extra token is dropped
            tok = out.tokens[i]
            req.output_ids.append(tok)
            self.counters.generation_tokens += 1
            if out.logprobs[i] is not None:
                req.logprobs.append(out.logprobs[i])
            touched.append(req)
            p = req.params
            if req.grammar is not None and not self._accept(req, tok):
                continue
            if (
                (tok in eos and not p.ignore_eos)
                or tok in p.stop_token_ids
                or (req.grammar is not None and req.grammar.finished)
            ):
                self.finish(req, FinishReason.STOP)
            elif len(req.output_ids) >= req.max_new_tokens or req.num_known >= self.limits.context_len:
                self.finish(req, FinishReason.LENGTH)
            elif req.hand_off:
                touched.pop()
                self._hand_off(req)
            elif i < prefilled:  # prefill just completed: share the prompt with later requests
                self.memory.cache_prefix(req, min(req.prefill_target, req.num_known))
        return [self._output(r) for r in touched if not r.finished] + self.drain_finished()

    def _hand_off(self, req: Req) -> None:
        lock, pages = self.memory.hand_off(req)
        output = self._output(req)
        self.reqs.pop(req.rid, None)
        self.handed_off.append(
            HandedOff(req.rid, req.input_ids, req.params, req.seed, output, list(req.logprobs), pages, lock)
        )

    def _accept(self, req: Req, tok: int) -> bool:
        """Advances the request's matcher; a token its grammar refuses (a masking bug) fails only this request."""
        assert req.grammar is not None
        try:
            req.grammar.accept(tok)
        except GrammarRejectedToken as e:
            log.error("request %s: %s", req.rid, e)
            req.error = KubesglError(f"internal error: {e}")
            self.finish(req, FinishReason.ABORT)
            return False
        return True

    def drain_finished(self) -> list[RequestOutput]:
        """Outputs of requests finished outside a step (aborts)."""
        outs = [self._output(r) for r in self._finished_unreported]
        self._finished_unreported.clear()
        return outs

    def _output(self, req: Req) -> RequestOutput:
        new = req.output_ids[req.emitted :]
        lps = req.logprobs[req.emitted - req.resumed :] if req.params.logprobs is not None else None
        lp = req.params.logprobs
        prompt_lps = None
        if lp is not None and lp.prompt_start is not None and not req.prompt_logprobs_sent:
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
        req.emitted = len(req.output_ids)
        if req.finished:
            self.reqs.pop(req.rid, None)
        return RequestOutput(
            rid=req.rid,
            new_token_ids=new,
            prompt_tokens=len(req.input_ids),
            cached_tokens=max(req.cached_tokens, 0),
            completion_tokens=len(req.output_ids),
            finished=req.finished,
            finish_reason=req.finish_reason,
            logprobs=lps,
            prompt_logprobs=prompt_lps,
            error=req.error if req.finished else None,
        )

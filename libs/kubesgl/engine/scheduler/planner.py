"""The planner: which rows a step runs. Extend plans (prefill chunks up to the token budget, decode rows riding
along in a mixed step), decode plans (one token for every decoding request, preempting when memory is short)."""

from __future__ import annotations

from kubesgl.engine.plan import BatchPlan, PromptLogprobRows
from kubesgl.engine.request import Req, ReqState
from kubesgl.engine.scheduler.admission import Admission
from kubesgl.engine.scheduler.limits import SchedulerLimits
from kubesgl.engine.scheduler.memory import Memory
from kubesgl.engine.scheduler.outputs import Outputs
from kubesgl.structured.matcher import GrammarState
from kubesgl.values.outputs import FinishReason

# A planned step: its plan and its requests, one per row.
Scheduled = tuple[BatchPlan, list[Req]]


class Planner:
    def __init__(
        self, limits: SchedulerLimits, admission: Admission, memory: Memory, outputs: Outputs
    ) -> None:
        self.limits = limits
        self.admission = admission
        self.memory = memory
        self.outputs = outputs

    def decode_ready(self) -> list[Req]:
        """Running requests that take a decode step now, oldest first."""
        ctx = self.limits.context_len
        batch = [
            r
            for r in self.memory.running
            if not r.is_prefilling
            and not r.hand_off
            and len(r.output_ids) + r.pending < r.max_new_tokens
            and r.kv_len + 1 < ctx
        ]
        batch.sort(key=lambda r: r.arrival)
        return batch

    def prefill_ready(self) -> list[Req]:
        """Chunked requests first, then the queue."""
        return [r for r in self.memory.running if r.is_prefilling] + self.admission.ready()

    def extend(self, candidates: list[Req], decoding: list[Req]) -> Scheduled | None:
        """Prefill chunks of `candidates` up to the token budget. `decoding` (mixed chunk) ride along as the
        plan's last rows; as in SGLang each counts one token against the budget, so a step stays within
        --max-prefill-length. None when no prefill fits, with them or (decoding empty) at all; a failed attempt
        leaves the queue as it was (an admission it took back heads the queue)."""
        mem = self.memory
        budget = self.limits.max_prefill_tokens - len(decoding)
        reserved = mem.decode_pages(decoding)  # kept free for the decode rows through the loop
        if decoding and (budget <= 0 or not mem.make_room(reserved)):
            return None
        plan = BatchPlan("extend", [], [], [], [], [], [])
        reqs: list[Req] = []
        for req in candidates:
            if budget <= 0:
                break
            admitted_now = req.state is ReqState.WAITING
            if admitted_now:
                if not mem.has_free_slot:
                    break
                self.admission.waiting.remove(req)
                mem.admit(req, plan)
            chunk = min(req.prefill_target - req.kv_len, budget)
            need = mem.pages_short(req, req.kv_len + chunk)
            # New work must leave each decoding request room for its next page.
            headroom = sum(1 for r in mem.running if not r.is_prefilling) if admitted_now else 0
            if not mem.make_room(need + headroom + reserved):
                if admitted_now:
                    mem.unadmit(req, plan)
                    self.admission.waiting.appendleft(req)
                break
            mem.grow(req, need, plan)
            _add_prompt_logprob_rows(plan, req, chunk)
            plan.slots.append(req.slot)
            plan.prefix_lens.append(req.kv_len)
            plan.extend_lens.append(chunk)
            plan.tokens += req.all_ids[req.kv_len : req.kv_len + chunk]
            req.kv_len += chunk
            # max_tokens 0: the prompt's last chunk samples nothing (Outputs.process ends the request).
            last = req.kv_len == req.prefill_target and req.max_new_tokens > 0
            if last and req.grammar is not None:
                plan.grammar_rows.append(len(plan.sample) - plan.sample.count(False))
            plan.sample.append(last)
            plan.top_logprobs.append(_top_logprobs(req) if last else None)
            req.pending += last
            budget -= chunk
            reqs.append(req)
        if not reqs:
            return None
        if decoding:
            self._add_decode_rows(plan, decoding)
            plan.num_decode = len(decoding)
            reqs += decoding
        return plan, reqs

    def decode(self, batch: list[Req]) -> Scheduled | None:
        """One token for each of `batch`; while their pages do not fit, a chunked request gives way, else the
        newest of the batch (a lone request that still does not fit ends: the KV cache cannot hold it)."""
        mem = self.memory
        while batch:
            if mem.make_room(mem.decode_pages(batch)):
                break
            chunking = [r for r in mem.running if r.is_prefilling]
            if chunking:  # half-prefilled requests give way first: decoders are closer to done
                self._preempt(max(chunking, key=lambda r: r.arrival))
            elif len(batch) == 1:
                self.outputs.finish(batch.pop(), FinishReason.LENGTH)
            else:
                self._preempt(batch.pop())
        if not batch:
            return None
        plan = BatchPlan("decode", [], [], [], [], [], [])
        self._add_decode_rows(plan, batch)
        return plan, batch

    def _preempt(self, req: Req) -> None:
        self.memory.preempt(req)
        self.admission.requeue(req)

    def _add_decode_rows(self, plan: BatchPlan, batch: list[Req]) -> None:
        """One decode row per request (its next page allocated): the token at position kv_len, sampled."""
        for req in batch:
            self.memory.grow(req, self.memory.pages_short(req, req.kv_len + 1), plan)
            plan.slots.append(req.slot)
            plan.prefix_lens.append(req.kv_len)
            plan.extend_lens.append(1)
            if req.grammar is not None:
                plan.grammar_rows.append(len(plan.sample) - plan.sample.count(False))
            plan.sample.append(True)
            plan.top_logprobs.append(_top_logprobs(req))
            req.kv_len += 1
            req.pending += 1


def _add_prompt_logprob_rows(plan: BatchPlan, req: Req, chunk: int) -> None:
    """The prompt logprobs this chunk's logits give: position p's logits predict prompt token p + 1."""
    nxt = req.prompt_logprob_next
    if nxt is None:
        return
    first = nxt - 1  # >= kv_len: admission matched the prefix cache only up to here
    end = min(req.kv_len + chunk, len(req.input_ids) - 1)
    if end > first:
        assert req.params.logprobs is not None and first >= req.kv_len
        targets = tuple(req.input_ids[first + 1 : end + 1])
        plan.prompt_logprobs.append(
            PromptLogprobRows(len(plan.slots), first - req.kv_len, targets, req.params.logprobs.top)
        )
        req.prompt_logprob_next = end + 1 if end + 1 < len(req.input_ids) else None


def _top_logprobs(req: Req) -> int | None:
    return req.params.logprobs.top if req.params.logprobs is not None else None


def grammar_states(plan: BatchPlan, reqs: list[Req]) -> list[GrammarState | None]:
    """The matchers of the plan's grammar rows, in order (None: the request finished meanwhile)."""
    sampled = [r for r, s in zip(reqs, plan.sample, strict=True) if s]
    return [sampled[i].grammar for i in plan.grammar_rows]

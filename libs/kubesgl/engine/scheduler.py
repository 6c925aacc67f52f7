"""Continuous batching: admission, chunked prefill, decode, eviction, preemption, and turning sampled tokens
into per-request outputs. Pure host-side bookkeeping; the runner does the math."""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kubesgl.engine.grammar import EngineGrammars
from kubesgl.engine.plan import BatchPlan, PromptLogprobRows, SlotInit
from kubesgl.engine.request import Req, ReqState
from kubesgl.errors import ContextLengthError, InvalidRequestError, KubesglError
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import PrefixCache
from kubesgl.structured.compiler import CompiledConstraint
from kubesgl.structured.matcher import GrammarRejectedToken, GrammarState
from kubesgl.values.outputs import FinishReason, RequestOutput, TokenLogprob
from kubesgl.values.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    max_running_requests: int
    max_prefill_tokens: int
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    default_max_tokens: int | None = None  # budget of a request without max_tokens (None: the whole context)
    enable_mixed_chunk: bool = False  # prefill steps carry the decode batch (SGLang's --enable-mixed-chunk)


@dataclass
class StepTokens:
    """What the host reads back after a step: per request of the plan, the sampled token (or -1)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # by plan row


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        pool: PagePool,
        cache: PrefixCache,
        seed: int = 0,
        grammars: EngineGrammars | None = None,  # None: the model has no tokenizer, constraints are refused
    ) -> None:
        self.limits = limits
        self.grammars = grammars
        self.pool = pool
        self.cache = cache
        self.waiting: deque[Req] = deque()
        # Queued requests whose grammar is still compiling: what _resolve_grammars looks at, so a step scans
        # nothing when no grammar is compiling (not the whole queue, every step).
        self._compiling: list[Req] = []
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._free_slots = list(range(limits.max_running_requests - 1, -1, -1))
        self._arrival = itertools.count()
        self._rng = random.Random(seed)
        self._finished_unreported: list[Req] = []
        self._pending_page_writes: list[tuple[Req, int, int, list[int]]] = []
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions = 0
        # Steps planned by kind ("extend", "mixed", "decode") and decode rows that rode in mixed steps.
        self.steps: Counter[str] = Counter()
        self.mixed_decode_rows = 0

    # -- requests in and out -----------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if rid in self.reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        if not input_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        n, ctx = len(input_ids), self.limits.context_len
        if n >= ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {ctx} tokens. However, the prompt has {n} tokens "
                "(at least one token must be left for the completion).",
                param="prompt",
            )
        room = self.pool.capacity * self.pool.page_size
        if n + 1 > room:
            raise ContextLengthError(
                f"The prompt has {n} tokens but this instance's KV cache holds at most {room} tokens.",
                param="prompt",
            )
        bad = next((t for t in input_ids if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.limits.vocab_size})", param="prompt"
            )
        bad = next((t for t, _ in params.logit_bias if t >= self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {self.limits.vocab_size})",
                param="logit_bias",
            )
        if params.constraint is not None and self.grammars is None:
            raise InvalidRequestError(
                "this model directory has no tokenizer, so it cannot constrain outputs to a grammar",
                param=params.constraint.param,
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        # The one place an open-ended max_tokens gets its meaning: the server's default, else no cap but the
        # context (every request also stops where the context ends, so the budget is min(N, rest of context)).
        budget = params.max_tokens if params.max_tokens is not None else self.limits.default_max_tokens
        req = Req(
            rid=rid,
            input_ids=list(input_ids),
            params=params,
            seed=seed,
            arrival=next(self._arrival),
            max_new_tokens=budget if budget is not None else ctx - n,
        )
        if params.constraint is not None:
            assert self.grammars is not None
            req.grammar_future = self.grammars.submit(params.constraint)
            self._compiling.append(req)
        start = params.logprobs.prompt_start if params.logprobs is not None else None
        if start == 0:
            req.prompt_logprobs.append(TokenLogprob(input_ids[0], None))  # nothing before it to predict it
        if start is not None and max(start, 1) < n:
            req.prompt_logprob_next = max(start, 1)
        self.reqs[rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        if req.state is ReqState.WAITING:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_unreported)

    # -- scheduling ----------------------------------------------------------------------------------
    def schedule(self) -> tuple[BatchPlan, list[Req]] | None:
        """The next batch: prefill work first (new or chunked requests), else one decode step for all. With
        mixed chunks on, a prefill step also carries every decode-ready request, one token each."""
        self._resolve_grammars()
        decoding = self._decode_ready()
        prefill = [r for r in self.running if r.is_prefilling] + [
            r for r in self.waiting if r.pending == 0 and r.grammar_future is None
        ]
        scheduled = None
        if prefill and self.limits.enable_mixed_chunk and decoding:
            scheduled = self._schedule_extend(prefill, decoding)
        # Without mixing, or when the decode rows leave no budget or memory for any prefill: as without the flag
        # (the decode step after it is where memory pressure preempts).
        if prefill and scheduled is None:
            scheduled = self._schedule_extend(prefill, [])
        scheduled = scheduled or self._schedule_decode(decoding)
        if scheduled is None:
            return None
        plan = scheduled[0]
        kind = "mixed" if plan.num_decode else plan.mode
        self.steps[kind] += 1
        self.mixed_decode_rows += plan.num_decode
        if self._pending_page_writes:
            # Page-table rows changed by the prefix cache go first: the plan's own writes may extend them.
            live = [(s, i, p) for r, s, i, p in self._pending_page_writes if r.slot == s]
            plan.page_writes[:0] = live
            self._pending_page_writes = []
        return scheduled

    def _resolve_grammars(self) -> None:
        """Queued requests whose grammar finished compiling get their matcher (or fail, when it did not)."""
        if not self._compiling:
            return
        # An aborted request left the queue and dropped its future (_finish): it only leaves this list.
        done: list[Req] = []
        still: list[Req] = []
        for r in self._compiling:
            (done if r.grammar_future is None or r.grammar_future.done() else still).append(r)
        self._compiling = still
        for req in done:
            future, req.grammar_future = req.grammar_future, None
            if future is None:
                continue
            err = future.exception()
            if err is None:
                stops = (*self.limits.eos_token_ids, *req.params.stop_token_ids)
                req.grammar = GrammarState(future.result(), stops)
                continue
            self.waiting.remove(req)
            req.error = err if isinstance(err, KubesglError) else InvalidRequestError(str(err))
            self._finish(req, FinishReason.ABORT)

    def grammar_pending(self) -> Future[CompiledConstraint] | None:
        """A grammar some queued request waits for (the engine idles on it when nothing else can run)."""
        return next((r.grammar_future for r in self._compiling if r.grammar_future is not None), None)

    @staticmethod
    def grammar_states(plan: BatchPlan, reqs: list[Req]) -> list[GrammarState | None]:
        """The matchers of the plan's grammar rows, in order (None: the request finished meanwhile)."""
        sampled = [r for r, s in zip(reqs, plan.sample, strict=True) if s]
        return [sampled[i].grammar for i in plan.grammar_rows]

    def _decode_ready(self) -> list[Req]:
        """Running requests that take a decode step now, oldest first."""
        ctx = self.limits.context_len
        batch = [
            r
            for r in self.running
            if not r.is_prefilling and len(r.output_ids) + r.pending < r.max_new_tokens and r.kv_len + 1 < ctx
        ]
        batch.sort(key=lambda r: r.arrival)
        return batch

    def _decode_pages(self, batch: list[Req]) -> int:
        return sum(self.pool.pages_for(r.kv_len + 1) - len(r.pages) for r in batch)

    def _schedule_extend(
        self, candidates: list[Req], decoding: list[Req]
    ) -> tuple[BatchPlan, list[Req]] | None:
        """Prefill chunks of `candidates` (chunked requests, then the queue) up to the token budget. `decoding`
        (mixed chunk) ride along as the plan's last rows; as in SGLang each counts one token against the budget,
        so a step stays within --max-prefill-length. None when no prefill fits, with them or (decoding empty)
        at all; a failed attempt leaves the queue as it was (an admission it took back heads the queue)."""
        budget = self.limits.max_prefill_tokens - len(decoding)
        reserved = self._decode_pages(decoding)  # kept free for the decode rows through the loop
        if decoding and (budget <= 0 or not self._make_room(reserved)):
            return None
        plan = BatchPlan("extend", [], [], [], [], [], [])
        reqs: list[Req] = []
        for req in candidates:
            if budget <= 0:
                break
            admitted_now = req.state is ReqState.WAITING
            if admitted_now:
                if not self._free_slots:
                    break
                self._admit(req, plan)
            chunk = min(req.prefill_target - req.kv_len, budget)
            need = self.pool.pages_for(req.kv_len + chunk) - len(req.pages)
            # New work must leave each decoding request room for its next page.
            headroom = sum(1 for r in self.running if not r.is_prefilling) if admitted_now else 0
            if not self._make_room(need + headroom + reserved):
                if admitted_now:
                    self._unadmit(req, plan)
                break
            self._grow(req, need, plan)
            self._add_prompt_logprobs(plan, req, chunk)
            plan.slots.append(req.slot)
            plan.prefix_lens.append(req.kv_len)
            plan.extend_lens.append(chunk)
            plan.tokens += req.all_ids[req.kv_len : req.kv_len + chunk]
            req.kv_len += chunk
            # max_tokens 0: the prompt's last chunk samples nothing (process() ends the request).
            last = req.kv_len == req.prefill_target and req.max_new_tokens > 0
            if last and req.grammar is not None:
                plan.grammar_rows.append(len(plan.sample) - plan.sample.count(False))
            plan.sample.append(last)
            plan.top_logprobs.append(self._top_logprobs(req) if last else -1)
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

    def _schedule_decode(self, batch: list[Req]) -> tuple[BatchPlan, list[Req]] | None:
        while batch:
            if self._make_room(self._decode_pages(batch)):
                break
            chunking = [r for r in self.running if r.is_prefilling]
            if chunking:  # half-prefilled requests give way first: decoders are closer to done
                self._preempt(max(chunking, key=lambda r: r.arrival))
            elif len(batch) == 1:  # alone and still no room: the KV cache cannot hold this sequence
                self._finish(batch.pop(), FinishReason.LENGTH)
            else:
                self._preempt(batch.pop())  # the newest request gives way
        if not batch:
            return None
        plan = BatchPlan("decode", [], [], [], [], [], [])
        self._add_decode_rows(plan, batch)
        return plan, batch

    def _add_decode_rows(self, plan: BatchPlan, batch: list[Req]) -> None:
        """One decode row per request (its next page allocated): the token at position kv_len, sampled."""
        for req in batch:
            self._grow(req, self.pool.pages_for(req.kv_len + 1) - len(req.pages), plan)
            plan.slots.append(req.slot)
            plan.prefix_lens.append(req.kv_len)
            plan.extend_lens.append(1)
            if req.grammar is not None:
                plan.grammar_rows.append(len(plan.sample) - plan.sample.count(False))
            plan.sample.append(True)
            plan.top_logprobs.append(self._top_logprobs(req))
            req.kv_len += 1
            req.pending += 1

    @staticmethod
    def _add_prompt_logprobs(plan: BatchPlan, req: Req, chunk: int) -> None:
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

    @staticmethod
    def _top_logprobs(req: Req) -> int:
        return req.params.logprobs.top if req.params.logprobs is not None else -1

    def _admit(self, req: Req, plan: BatchPlan) -> None:
        self.waiting.remove(req)
        req.state = ReqState.RUNNING
        req.slot = self._free_slots.pop()
        req.prefill_target = req.num_known
        # A cached prefix has no logits: prompt logprobs still to compute cap the match (SGLang's approach).
        nxt = req.prompt_logprob_next
        limit = req.prefill_target - 1 if nxt is None else min(nxt - 1, req.prefill_target - 1)
        handle, pages = self.cache.match_prefix(req.all_ids[:limit])
        req.cache_handle, req.pages, req.tree_pages = handle, list(pages), len(pages)
        req.kv_len = len(pages) * self.pool.page_size
        if req.cached_tokens < 0:
            req.cached_tokens = req.kv_len
            self.prompt_tokens_total += len(req.input_ids)
            self.cached_tokens_total += req.kv_len
        if pages:
            plan.page_writes.append((req.slot, 0, list(pages)))
        plan.slot_inits.append(SlotInit(req.slot, len(req.input_ids), req.params, req.seed))
        self.running.append(req)

    def _unadmit(self, req: Req, plan: BatchPlan) -> None:
        """Takes back an admission that found no memory; the request waits at the head of the queue."""
        plan.page_writes = [w for w in plan.page_writes if w[0] != req.slot]
        plan.slot_inits = [s for s in plan.slot_inits if s.slot != req.slot]
        self.running.remove(req)
        self.cache.release(req.cache_handle)
        self._free_slots.append(req.slot)
        req.slot, req.pages, req.tree_pages, req.cache_handle, req.kv_len = -1, [], 0, None, 0
        req.state = ReqState.WAITING
        self.waiting.appendleft(req)

    def _make_room(self, pages: int) -> bool:
        short = pages - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        return self.pool.num_free >= pages

    def _grow(self, req: Req, n: int, plan: BatchPlan) -> None:
        if n > 0:
            new = self.pool.alloc(n)
            plan.page_writes.append((req.slot, len(req.pages), new))
            req.pages += new

    def _release(self, req: Req) -> None:
        """Gives the request's KV to the prefix cache (what is reusable) and the pool (the rest)."""
        self._cache_prefix(req, min(req.kv_len, req.num_known))
        self.cache.release(req.cache_handle)
        self.pool.free(req.pages[req.tree_pages :])
        self._free_slots.append(req.slot)
        self.running.remove(req)
        req.slot, req.pages, req.tree_pages, req.cache_handle, req.kv_len = -1, [], 0, None, 0

    def _preempt(self, req: Req) -> None:
        self.num_preemptions += 1
        self._release(req)
        req.state = ReqState.WAITING
        # Back to the queue in arrival order; it is re-prefilled (mostly from cache) when memory allows.
        idx = next((i for i, r in enumerate(self.waiting) if r.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(idx, req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        if req.state is ReqState.RUNNING:
            self._release(req)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.grammar = req.grammar_future = (
            None  # the matcher goes (a shared compile keeps running for others)
        )
        self._finished_unreported.append(req)

    # -- results ---------------------------------------------------------------------------------------
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
                    self._finish(req, FinishReason.LENGTH)  # prefill only (max_tokens 0): its prompt is done
                continue
            req.pending -= 1
            if req.finished:
                continue  # finished while this step was in flight; its extra token is dropped
            tok = out.tokens[i]
            req.output_ids.append(tok)
            self.generation_tokens_total += 1
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
                self._finish(req, FinishReason.STOP)
            elif len(req.output_ids) >= req.max_new_tokens or req.num_known >= self.limits.context_len:
                self._finish(req, FinishReason.LENGTH)
            elif i < prefilled:  # prefill just completed: share the prompt with later requests
                self._cache_prefix(req, min(req.prefill_target, req.num_known))
        return [self._output(r) for r in touched if not r.finished] + self.drain_finished()

    def _accept(self, req: Req, tok: int) -> bool:
        """Advances the request's matcher; a token its grammar refuses (a masking bug) fails only this request."""
        assert req.grammar is not None
        try:
            req.grammar.accept(tok)
        except GrammarRejectedToken as e:
            log.error("request %s: %s", req.rid, e)
            req.error = KubesglError(f"internal error: {e}")
            self._finish(req, FinishReason.ABORT)
            return False
        return True

    def drain_finished(self) -> list[RequestOutput]:
        """Outputs of requests finished outside a step (aborts)."""
        outs = [self._output(r) for r in self._finished_unreported]
        self._finished_unreported.clear()
        return outs

    def _cache_prefix(self, req: Req, num_tokens: int) -> None:
        """Puts the full pages of the request's first `num_tokens` tokens in the prefix cache; the request
        keeps them, now owned and locked by the cache (an identical copy cached meanwhile replaces ours)."""
        n_full = num_tokens // self.pool.page_size
        handle, canon = self.cache.insert(req.all_ids[: n_full * self.pool.page_size], req.pages[:n_full])
        self.cache.release(req.cache_handle)
        req.cache_handle = handle
        if canon != req.pages[: len(canon)]:
            req.pages[: len(canon)] = canon
            self._pending_page_writes.append((req, req.slot, 0, list(canon)))
        req.tree_pages = len(canon)

    def _output(self, req: Req) -> RequestOutput:
        new = req.output_ids[req.emitted :]
        lps = req.logprobs[req.emitted :] if req.params.logprobs is not None else None
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

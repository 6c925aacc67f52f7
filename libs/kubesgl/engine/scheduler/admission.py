"""Admission: the checks a request must pass, the queue it waits in, and the wait for its grammar to compile."""

from __future__ import annotations

import itertools
import random
from collections import deque
from concurrent.futures import Future

from kubesgl.engine.grammar import EngineGrammars
from kubesgl.engine.request import Req
from kubesgl.engine.scheduler.limits import SchedulerLimits
from kubesgl.errors import ContextLengthError, InvalidRequestError, KubesglError
from kubesgl.structured.compiler import CompiledConstraint
from kubesgl.structured.matcher import GrammarState
from kubesgl.values.outputs import TokenLogprob
from kubesgl.values.sampling import SamplingParams


class Admission:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_tokens: int,  # what the KV cache holds: a longer prompt can never run
        reqs: dict[str, Req],  # the scheduler's live requests, by id
        grammars: EngineGrammars | None,  # None: the model has no tokenizer, constraints are refused
        seed: int,
    ) -> None:
        self.limits = limits
        self.kv_tokens = kv_tokens
        self.reqs = reqs
        self.grammars = grammars
        self.waiting: deque[Req] = deque()
        # Queued requests whose grammar is still compiling: all `resolve_grammars` looks at, so a step scans
        # nothing when no grammar is compiling.
        self._compiling: list[Req] = []
        self._arrival = itertools.count()
        self._rng = random.Random(seed)

    def add(self, rid: str, input_ids: list[int], params: SamplingParams, hand_off: bool = False) -> Req:
        """Queues a request that passes every check; raises InvalidRequestError (ContextLengthError) otherwise.
        `hand_off`: the prefill role's request, which leaves after its first token (disagg.py)."""
        self.check(rid, input_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = self._new_req(rid, input_ids, params, seed)
        req.hand_off = hand_off
        start = params.logprobs.prompt_start if params.logprobs is not None else None
        if start == 0:
            req.prompt_logprobs.append(TokenLogprob(input_ids[0], None))  # nothing before it to predict it
        if start is not None and max(start, 1) < len(input_ids):
            req.prompt_logprob_next = max(start, 1)
        self._queue(req)
        return req

    def add_with_tokens(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        seed: int,
        output_ids: list[int],
        logprobs: list[TokenLogprob],
        cached_tokens: int,
    ) -> Req:
        """Queues a request some instance already started: `output_ids` were generated (and reported) there,
        the prompt's logprobs too. It is prefilled here from prompt + outputs, mostly from the prefix cache
        where its KV was put first (disaggregation's decode role), and decodes on from there."""
        self.check(rid, input_ids, params)
        req = self._new_req(rid, input_ids, params, seed)
        req.output_ids, req.logprobs = list(output_ids), list(logprobs)
        req.emitted = len(output_ids)
        req.prompt_logprobs_sent = True
        req.cached_tokens = cached_tokens
        self._queue(req)
        return req

    def _new_req(self, rid: str, input_ids: list[int], params: SamplingParams, seed: int) -> Req:
        # The one place an open-ended max_tokens gets its meaning: the server's default, else no cap but the
        # context (every request also stops where the context ends, so the budget is min(N, rest of context)).
        budget = params.max_tokens if params.max_tokens is not None else self.limits.default_max_tokens
        req = Req(
            rid=rid,
            input_ids=list(input_ids),
            params=params,
            seed=seed,
            arrival=next(self._arrival),
            max_new_tokens=budget if budget is not None else self.limits.context_len - len(input_ids),
        )
        if params.constraint is not None:
            assert self.grammars is not None
            req.grammar_future = self.grammars.submit(params.constraint)
            self._compiling.append(req)
        return req

    def _queue(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def check(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        """What `add` checks before it queues (a decode instance checks a request before asking for its prefill)."""
        params.validate()
        if rid in self.reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        if not input_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        n, ctx, vocab = len(input_ids), self.limits.context_len, self.limits.vocab_size
        if n >= ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {ctx} tokens. However, the prompt has {n} tokens "
                "(at least one token must be left for the completion).",
                param="prompt",
            )
        if n + 1 > self.kv_tokens:
            raise ContextLengthError(
                f"The prompt has {n} tokens but this instance's KV cache holds at most {self.kv_tokens} tokens.",
                param="prompt",
            )
        bad = next((t for t in input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})", param="logit_bias"
            )
        if params.constraint is not None and self.grammars is None:
            raise InvalidRequestError(
                "this model directory has no tokenizer, so it cannot constrain outputs to a grammar",
                param=params.constraint.param,
            )

    def ready(self) -> list[Req]:
        """Queued requests that can be prefilled now: none of their tokens in flight, their grammar compiled."""
        return [r for r in self.waiting if r.pending == 0 and r.grammar_future is None]

    def resolve_grammars(self) -> list[Req]:
        """Queued requests whose grammar finished compiling get their matcher; those whose compile failed leave
        the queue with their error set, and are returned (for the scheduler to finish)."""
        if not self._compiling:
            return []
        # An aborted request left the queue and dropped its future: it only leaves this list.
        done: list[Req] = []
        still: list[Req] = []
        for r in self._compiling:
            (done if r.grammar_future is None or r.grammar_future.done() else still).append(r)
        self._compiling = still
        failed: list[Req] = []
        for req in done:
            future, req.grammar_future = req.grammar_future, None
            if future is None:
                continue
            err = future.exception()
            if err is None:
                stops = (*self.limits.eos_token_ids, *req.params.stop_token_ids)
                req.grammar = GrammarState(future.result(), stops)
                for tok in req.output_ids:  # a request admitted with tokens already generated elsewhere
                    req.grammar.accept(tok)
                continue
            self.waiting.remove(req)
            req.error = err if isinstance(err, KubesglError) else InvalidRequestError(str(err))
            failed.append(req)
        return failed

    def grammar_pending(self) -> Future[CompiledConstraint] | None:
        """A grammar some queued request waits for (the engine idles on it when nothing else can run)."""
        return next((r.grammar_future for r in self._compiling if r.grammar_future is not None), None)

    def requeue(self, req: Req) -> None:
        """A preempted request goes back in arrival order; it is re-prefilled (mostly from cache) later."""
        idx = next((i for i, r in enumerate(self.waiting) if r.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(idx, req)

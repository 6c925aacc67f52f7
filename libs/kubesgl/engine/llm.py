"""The offline API: `LLM(model_path, ...).generate(prompts, sampling_params)` over the same Engine loop.
`LLM("demo")` is `kubesgl up`'s demo model (tiny random Qwen3 + the real tokenizer), built once, offline."""

from __future__ import annotations

import itertools
import math
import os
import time
from typing import Any

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.engine import Engine
from kubesgl.errors import InvalidRequestError
from kubesgl.models.random_init import resolve_demo
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.values.sampling import SamplingParams


class LLM:
    def __init__(self, model_path: str, **config: Any) -> None:
        model_path = resolve_demo(str(model_path))
        self.engine = Engine(EngineConfig(model_path=model_path, **config))
        self.tokenizer = _load_tokenizer(model_path)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        arrivals: list[float] | None = None,
    ) -> list[dict[str, Any]]:
        """Runs every prompt to completion; returns one dict per prompt, in order (with `prompt_logprobs`
        when LogprobOptions.prompt_start asked for them).

        `arrivals` (seconds after this call's start, one per prompt; default all 0): a prompt reaches the
        engine at the first step boundary after its arrival, as a served request reaches the scheduler between
        steps, and the engine idles until the next arrival when it has nothing to run: a served burst's arrival
        pattern replayed offline. `ttft_s`: seconds from the prompt's arrival until the step that returned its
        first output token (None if it produced none)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        due = _check_arrivals(arrivals, len(prompts))
        token_lists = [self._encode(p) for p in prompts]
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        order = sorted(range(len(prompts)), key=due.__getitem__)  # stable: equal arrivals keep prompt order
        added: list[str] = []
        start = time.perf_counter()

        def admit(now: float) -> None:
            try:
                while len(added) < len(order) and due[order[len(added)]] <= now - start:
                    i = order[len(added)]
                    self.engine.add_request(rids[i], token_lists[i], plist[i])
                    added.append(rids[i])
            except Exception:
                for rid in added:  # nothing half-started stays behind
                    self.engine.abort(rid)
                while self.engine.has_work():
                    self.engine.step()
                raise

        admit(start)
        results: dict[str, dict[str, Any]] = {
            rid: {"token_ids": [], "logprobs": [], "prompt_tokens": len(t), "ttft_s": None}
            for rid, t in zip(rids, token_lists, strict=True)
        }
        arrival_of = {rid: start + d for rid, d in zip(rids, due, strict=True)}
        open_ids = set(rids)
        while open_ids:
            if len(added) < len(order):
                if not self.engine.has_work():  # idle until the next prompt arrives
                    time.sleep(max(0.0, start + due[order[len(added)]] - time.perf_counter()))
                admit(time.perf_counter())
            for out in self.engine.step():
                r = results[out.rid]
                if out.new_token_ids and r["ttft_s"] is None:
                    r["ttft_s"] = time.perf_counter() - arrival_of[out.rid]
                r["token_ids"] += out.new_token_ids
                if out.logprobs:
                    r["logprobs"] += out.logprobs
                if out.error is not None:
                    r["error"] = out.error
                if out.prompt_logprobs is not None:
                    r["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    r["finish_reason"] = out.finish_reason
                    r["cached_tokens"] = out.cached_tokens
                    open_ids.discard(out.rid)
        outs = [results[rid] for rid in rids]
        for r in outs:
            r["text"] = self.tokenizer.decode(r["token_ids"]) if self.tokenizer is not None else None
        return outs

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model directory has no tokenizer: pass token ids", param="prompt"
                )
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("a prompt must be a string or a list of token ids", param="prompt")
        return list(prompt)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _check_arrivals(arrivals: list[float] | None, n: int) -> list[float]:
    if arrivals is None:
        return [0.0] * n
    if len(arrivals) != n:
        raise InvalidRequestError(f"{len(arrivals)} arrivals for {n} prompts")
    if not all(
        isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a < math.inf for a in arrivals
    ):
        raise InvalidRequestError("an arrival must be a finite number of seconds >= 0")
    return [float(a) for a in arrivals]


def _load_tokenizer(model_path: str) -> ModelTokenizer | None:
    """The same tokenizer the services use (special tokens added on encode, skipped on decode)."""
    if not os.path.exists(os.path.join(model_path, "tokenizer.json")):
        return None
    return ModelTokenizer.load(model_path)

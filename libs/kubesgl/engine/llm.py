"""The offline API: `LLM(model_path, ...).generate(prompts, sampling_params)` over the same Engine loop.
`LLM("demo")` is `kubesgl up`'s demo model (tiny random Qwen3 + the real tokenizer), built once, offline."""

from __future__ import annotations

import itertools
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
    ) -> list[dict[str, Any]]:
        """Runs every prompt to completion; returns one dict per prompt, in order (with `prompt_logprobs`
        when LogprobOptions.prompt_start asked for them). `ttft_s`: seconds from this call's start until the
        step that returned the prompt's first output token (None if it produced none)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        token_lists = [self._encode(p) for p in prompts]
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        start = time.perf_counter()
        try:
            for rid, toks, p in zip(rids, token_lists, plist, strict=True):
                self.engine.add_request(rid, toks, p)
                added.append(rid)
        except Exception:
            for rid in added:  # nothing half-started stays behind
                self.engine.abort(rid)
            while self.engine.has_work():
                self.engine.step()
            raise
        results: dict[str, dict[str, Any]] = {
            rid: {"token_ids": [], "logprobs": [], "prompt_tokens": len(t), "ttft_s": None}
            for rid, t in zip(rids, token_lists, strict=True)
        }
        open_ids = set(rids)
        while open_ids:
            for out in self.engine.step():
                r = results[out.rid]
                if out.new_token_ids and r["ttft_s"] is None:
                    r["ttft_s"] = time.perf_counter() - start
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


def _load_tokenizer(model_path: str) -> ModelTokenizer | None:
    """The same tokenizer the services use (special tokens added on encode, skipped on decode)."""
    if not os.path.exists(os.path.join(model_path, "tokenizer.json")):
        return None
    return ModelTokenizer.load(model_path)

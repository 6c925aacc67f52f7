"""The engine's grammar compiler: constraints compiled for this model's vocabulary off the engine thread.

The first constrained request pays for loading the tokenizer and building xgrammar's TokenizerInfo (~2 s on
Qwen3's 151k tokens) on a worker thread; the engine thread only submits and polls futures, so a request whose
grammar is not ready waits in the queue while the others run (docs/architecture.md, grammar section).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kubesgl.structured.compiler import CacheInfo, CompiledConstraint, GrammarCompiler
from kubesgl.values.constraint import Constraint

_WORKERS = 2


def has_tokenizer(model_path: str) -> bool:
    return os.path.exists(os.path.join(model_path, "tokenizer.json")) or os.path.exists(
        os.path.join(model_path, "tokenizer_config.json")
    )


class EngineGrammars:
    """Compiles each distinct constraint once (GrammarCompiler's cache) on its own worker threads."""

    def __init__(
        self, model_path: str, vocab_size: int, eos_token_ids: Sequence[int], bound_json_values: bool = False
    ) -> None:
        self._model_path = model_path
        self._bound = bound_json_values
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="grammar")

    def submit(self, constraint: Constraint) -> Future[CompiledConstraint]:
        """The compiled constraint, later; a failure is the InvalidRequestError naming constraint.param."""
        compiler = self._compiler
        if compiler is not None:
            return compiler.submit(constraint)  # a cached constraint's future is already done
        return self._pool.submit(lambda: self._get_compiler().compile(constraint))

    def _get_compiler(self) -> GrammarCompiler:
        with self._lock:  # the first caller builds it; the others wait for it on their worker thread
            if self._compiler is None:
                from transformers import AutoTokenizer  # heavy import, paid on the first constraint only

                tokenizer = AutoTokenizer.from_pretrained(self._model_path)
                self._compiler = GrammarCompiler.for_tokenizer(
                    tokenizer,
                    self._vocab_size,
                    self._eos,
                    max_threads=_WORKERS,
                    bound_json_values=self._bound,
                )
            return self._compiler

    def cache_info(self) -> CacheInfo | None:
        """The compile cache's counters; None before the first constraint."""
        return self._compiler.cache_info() if self._compiler is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()

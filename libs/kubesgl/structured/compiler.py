"""Compiles constraints into xgrammar grammars for one model's vocabulary, each distinct constraint once.

Where compilation lives: the *scheduler* holds the compiled grammar, because the matcher that advances with
every sampled token runs beside the sampler; it compiles on a worker thread (`submit`; xgrammar's compiler
releases the GIL) so the engine thread never waits for a grammar, and a request waits for its grammar before
it is scheduled. The *tokenizer service* (or the gateway) only checks the constraint (`check_constraint`:
xgrammar parses it without a vocabulary in milliseconds) so that a schema xgrammar cannot handle is a 400
before admission. Shipping compiled grammars on the bus instead is possible (`CompiledGrammar.serialize_json`
/ `deserialize_json`, checked against the tokenizer's metadata) but a compiled grammar is 0.2-0.6 MB of JSON
for small schemas on Qwen3's vocabulary, too big for NATS messages per request, and deserializing still
costs about a tenth of compiling.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from kubesgl.structured.bounds import bound_source
from kubesgl.structured.constraint import DEFAULT_MAX_WHITESPACE, Constraint, grammar_errors

DEFAULT_CACHE_BYTES = 512 << 20


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one vocabulary; immutable and shared by every request that uses it."""

    constraint: Constraint
    grammar: xgr.CompiledGrammar

    @property
    def memory_bytes(self) -> int:
        return int(self.grammar.memory_size_bytes)


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    entries: int
    bytes: int


class GrammarCompiler:
    """Thread-safe. `compile` blocks the caller; `submit` compiles on the compiler's own worker threads.
    Concurrent requests for one constraint share a single compilation; failures are not cached."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_threads: int = 2,
        any_whitespace: bool = True,
        max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
        bound_json_values: bool = False,
    ) -> None:
        """`bound_json_values`: schemas' open strings, numbers, arrays and objects get bounds
        (structured.bounds; the demo model, which never closes them)."""
        self.tokenizer_info = tokenizer_info
        self._bound = bound_json_values
        # xgrammar's own cache is off: ours is the one bound on memory (and counts hits).
        self._xgr = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._json_args: dict[str, Any] = {
            "any_whitespace": any_whitespace,
            "max_whitespace_cnt": max_whitespace,
        }
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future[CompiledConstraint]] = {}
        self._bytes = self._hits = self._misses = 0
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")

    @classmethod
    def for_tokenizer(
        cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], **kwargs: Any
    ) -> GrammarCompiler:
        """`vocab_size` is the model's (its logits' width, often padded past the tokenizer's); the ids past the
        tokenizer's are never allowed. `stop_token_ids`: the model's EOS ids, allowed once a grammar is
        complete. Building the TokenizerInfo takes ~2 s for Qwen3's 151k tokens: do it once per process."""
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        return cls(info, **kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer_info.vocab_size)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer_info.stop_token_ids)

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """Raises InvalidRequestError (naming constraint.param) when xgrammar cannot compile it."""
        key = constraint.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return hit
            waiting = self._inflight.get(key)
            if waiting is None:
                mine: Future[CompiledConstraint] = Future()
                self._inflight[key] = mine
                self._misses += 1
        if waiting is not None:
            return waiting.result()
        try:
            compiled = CompiledConstraint(constraint, self._compile(constraint))
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
            mine.set_exception(e)
            raise
        with self._lock:
            self._inflight.pop(key, None)
            self._insert(key, compiled)
        mine.set_result(compiled)
        return compiled

    def submit(self, constraint: Constraint) -> Future[CompiledConstraint]:
        """Compiles off the calling thread; a cached constraint's future is already done."""
        with self._lock:
            hit = self._cache.get(constraint.key)
            if hit is not None:
                self._cache.move_to_end(constraint.key)
                self._hits += 1
        if hit is not None:
            done: Future[CompiledConstraint] = Future()
            done.set_result(hit)
            return done
        return self._pool.submit(self.compile, constraint)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self._bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _insert(self, key: tuple[str, str], compiled: CompiledConstraint) -> None:
        self._cache[key] = compiled
        self._bytes += compiled.memory_bytes
        # The newest entry stays even when it alone is over the budget: its requests are about to use it.
        while self._bytes > self._cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.memory_bytes

    def _schema_source(self, source: str) -> str:
        """A schema (or a structural tag holding schemas) as compiled: bounded under bound_json_values."""
        return bound_source(source) if self._bound else source

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        with grammar_errors(c):
            if c.kind == "json_schema":
                grammar = xgr.Grammar.from_json_schema(self._schema_source(c.source), **self._json_args)
            elif c.kind == "json_object":
                # Any JSON object (OpenAI's JSON mode), with the same whitespace bound as schemas.
                grammar = xgr.Grammar.from_json_schema(
                    self._schema_source('{"type":"object"}'), strict_mode=False, **self._json_args
                )
            elif c.kind == "regex":
                return self._xgr.compile_regex(c.source)
            elif c.kind == "ebnf":
                return self._xgr.compile_grammar(c.source)
            else:  # a structural tag: its schemas (tool arguments) are bounded alike
                grammar = xgr.Grammar.from_structural_tag(self._schema_source(c.source))
            return self._xgr.compile_grammar(strict_json_strings(grammar))


# xgrammar 0.2.9 turns a JSON string with minLength/maxLength into `"` [^"\\\r\n]{m,n} `"`: raw control
# characters (tab, \x04, ...) are allowed, which strict JSON parsers (Python's json.loads) reject. Its
# unbounded strings exclude them (`[^\0-\x1f"\\\r\n]`); the bounded ones get the same class here.
_LENIENT_CHARS = '[^\\"\\\\\\r\\n]'
_STRICT_CHARS = '[^\\0-\\x1f\\"\\\\]'


def strict_json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with its length-bounded JSON strings barred from control characters (see above)."""
    text = str(grammar)
    if _LENIENT_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LENIENT_CHARS, _STRICT_CHARS))

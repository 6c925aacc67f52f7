"""Formats per-token logprobs (TokenLogprob, their text filled in by the detokenizer) into the chat shape, the
legacy completions shape, and SGLang's native shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubesgl.values.outputs import TokenLogprob


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes(e.token_bytes),
                "top_logprobs": [
                    {"token": token, "logprob": lp, "bytes": _bytes(raw)} for token, (_, lp), raw in _top(e)
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """`text_offset` is where the first entry's token starts in the choice's text (streams pass their position)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token or "")
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        # An echoed prompt's first token has no logprob: OpenAI sends null for it and its alternatives.
        "top_logprobs": [
            None if e.logprob is None else {token: lp for token, (_, lp), _ in _top(e)} for e in entries
        ],
        "text_offset": offsets,
    }


def native_logprobs(
    entries: Sequence[TokenLogprob], prompt: Sequence[TokenLogprob] | None = None
) -> dict[str, Any]:
    """SGLang's meta_info logprobs; `prompt` (with logprob_start_len) adds the input tokens' alike."""
    out = {
        "output_token_logprobs": [[e.logprob, e.token_id, e.token] for e in entries],
        "output_top_logprobs": [[[lp, tid, token] for token, (tid, lp), _ in _top(e)] for e in entries],
    }
    if prompt is not None:
        out["input_token_logprobs"] = [[e.logprob, e.token_id, e.token] for e in prompt]
        out["input_top_logprobs"] = [
            None if e.logprob is None else [[lp, tid, token] for token, (tid, lp), _ in _top(e)]
            for e in prompt
        ]
    return out


def _top(e: TokenLogprob) -> list[tuple[str | None, tuple[int, float], bytes | None]]:
    """(text, (id, logprob), bytes) of each alternative; text and bytes None where not filled in."""
    n = len(e.top)
    tokens = e.top_tokens or (None,) * n
    raw = e.top_bytes or (None,) * n
    return list(zip(tokens, e.top, raw, strict=True))


def _bytes(raw: bytes | None) -> list[int] | None:
    return None if raw is None else list(raw)

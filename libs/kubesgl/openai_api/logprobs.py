"""Formats per-token logprobs (as the detokenizer sends them: {token, token_id, logprob, bytes, top}) into the
chat shape, the legacy completions shape, and SGLang's native shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TokenLogprobs = Sequence[Mapping[str, Any]]


def chat_logprobs(entries: TokenLogprobs) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": e.get("bytes"),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
                    for t in e.get("top") or ()
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: TokenLogprobs, text_offset: int = 0) -> dict[str, Any]:
    """`text_offset` is where the first entry's token starts in the choice's text (streams pass their position)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top") or ()} for e in entries],
        "text_offset": offsets,
    }


def native_logprobs(entries: TokenLogprobs) -> dict[str, Any]:
    return {
        "output_token_logprobs": [[e["logprob"], e["token_id"], e["token"]] for e in entries],
        "output_top_logprobs": [
            [[t["logprob"], t.get("token_id"), t["token"]] for t in e.get("top") or ()] for e in entries
        ],
    }

"""Stateless incremental detokenization: any replica turns one TokenDelta window into the text it adds.

The scheduler sends each delta with up to DETOK_CONTEXT_TOKENS already-sent tokens in front of the new ones.
The text a delta adds is decode(window) minus decode(window[:new_from]). A trailing U+FFFD (a UTF-8 character
whose remaining bytes are still to come) is held back from both, so the next delta, whose context re-covers
those bytes, emits the finished character. A decode of at most one held-back character (<= 3 bytes) plus the
<= 3 bytes a window's left edge may cut mid-character fits well inside 8 tokens of context.
"""

from __future__ import annotations

from collections.abc import Callable

# Tokens of already-sent context each TokenDelta carries: enough to re-cover a held-back UTF-8 character.
DETOK_CONTEXT_TOKENS = 8
_REPLACEMENT = "\ufffd"


def delta_window(
    output_ids: list[int], sent: int, context: int = DETOK_CONTEXT_TOKENS
) -> tuple[list[int], int]:
    """The tokens a delta carries when `sent` of `output_ids` went out before, and where the new ones start."""
    start = max(0, sent - context)
    return output_ids[start:], sent - start


def delta_text(decode: Callable[[list[int]], str], tokens: list[int], new_from: int, finished: bool) -> str:
    """The text `tokens[new_from:]` add after `tokens[:new_from]`; the last delta holds nothing back."""
    full = decode(tokens)
    if not finished:
        full = _hold_back_incomplete(full)
    if new_from == 0:
        return full
    before = _hold_back_incomplete(decode(tokens[:new_from]))
    return full[len(before) :]


def delta_text_of_bytes(table: list[bytes], tokens: list[int], new_from: int, finished: bool) -> str | None:
    """delta_text() for a decoder that is the lossy UTF-8 of its tokens' bytes joined (`table[id]`: one
    token's bytes); None when a token falls outside the table."""
    try:
        parts = [table[t] for t in tokens]
    except IndexError:
        return None
    if tokens and min(tokens) < 0:
        return None
    before = b"".join(parts[:new_from])
    full = (before + b"".join(parts[new_from:])).decode("utf-8", "replace")
    if not finished:
        full = _hold_back_incomplete(full)
    if new_from == 0:
        return full
    return full[len(_hold_back_incomplete(before.decode("utf-8", "replace"))) :]


def clean_texts(table: list[bytes]) -> list[str | None]:
    """Per token id (`table[id]`: its bytes), its text where those bytes are whole UTF-8 on their own and their
    text does not end in U+FFFD; None for any other. Such a token starts a character and ends one, so a lossy
    decode reads it the same whatever comes before or after it, and leaves nothing held back."""
    out: list[str | None] = []
    for raw in table:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            out.append(None)
            continue
        out.append(text if text and not text.endswith(_REPLACEMENT) else None)
    return out


def one_clean_token(clean: list[str | None], tokens: list[int], new_from: int) -> str | None:
    """delta_text() of a window whose one new token and the token before it (if any) are clean (clean_texts):
    the new token's own text, the two decodes' answer without them; None for any other window. After a clean
    token a lossy decoder has no character open, so the window's text is its context's and then the new
    token's, neither held back."""
    if len(tokens) != new_from + 1:
        return None
    new = tokens[new_from]
    if not 0 <= new < len(clean):
        return None
    if new_from:
        before = tokens[new_from - 1]
        if not 0 <= before < len(clean) or clean[before] is None:
            return None
    return clean[new]


def _hold_back_incomplete(text: str) -> str:
    # A lossy UTF-8 decode ends an unfinished multi-byte character with exactly one U+FFFD.
    return text[:-1] if text.endswith(_REPLACEMENT) else text

"""The model's tokenizer and chat template, loaded from the model directory (HF `tokenizer.json` et al.)."""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

from kubesgl.errors import InvalidRequestError
from kubesgl.text.incremental import clean_texts, delta_text, delta_text_of_bytes, one_clean_token

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ModelTokenizer:
    """Encode, chat-template, decode and per-token bytes; decode skips special tokens like the offline LLM."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        # The Rust tokenizer decodes without transformers' per-call Python overhead (the detokenizer's hot path).
        self._backend = getattr(hf_tokenizer, "_tokenizer", None)

    @classmethod
    def load(cls, model_path: str) -> ModelTokenizer:
        from transformers import AutoTokenizer  # heavy import, paid only by the processes that tokenize

        return cls(AutoTokenizer.from_pretrained(model_path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def chat_template_text(self) -> str:
        """The chat template's source; a tokenizer with named templates (e.g. `default` and `tool_use`) gives
        them all, one after another (what a reader looks for in it is the markup its templates write)."""
        template = getattr(self.hf, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else str(template)

    @cached_property
    def special_tokens(self) -> frozenset[str]:
        """The text of every added token (special ones like `<|python_tag|>` or `[TOOL_CALLS]` among them)."""
        decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
        return frozenset(str(getattr(t, "content", t)) for t in decoder.values())

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat template applied to `messages` (the template supplies special tokens)."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        try:
            text = self.hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja raises its own errors (e.g. raise_exception for bad role order)
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.hf.decode(ids, skip_special_tokens=True)

    def delta_text(self, tokens: list[int], new_from: int, finished: bool) -> str:
        """The text `tokens[new_from:]` add after `tokens[:new_from]` (kubesgl.text.incremental): from the byte
        table where the decoder is byte-level alone, else from two decodes."""
        table = self._decode_bytes
        if table is not None:
            # One new token after a clean one (most deltas): its text from a table, no decode at all.
            text = one_clean_token(self._clean_texts, tokens, new_from)
            if text is None:
                text = delta_text_of_bytes(table, tokens, new_from, finished)
            if text is not None:
                return text
        return delta_text(self.decode, tokens, new_from, finished)

    def prepare_delta_text(self) -> None:
        """Builds what delta_text() uses now, not on its first call."""
        _ = self._decode_bytes, self._clean_texts

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (byte-level BPE and byte-fallback tokens may be partial UTF-8)."""
        token = self.hf.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if token_id not in self._added_ids:
            if self._byte_level and (raw := _byte_level_bytes(token)) is not None:
                return raw
            if m := _BYTE_FALLBACK.fullmatch(token):
                return bytes([int(m.group(1), 16)])
        return self.hf.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """A token as OpenAI shows it in logprobs: its text, or `bytes:\\xNN..` when not whole UTF-8."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.hf, "added_tokens_decoder", {}) or {})

    @cached_property
    def _decode_bytes(self) -> list[bytes] | None:
        """Per token id, the bytes `decode(..., skip_special_tokens=True)` makes of it, where the decoder is
        GPT-2's byte-level one alone; None for any other decoder. The Rust ByteLevel decoder maps each token's
        characters back to bytes (a token with a character outside the byte alphabet, like an added token with
        a space, gives its own UTF-8), joins them and decodes the whole lossily: so a window's text is its
        tokens' bytes joined and decoded, ~3x cheaper than asking the tokenizer (the detokenizer's per-token
        cost). Special tokens are skipped (empty), as decode skips them; an id the tokenizer does not know
        is dropped by decode and falls outside the table (the caller decodes instead)."""
        if not self._byte_level:
            return None
        backend = self._backend
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        table: list[bytes] = []
        for i in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(i)
            if token is None or i in special:
                table.append(b"")
            else:
                raw = _byte_level_bytes(token)
                table.append(token.encode() if raw is None else raw)
        return table

    @cached_property
    def _clean_texts(self) -> list[str | None]:
        """Per token id, its text where one_clean_token may take it alone (only with the byte table)."""
        return clean_texts(self._decode_bytes or [])

    @cached_property
    def _byte_level(self) -> bool:
        from tokenizers import decoders

        return self._backend is not None and isinstance(self._backend.decoder, decoders.ByteLevel)


def _gpt2_unicode_to_byte() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _byte_level_bytes(token: str) -> bytes | None:
    """The bytes a byte-level BPE token's characters stand for; None if one is outside the byte alphabet."""
    try:
        return bytes([_UNICODE_TO_BYTE[c] for c in token])
    except KeyError:
        return None

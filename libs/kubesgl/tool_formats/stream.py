"""Turns model output into OpenAI `tool_calls`, whole or as a stream of chat-chunk deltas, in any family's
format (`ToolCallFormat`: its markup is all the machine needs to know of a family).

One character-level state machine does both jobs: `parse_tool_calls` feeds it the whole text, the stream
feeds it deltas, and what it emits depends only on the text seen so far, so a stream reassembles to exactly
the non-streamed parse however the text is split. Its rules:
- content is the text outside calls; whitespace touching a call's markup is dropped, and text that could be
  the start of a marker (`<tool_` ...) is held back until it is known not to be one;
- a call is emitted once its header (`"name"`) is read; its `arguments` follow as fragments of the raw JSON
  the model wrote (concatenated, they are the arguments string; OpenAI too passes the model's arguments
  through unvalidated);
- a block whose header does not parse (not JSON, no name, no closing marker before the output ends) is
  content, markup and all: never an error.

Special tokens (`<|python_tag|>`, `[TOOL_CALLS]`) are dropped by a decode with skip_special_tokens; the bare
forms (output starting with `{` / `[`) still parse, but text before the call is then kept only when the
marker is in the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubesgl.tool_formats.format import ParsedOutput, ToolCall, ToolCallFormat, new_call_id

_WS = " \t\r\n"


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, id_factory: Callable[[], str] = new_call_id
) -> ParsedOutput:
    stream = ToolCallStream(fmt, id_factory)
    return fold_deltas([*stream.push(text), *stream.finish()])


def fold_deltas(deltas: list[dict[str, Any]]) -> ParsedOutput:
    """The whole output a list of stream deltas describes."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(c["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = c.get("id", call["id"])
            call["name"] += c.get("function", {}).get("name", "")
            call["arguments"] += c.get("function", {}).get("arguments", "")
    tool_calls = tuple(ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items()))
    return ParsedOutput(content if content or not tool_calls else None, tool_calls)


@dataclass
class _Call:
    """The object being read: `{"name": ..., "arguments": ...}` and any other keys (ignored)."""

    raw: str = ""  # every character of it so far (content, if it turns out not to be a call)
    state: str = "key_or_end"
    key: str = ""
    name: str | None = None
    args_started: bool = False
    args_pending: str = ""  # arguments read before the name (emitted right after the header)
    args_string: bool = False  # the model wrote the arguments as a JSON string: decoded, sent whole
    value: _Value | None = None
    index: int = -1  # >= 0 once the header was emitted


@dataclass
class _Value:
    """Scans one JSON value's extent: strings, escapes and nesting, without validating it."""

    depth: int = 0
    in_string: bool = False
    escape: bool = False
    scalar: bool = False
    text: str = ""

    def feed(self, ch: str) -> bool | None:
        """True: `ch` ended the value (and belongs to it); None: `ch` ends a scalar and is not part of it;
        False: more to come."""
        if not self.text:
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth = 1
            else:
                self.scalar = True
            self.text = ch
            return False
        if self.scalar:
            if ch in ",}]" or ch in _WS:
                return None
            self.text += ch
            return False
        self.text += ch
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallStream:
    """Feed `push` the output's text deltas, then `finish` once; each returns chat-chunk deltas
    (`{"content": ...}` or `{"tool_calls": [...]}`) in order."""

    def __init__(self, fmt: ToolCallFormat, id_factory: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self._new_id = id_factory
        self._out: list[dict[str, Any]] = []
        self._mode = "text"  # text | block | skip
        self._pending = ""  # content held back: trailing whitespace and a possible marker prefix
        self._after_block = False  # whitespace right after a block is dropped
        self._at_start = True  # nothing but whitespace seen yet (where a bare block may open)
        self._calls = 0
        # Block state.
        self._block = ""  # the block's text before the current call (content if the block fails)
        self._held_ws = ""  # content whitespace dropped when the block opened (restored if it fails)
        self._block_state = ""
        self._block_emitted = False
        self._list_open = False
        self._end_matched = 0
        self._call: _Call | None = None

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    def push(self, text: str) -> list[dict[str, Any]]:
        for ch in text:
            self._feed(ch)
        return self._drain()

    def finish(self) -> list[dict[str, Any]]:
        emitted = self._block_emitted or (self._call is not None and self._call.index >= 0)
        if self._mode == "block" and not emitted:
            self._revert("")  # cut off before a call was read: content, markup and all
        # An emitted call cut off (max_tokens) stays as it is; a partial one after it is dropped.
        if self._mode == "text" and self._pending:
            self._content(self._pending)
            self._pending = ""
        self._mode = "done"
        return self._drain()

    # -- emission -------------------------------------------------------------------------------------
    def _drain(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _header(self, call: _Call) -> None:
        call.index = self._calls
        self._calls += 1
        self._block_emitted = True
        fn = {"name": call.name, "arguments": ""}
        self._out.append(
            {"tool_calls": [{"index": call.index, "id": self._new_id(), "type": "function", "function": fn}]}
        )

    def _arguments(self, call: _Call, text: str) -> None:
        if not text:
            return
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == call.index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": call.index, "function": {"arguments": text}}]})

    # -- text -----------------------------------------------------------------------------------------
    def _feed(self, ch: str) -> None:
        if self._mode == "text":
            self._feed_text(ch)
        elif self._mode == "block":
            self._feed_block(ch)
        elif self._mode == "skip":
            self._feed_skip(ch)

    def _feed_text(self, ch: str) -> None:
        fmt = self.fmt
        if self._after_block and ch in _WS:
            return
        self._after_block = False
        if self._at_start and fmt.bare_open and self._bare_start(ch):
            return
        self._pending += ch
        if self._pending.endswith(fmt.start):
            before = self._pending[: -len(fmt.start)]
            kept = before.rstrip(_WS)
            self._content(kept)
            self._pending = ""
            self._open_block(before[len(kept) :])
            self._block = fmt.start
            return
        hold = _marker_prefix_len(self._pending, fmt.start)
        head = self._pending[: len(self._pending) - hold]
        kept = head.rstrip(_WS)  # trailing whitespace may touch a call: held until the next character says
        self._content(kept)
        self._pending = self._pending[len(kept) :]

    def _bare_start(self, ch: str) -> bool:
        """At the start of the output, a block may open without its marker: `{` (llama) or `[{` (mistral,
        whose `[` is also the marker's first character, so it is held until the `{`)."""
        fmt = self.fmt
        lead = self._pending.lstrip(_WS)
        ws = self._pending[: len(self._pending) - len(lead)]
        if ch == "{" and (lead == "" and fmt.bare_open == "{" or lead == fmt.list_open != ""):
            self._pending = ""
            self._open_block(ws)
            if lead:
                self._list_open, self._block = True, lead
            self._feed_block(ch)
            return True
        if ch not in _WS and not (lead == "" and ch == fmt.bare_open):
            self._at_start = False
        return False

    def _open_block(self, held_ws: str) -> None:
        self._mode = "block"
        self._block, self._held_ws = "", held_ws
        self._block_state = "pre"
        self._block_emitted = False
        self._list_open = False
        self._end_matched = 0
        self._call = None

    def _close_block(self) -> None:
        self._mode = "text"
        self._after_block = True
        self._call = None

    def _revert(self, ch: str) -> None:
        """The block (or its current call, if an earlier one was emitted) is content after all."""
        raw = self._call.raw if self._call else ""
        # After an emitted call only the failing call is content; before, the whole block with its marker.
        text = raw if self._block_emitted else self._held_ws + self._block + raw
        self._mode = "text"
        self._call = None
        self._after_block = False
        self._content(text)
        if ch:
            self._feed_text(ch)

    # -- blocks ---------------------------------------------------------------------------------------
    def _feed_block(self, ch: str) -> None:
        fmt, state = self.fmt, self._block_state
        if state in ("pre", "next"):
            if ch in _WS:
                self._block += ch
            elif state == "pre" and fmt.list_open and ch == fmt.list_open and not self._list_open:
                self._list_open = True
                self._block += ch
            elif ch == "{":
                self._call = _Call(raw="{")
                self._block_state = "call"
            elif self._block_emitted:
                self._end_block_early(ch)
            else:
                self._revert(ch)
        elif state == "call":
            self._feed_call(ch)
        elif state == "after":
            if ch in _WS:
                return
            if fmt.separator and ch == fmt.separator and not fmt.end:
                self._block_state = "next"
            elif self._list_open and ch == fmt.list_close:
                self._close_block()
            elif fmt.end and self._match_end(ch):
                return
            else:
                self._end_block_early(ch)

    def _match_end(self, ch: str) -> bool:
        """Consumes `ch` if it continues the end marker; closes the block when the marker is complete."""
        if ch != self.fmt.end[self._end_matched]:
            return False
        self._end_matched += 1
        if self._end_matched == len(self.fmt.end):
            self._close_block()
        return True

    def _end_block_early(self, ch: str) -> None:
        """Unexpected text after an emitted call: formats with an end marker skip to it; the others end the
        block and treat the text as content."""
        if self.fmt.end:
            self._mode = "skip"
            self._end_matched = 0
            self._feed_skip(ch)
        else:
            self._mode = "text"
            self._call = None
            self._feed_text(ch)

    def _feed_skip(self, ch: str) -> None:
        end = self.fmt.end
        if ch == end[self._end_matched]:
            self._end_matched += 1
            if self._end_matched == len(end):
                self._close_block()
        else:
            self._end_matched = 1 if ch == end[0] else 0

    def _feed_call(self, ch: str) -> None:
        call = self._call
        assert call is not None
        call.raw += ch
        state = call.state
        if state == "key_or_end":
            if ch in _WS:
                return
            if ch == '"':
                call.state, call.key = "key", ""
                call.value = _Value()
                call.value.feed('"')
            elif ch == "}":
                self._call_done()
            else:
                self._call_failed(ch)
        elif state == "key":
            assert call.value is not None
            if call.value.feed(ch):
                try:
                    call.key = json.loads(call.value.text)
                except ValueError:
                    self._call_failed(ch)
                    return
                call.state = "colon"
        elif state == "colon":
            if ch == ":":
                call.state, call.value = "value", _Value()
            elif ch not in _WS:
                self._call_failed(ch)
        elif state == "value":
            self._feed_value(call, ch)
        elif state == "after_value":
            if ch in _WS:
                return
            if ch == ",":
                call.state = "key_or_end"
            elif ch == "}":
                self._call_done()
            else:
                self._call_failed(ch)

    def _feed_value(self, call: _Call, ch: str) -> None:
        value = call.value
        assert value is not None
        if not value.text and ch in _WS:
            return
        is_args = call.key in self.fmt.args_keys and not call.args_started
        if call.key == "name" and not value.text and ch != '"':
            self._call_failed(ch)
            return
        if is_args and not value.text and ch == '"':
            call.args_string = True
        done = value.feed(ch)
        if done is None:  # a scalar ended at `ch`, which is not part of it
            self._value_done(call)
            call.raw = call.raw[:-1]
            self._feed_call(ch)
            return
        if is_args and not call.args_string:
            if call.index >= 0:
                self._arguments(call, ch)
            else:
                call.args_pending += ch
        if done:
            self._value_done(call)

    def _value_done(self, call: _Call) -> None:
        value = call.value
        assert value is not None
        call.state = "after_value"
        if call.key == "name" and call.name is None:
            try:
                name = json.loads(value.text)
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                call.name = name
                self._header(call)
                self._arguments(call, call.args_pending)
                call.args_pending = ""
        elif call.key in self.fmt.args_keys and not call.args_started:
            call.args_started = True
            if call.args_string:
                try:
                    decoded = json.loads(value.text)
                except ValueError:
                    decoded = value.text
                call.args_pending = decoded if isinstance(decoded, str) else value.text
                if call.index >= 0:
                    self._arguments(call, call.args_pending)
                    call.args_pending = ""

    def _call_done(self) -> None:
        call = self._call
        assert call is not None
        if call.index < 0:
            self._call_failed("")
            return
        if not call.args_started:
            self._arguments(call, "{}")  # no arguments key: OpenAI's empty arguments
        self._block, self._call = "", None  # the block's text so far is this call's: no longer content
        self._block_state = "after"

    def _call_failed(self, ch: str) -> None:
        call = self._call
        assert call is not None
        if call.index >= 0:  # already emitted: the call stands, the rest of the block is skipped
            if ch:
                self._end_block_early(ch)
            return
        if ch:
            call.raw = call.raw[:-1] if call.raw.endswith(ch) else call.raw
        self._revert(ch)


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

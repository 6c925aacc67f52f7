"""`kubesgl shell`: an interactive chat against a gateway (like Mini-SGLang's shell). Keeps the conversation
for context, streams each reply as it is generated; `/reset` starts over, `/exit` or Ctrl-D quits, Ctrl-C
stops the current reply. Replies are capped at `--max-tokens` (256 by default), so a model that never emits
its end token (the random-weight demo) still hands the prompt back; a cut reply says so."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import httpx
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, InMemoryHistory

from kubesgl import env

HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."
DEFAULT_MAX_TOKENS = 256


class ShellError(Exception):
    """The gateway refused a request (its OpenAI error message) or could not be reached."""


class ChatSession:
    """One conversation with a gateway: the messages so far and the sampling settings."""

    def __init__(
        self,
        http: httpx.Client,
        model: str,
        system: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        self.http = http
        self.model = model
        self.system = system
        self.sampling = sampling or {}
        self.messages: list[dict[str, str]] = []
        self.finish_reason: str | None = None  # of the last reply
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> Iterator[str]:
        """Streams the assistant's answer to `text`; the exchange joins the history once the reply ends
        (an interrupted or failed reply leaves the history as it was)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "stream": True, **self.sampling}
        answer = ""
        self.finish_reason = None
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise ShellError(_error_message(r))
                for event in _sse_data(r.iter_lines()):
                    if "error" in event:
                        raise ShellError(event["error"].get("message", "error"))
                    for choice in event.get("choices", ()):
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        piece = (choice.get("delta") or {}).get("content") or ""
                        answer += piece
                        if piece:
                            yield piece
        except httpx.HTTPError as e:
            raise ShellError(f"cannot reach the gateway: {e}") from e
        self.messages = [*messages, {"role": "assistant", "content": answer}]


def repl(session: ChatSession, prompt: PromptSession[str], out: TextIO) -> int:
    """Reads lines until /exit or end of input; returns the exit code."""
    print(f"kubesgl shell: chatting with `{session.model}`. {HELP}", file=out, flush=True)
    while True:
        try:
            line = prompt.prompt("> ").strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            print("(conversation cleared)", file=out, flush=True)
            continue
        if line.startswith("/"):
            print(f"unknown command {line}. {HELP}", file=out, flush=True)
            continue
        try:
            for piece in session.reply(line):
                out.write(piece)
                out.flush()
            out.write("\n")
            if session.finish_reason == "length":
                limit = session.sampling.get("max_tokens")
                out.write(f"(cut at {limit} tokens: --max-tokens)\n" if limit else "(cut: context full)\n")
        except KeyboardInterrupt:
            out.write("\n(stopped)\n")
        except ShellError as e:
            out.write(f"\nerror: {e}\n")
        out.flush()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    parser.add_argument("--model", default=None, help="model id (default: the first the gateway serves)")
    parser.add_argument(
        "--api-key",
        default=env.api_key(openai_fallback=True),
        help="API key (env KUBESGL_API_KEY or OPENAI_API_KEY)",
    )
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="longest reply in tokens (0 = no cap: the server's default)",
    )
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--history-file", default=str(Path.home() / ".cache" / "kubesgl" / "shell_history"))


def main(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(
        base_url=args.url.rstrip("/"), headers=headers, timeout=httpx.Timeout(10, read=None)
    ) as http:
        try:
            model = args.model or _first_model(http)
        except ShellError as e:
            print(f"kubesgl shell: {e}", file=sys.stderr)
            return 1
        session = ChatSession(http, model, args.system, sampling_of(args))
        return repl(session, PromptSession(history=_history(args.history_file)), sys.stdout)


def sampling_of(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the flags set (`--max-tokens 0`: none, the server decides)."""
    sampling: dict[str, Any] = {}
    if args.max_tokens:
        sampling["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    return sampling


def _first_model(http: httpx.Client) -> str:
    try:
        r = http.get("/v1/models")
    except httpx.HTTPError as e:
        raise ShellError(f"cannot reach the gateway: {e}") from e
    if r.status_code != 200:
        raise ShellError(_error_message(r))
    models = [m["id"] for m in r.json().get("data", ())]
    if not models:
        raise ShellError("the gateway serves no model yet (no scheduler is ready)")
    return models[0]


def _history(path: str) -> FileHistory | InMemoryHistory:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return FileHistory(path)
    except OSError:
        return InMemoryHistory()  # read-only home (e.g. a container): history for this session only


def _sse_data(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _error_message(r: httpx.Response) -> str:
    try:
        return f"{r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:200]}"

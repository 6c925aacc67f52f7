"""Admission: gateway -> any tokenizer (TokenizeRequest) -> one scheduler (GenerateRequest), the reply that
travels back (Admitted or ErrorReply), and Abort; with the values they carry (PromptKind, ChatMessage, ErrorInfo)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kubesgl.codec import JsonValue
from kubesgl.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidRequestError,
    KubesglError,
    ModelNotFoundError,
    ServiceUnavailableError,
    UnsupportedModelError,
)
from kubesgl.protocol.message import Message
from kubesgl.values.sampling import SamplingParams


class PromptKind(StrEnum):
    CHAT = "chat"  # `messages`, rendered by the model's chat template
    COMPLETION = "completion"  # `prompt`, a text to encode
    TOKENS = "tokens"  # `input_ids`, token ids taken as given


@dataclass(frozen=True)
class ChatToolCall:
    """A call an assistant turn made, as chat templates take it: `arguments` an object, not OpenAI's string."""

    name: str
    arguments: dict[str, JsonValue]
    id: str | None = None


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, normalized by the gateway (`chat_history.template_messages`) for the template."""

    role: str  # system | user | assistant | tool (the gateway maps OpenAI's "developer" to system)
    content: str
    name: str | None = None
    tool_calls: tuple[ChatToolCall, ...] = ()  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers


@dataclass(frozen=True)
class ErrorInfo:
    """Why a request failed, as it travels: the HTTP status the gateway answers with and OpenAI's error fields
    (type and code follow errors.py, so the gateway rebuilds the same error)."""

    status: int
    type: str
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def of(cls, err: KubesglError) -> ErrorInfo:
        return cls(err.status, err.type, err.message, err.code, err.param)

    def to_error(self) -> KubesglError:
        """The typed error these fields came from, keeping status/type/code even for an unknown kind."""
        for kind in _ERROR_CLASSES:
            if kind.status == self.status and kind.code == self.code:
                return kind(self.message, param=self.param)
        err = KubesglError(self.message, param=self.param)
        err.status, err.type, err.code = self.status, self.type, self.code
        return err


# Most specific first: the first class whose (status, code) matches rebuilds the error.
_ERROR_CLASSES: tuple[type[KubesglError], ...] = (
    ContextLengthError,
    ModelNotFoundError,
    UnsupportedModelError,
    InvalidRequestError,
    ServiceUnavailableError,
    DeadlineExceededError,
)


@dataclass
class TokenizeRequest(Message):
    """gateway -> any tokenizer: one prompt (of `kind`) and how to sample its completion.

    `sampling` is checked at the gateway and again by the engine, nowhere between; its max_tokens None means
    "until the context ends" (or the server's default), which the engine resolves."""

    rid: str
    gateway_id: str
    model: str
    kind: PromptKind
    sampling: SamplingParams
    deadline: float
    messages: tuple[ChatMessage, ...] = ()  # kind chat
    prompt: str | None = None  # kind completion
    input_ids: list[int] | None = None  # kind tokens
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, JsonValue] | None = None
    session_id: str | None = None  # OpenAI `user` or header x-session-id: routers may keep a session together
    # kind chat: OpenAI function tools (checked by the gateway), rendered by the template unless tool_choice
    # is "none"; tool_choice "required" or {"type": "function", ...} is enforced by the tokenizer's grammar.
    tools: tuple[JsonValue, ...] = ()
    tool_choice: JsonValue = None
    parallel_tool_calls: bool = True
    # A resumed request (a migration: its scheduler died mid-stream): the output tokens the gateway already
    # streamed. The prompt is made as the first time; the tokenizer passes these on (GenerateRequest.output_ids).
    output_ids: list[int] = field(default_factory=list)


@dataclass
class GenerateRequest(Message):
    """tokenizer -> one scheduler instance: token ids ready to run.

    `output_ids` non-empty makes it a resume admission: the request's first len(output_ids) output tokens
    already exist (streamed by an instance that died, or produced by a prefill instance). The scheduler prefills
    input_ids + output_ids and continues at that output position (Engine.add_request): max_tokens counts them,
    they are not sent again, and usage counts them once."""

    rid: str
    gateway_id: str
    input_ids: list[int]
    sampling: SamplingParams
    deadline: float
    output_ids: list[int] = field(default_factory=list)
    # Disaggregation: the prefill instance the router chose for this request's prompt ("" for none: the
    # receiving instance prefills it itself).
    prefill_instance: str = ""


@dataclass
class Admitted(Message):
    """The scheduler accepted the request; the reply travels back through the tokenizer to the gateway."""

    rid: str
    instance_id: str
    prompt_tokens: int
    # Set by the tokenizer when the output is to be parsed for tool calls: the `tool_calls` format's name.
    tool_format: str | None = None


@dataclass
class ErrorReply(Message):
    """A request refused at some stage (the reply to TokenizeRequest or GenerateRequest instead of Admitted)."""

    rid: str
    error: ErrorInfo

    @classmethod
    def from_error(cls, rid: str, err: KubesglError) -> ErrorReply:
        return cls(rid, ErrorInfo.of(err))

    def to_error(self) -> KubesglError:
        return self.error.to_error()


@dataclass
class Abort(Message):
    """gateway -> all schedulers: stop this request and free its pages (instance_id None = whoever has it)."""

    rid: str
    instance_id: str | None = None

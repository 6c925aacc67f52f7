"""Pydantic models of the OpenAI request bodies we accept. Strict types and `extra="forbid"`: a field we do not
know, or a value of the wrong type, is a 400 naming the field, never silently coerced or ignored. Two readings
follow OpenAI's API: `null` for a nullable field means its default, and an integer field takes an
integer-valued number (`7.0`, as JSON encoders of floats send it) but not `7.5` nor the string "7"."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WrapValidator
from pydantic_core import PydanticCustomError

from kubesgl.protocol import WIRE_INT_MAX, WIRE_INT_MIN, json_value_error


def _integral(value: Any) -> Any:
    """7.0 is the integer 7 (JSON has one number type); anything else is left for strict validation."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


WIRE_JSON_ERROR = "wire_json"  # the pydantic error type of a JSON value the wire cannot carry

# Every integer a client sends travels as a msgpack int64: out of that range is a 400 naming the field.
Int = Annotated[int, BeforeValidator(_integral), Field(ge=WIRE_INT_MIN, le=WIRE_INT_MAX)]
ShortStr = Annotated[str, Field(max_length=512)]


def _plain_token_ids(value: Any) -> bool:
    """A non-empty list of JSON integers (not bools, not 7.0) all within the wire's range."""
    return (
        type(value) is list
        and bool(value)
        and set(map(type, value)) == {int}
        and min(value) >= WIRE_INT_MIN
        and max(value) <= WIRE_INT_MAX
    )


def _flat_ids_fast(value: Any, handler: Any) -> Any:
    """A tokenized prompt is thousands of integers, and `Int`'s per-element validators cost ~0.5 µs each (300 µs
    of the gateway's CPU for a 600-token prompt). A list of plain in-range integers is what full validation
    would return, so it is taken as is after C-speed checks; anything else (7.0, a bool, a string, out of
    range, empty) goes through the field's full validation and gets its errors."""
    return value if _plain_token_ids(value) else handler(value)


def _prompt_ids_fast(value: Any, handler: Any) -> Any:
    """`_flat_ids_fast` for a completion prompt, which may also be a batch: a list of such lists."""
    if _plain_token_ids(value) or (type(value) is list and value and all(map(_plain_token_ids, value))):
        return value
    return handler(value)


TokenIds = Annotated[list[Int], WrapValidator(_flat_ids_fast)]
CompletionPrompt = Annotated[str | list[str] | list[Int] | list[list[Int]], WrapValidator(_prompt_ids_fast)]


def _wire_json(value: Any) -> Any:
    # The path below the value travels in ctx: http_errors puts it after the field's own (`tools[0].function`).
    if error := json_value_error(value, ""):
        raise PydanticCustomError(WIRE_JSON_ERROR, "{why}", {"path": error.path, "why": error.why})
    return value


# Free-form JSON the wire carries as is (template kwargs, tool schemas): checked whole where it enters.
JsonObject = Annotated[dict[str, object], AfterValidator(_wire_json)]


class StrictModel(BaseModel):
    # allow_inf_nan off: an infinite temperature or NaN penalty is a 400, not a broken sampler.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    # OpenAI pads chunks with random text against length side channels; we send none, whichever is asked.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(StrictModel):
    """response_format.json_schema. `strict` is accepted either way: the output always follows the schema."""

    model_config = ConfigDict(populate_by_name=True)

    name: str  # OpenAI's label for the schema; it changes nothing here
    description: str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(StrictModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI names plus the vLLM/SGLang extensions)."""

    model: ShortStr
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    ignore_eos: bool = False
    user: ShortStr | None = None
    # OpenAI's key for grouping requests that share a prompt prefix: our routing session key (prefix-cache
    # affinity), as `user` is when it is absent.
    prompt_cache_key: ShortStr | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # Structured outputs: OpenAI's response_format (also on completions, as SGLang), and SGLang's extensions
    # (a JSON schema as text, a regex, an EBNF grammar); at most one per request.
    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Known OpenAI fields we do not implement: accepted only at their neutral value, otherwise a 400 naming them.
    best_of: Int | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: ShortStr
    arguments: str  # JSON text, as OpenAI sends it back (chat_history parses it for the template)


class AssistantToolCall(StrictModel):
    id: ShortStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """`content` may be null only on an assistant turn (one that called tools); a `tool` turn names the call it
    answers by `tool_call_id`. Those rules, and the arguments being JSON, are `chat_history`'s to check."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: ShortStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: ShortStr | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: JsonObject | None = None
    tools: list[JsonObject] | None = None
    tool_choice: ShortStr | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    functions: list[JsonObject] | None = None
    function_call: ShortStr | JsonObject | None = None


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt | None  # null: OpenAI's default, "<|endoftext|>"
    logprobs: Int | None = None
    echo: bool | None = None
    suffix: str | None = None


class NativeSamplingParams(StrictModel):
    """SGLang's native `sampling_params` names."""

    max_new_tokens: Int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class NativeGenerateRequest(StrictModel):
    """POST /generate, SGLang's native shape: exactly one of `text` / `input_ids`."""

    model: ShortStr | None = None
    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Int = 0
    logprob_start_len: Int = -1  # prompt-token logprobs from this position on; -1: the output tokens' only

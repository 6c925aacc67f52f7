"""Validates an OpenAI (or native) request body into what one generation needs: SamplingParams, stop strings,
fan-out `n`, and streaming options. Every accepted field is honoured here or rejected with a 400 naming it.
A grammar constraint is checked here by xgrammar (no vocabulary, milliseconds): one it cannot build is a 400
naming the field before the request is admitted anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kubesgl.errors import InvalidRequestError
from kubesgl.openai_api.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
    ResponseFormat,
    SamplingFields,
)
from kubesgl.structured.constraint import check_constraint
from kubesgl.tool_formats import function_tools
from kubesgl.values.constraint import Constraint
from kubesgl.values.sampling import MAX_TOP_LOGPROBS, LogprobOptions, SamplingParams

MAX_N = 128  # also the cap on choices x prompts of one request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # hold-back scans are quadratic in a stop string's length
_INT64 = 2**63  # the wire (msgpack) carries 64-bit integers


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, checked: function tools, and `choice` one of "none", "auto", "required" or
    {"type": "function", "function": {"name": ...}} naming one of them ("auto" when tools came without it)."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str | dict[str, Any] = "none"
    parallel: bool = True


@dataclass(frozen=True)
class GenerationSpec:
    """One validated request: `params` for choice 0; `params_for_choice(i)` for the fan-out children.

    `params.max_tokens` is None when the client set none: the engine gives it the rest of the context.
    `logprobs` says whether the answer shows logprobs: `echo` asks the engine for the prompt's tokens
    (`params.logprobs.prompt_start` 0) even when the client asked for no logprobs.
    """

    params: SamplingParams
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    echo: bool = False
    tool_use: ToolUse = field(default_factory=ToolUse)

    def params_for_choice(self, index: int) -> SamplingParams:
        # Distinct seeds keep n seeded samples different yet reproducible; choice 0 keeps the request's seed.
        if self.params.seed is None or index == 0:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) % 2**63)


def chat_spec(req: ChatCompletionRequest) -> GenerationSpec:
    _reject_if(bool(req.functions), "functions", "functions is deprecated by OpenAI; use tools")
    _reject_if(
        req.function_call not in (None, "none"),
        "function_call",
        "function_call is deprecated; use tool_choice",
    )
    _reject_if(
        req.top_logprobs is not None and not req.logprobs,
        "top_logprobs",
        "top_logprobs requires logprobs to be true",
    )
    _reject_if(
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens,
        "max_completion_tokens",
        "max_tokens and max_completion_tokens disagree; send one of them",
    )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = req.top_logprobs or 0
    return replace(_spec(req, max_tokens, bool(req.logprobs), top, "top_logprobs"), tool_use=_tool_use(req))


def _tool_use(req: ChatCompletionRequest) -> ToolUse:
    tools = req.tools or []
    declared = function_tools(tools)  # 400s naming tools[i].function.name / .parameters
    names = {t.name for t in declared}
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        _reject_if(
            choice.get("type") != "function"
            or not isinstance(name, str)
            or set(choice) != {"type", "function"},
            "tool_choice",
            "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
        )
        _reject_if(name not in names, "tool_choice", f"tool_choice names {name!r}, which is not in tools")
    else:
        _reject_if(
            choice not in ("none", "auto", "required"),
            "tool_choice",
            f"tool_choice must be 'none', 'auto', 'required' or a named function (got {choice!r})",
        )
        _reject_if(choice != "none" and not tools, "tool_choice", f"tool_choice {choice!r} needs tools")
    # The schemas a grammar will enforce must compile: a 400 naming the one that does not, before admission.
    enforced = [i for i, t in enumerate(declared) if choice == "required" or _named(choice) == t.name]
    for i in enforced:
        where = f"tools[{i}].function.parameters"
        check_constraint(Constraint.json_schema(declared[i].parameters, param=where))
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolUse(tuple(tools), choice, parallel)


def _named(choice: str | dict[str, Any]) -> str | None:
    return choice["function"]["name"] if isinstance(choice, dict) else None


def completion_spec(req: CompletionRequest) -> GenerationSpec:
    _reject_if(bool(req.suffix), "suffix", "suffix is not supported")
    _reject_if(req.logprobs is not None and req.logprobs < 0, "logprobs", "logprobs must be >= 0")
    top = req.logprobs or 0
    # max_tokens 0 generates nothing (with echo: the prompt and its logprobs alone, as lm-eval asks).
    spec = _spec(req, req.max_tokens, req.logprobs is not None, top, "logprobs", min_tokens=0)
    if not req.echo:
        return spec
    # The echoed prompt comes back from the engine (its tokens and their logprobs), so its prefix is not
    # taken from the prefix cache (docs/architecture.md, "Prompt logprobs").
    params = replace(spec.params, logprobs=LogprobOptions(top=top, prompt_start=0))
    return replace(spec, params=params, echo=True)


def native_spec(req: NativeGenerateRequest) -> GenerationSpec:
    _reject_if((req.text is None) == (req.input_ids is None), "text", "send exactly one of text or input_ids")
    _reject_if(
        req.top_logprobs_num and not req.return_logprob,
        "top_logprobs_num",
        "top_logprobs_num requires return_logprob",
    )
    _reject_if(req.logprob_start_len < -1, "logprob_start_len", "logprob_start_len must be >= -1")
    _reject_if(
        req.logprob_start_len >= 0 and not req.return_logprob,
        "logprob_start_len",
        "logprob_start_len requires return_logprob",
    )
    sp = req.sampling_params
    params = SamplingParams(
        max_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        seed=engine_seed(sp.seed),
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        logprobs=LogprobOptions(
            req.top_logprobs_num, req.logprob_start_len if req.logprob_start_len >= 0 else None
        )
        if req.return_logprob
        else None,
        constraint=request_constraint(
            None,
            [("sampling_params.json_schema", sp.json_schema), ("sampling_params.regex", sp.regex)]
            + [("sampling_params.ebnf", sp.ebnf)],
        ),
    )
    _validate(params, {"max_tokens": "sampling_params.max_new_tokens"})
    return GenerationSpec(
        params=params, stop=_stop_strings(sp.stop), stream=req.stream, logprobs=req.return_logprob
    )


def _spec(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    top_logprobs_param: str,
    min_tokens: int = 1,
) -> GenerationSpec:
    _reject_if(req.best_of not in (None, 1), "best_of", "best_of > 1 is not supported")
    _reject_if(
        max_tokens is not None and max_tokens < min_tokens,
        "max_tokens",
        f"max_tokens must be at least {min_tokens} (got {max_tokens})",
    )
    n = 1 if req.n is None else req.n
    stream = bool(req.stream)
    _reject_if(not 1 <= n <= MAX_N, "n", f"n must be in [1, {MAX_N}] (got {n})")
    _reject_if(
        req.stream_options is not None and not stream,
        "stream_options",
        "stream_options is only allowed when stream is true",
    )
    _reject_if(
        top_logprobs > MAX_TOP_LOGPROBS,
        top_logprobs_param,
        f"{top_logprobs_param} must be at most {MAX_TOP_LOGPROBS} (got {top_logprobs})",
    )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=-1 if req.top_k is None else req.top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=engine_seed(req.seed),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=LogprobOptions(top=top_logprobs) if logprobs else None,
        logit_bias=_logit_bias(req.logit_bias),
        constraint=request_constraint(
            req.response_format,
            [("json_schema", req.json_schema), ("regex", req.regex), ("ebnf", req.ebnf)],
        ),
    )
    _validate(params, {"top_logprobs": top_logprobs_param})
    include_usage = req.stream_options is not None and bool(req.stream_options.include_usage)
    return GenerationSpec(params, _stop_strings(req.stop), n, stream, include_usage, logprobs)


def engine_seed(seed: int | None) -> int | None:
    """OpenAI takes any int64 seed; the engine's are [0, 2**63): a negative seed maps to seed + 2**63, so
    each int64 seed names one engine seed, the same every time (a negative one shares it with one positive)."""
    return None if seed is None else seed % _INT64


def request_constraint(
    response_format: ResponseFormat | None, extensions: list[tuple[str, str | None]]
) -> Constraint | None:
    """The one grammar a request names (response_format json_object / json_schema, or SGLang's json_schema,
    regex and ebnf extensions, given as (field, value)), checked by xgrammar; None when it names none."""
    found: list[Constraint] = []
    if response_format is not None and response_format.type == "json_object":
        found.append(Constraint("json_object", param="response_format"))
    elif response_format is not None and response_format.type == "json_schema":
        fmt = response_format.json_schema
        _reject_if(
            fmt is None, "response_format.json_schema", "response_format json_schema needs json_schema"
        )
        assert fmt is not None
        if fmt.schema_ is None:  # OpenAI's schema lets it out: any JSON object then
            found.append(Constraint("json_object", param="response_format.json_schema"))
        else:
            found.append(Constraint.json_schema(fmt.schema_, param="response_format.json_schema.schema"))
    for name, value in extensions:
        if value is None:
            continue
        kind = name.rsplit(".", 1)[-1]
        found.append(
            Constraint.json_schema(value, param=name)
            if kind == "json_schema"
            else Constraint(kind, value, name)  # type: ignore[arg-type]
        )
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidRequestError(
            f"send at most one of response_format (json_object, json_schema), json_schema, regex, ebnf (got {names})",
            param=found[1].param,
        )
    check_constraint(found[0])
    return found[0]


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; ids against the vocabulary are the engine's check."""
    pairs = []
    for key, value in (bias or {}).items():
        _reject_if(
            not key.isascii() or not key.isdigit() or len(key) > 18,
            "logit_bias",
            f"logit_bias keys must be token ids (non-negative integers as strings); got {key[:40]!r}",
        )
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    _reject_if(len(stops) > MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
    _reject_if(any(not s for s in stops), "stop", "stop strings must not be empty")
    _reject_if(
        any(len(s) > MAX_STOP_CHARS for s in stops),
        "stop",
        f"stop strings are at most {MAX_STOP_CHARS} chars",
    )
    return stops


def _validate(params: SamplingParams, rename: dict[str, str]) -> None:
    """SamplingParams.validate, with its error naming the field as the client spelled it."""
    for name in ("max_tokens", "top_k", "seed"):
        value = getattr(params, name)
        _reject_if(
            value is not None and not -_INT64 <= value < _INT64,
            rename.get(name, name),
            f"{rename.get(name, name)} is out of range",
        )
    _reject_if(
        any(not 0 <= t < _INT64 for t in params.stop_token_ids),
        "stop_token_ids",
        "token ids must be >= 0 and 64-bit",
    )
    try:
        params.validate()
    except InvalidRequestError as err:
        param = rename.get(err.param or "", err.param)
        raise InvalidRequestError(err.message.replace(err.param or "", param or "", 1), param=param) from None


def _reject_if(bad: bool, param: str, message: str) -> None:
    if bad:
        raise InvalidRequestError(message, param=param)

"""Request bodies -> GenerationSpec: every accepted field honoured, every unsupported one a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest
from kubesgl.errors import InvalidRequestError
from kubesgl.openai_api.generation_spec import chat_spec, completion_spec, native_spec
from kubesgl.openai_api.http_errors import error_from_validation
from kubesgl.openai_api.prompt_inputs import chat_messages, completion_prompts
from kubesgl.openai_api.request_models import ChatCompletionRequest, CompletionRequest, NativeGenerateRequest
from kubesgl.protocol import ChatMessage
from kubesgl.values.sampling import LogprobOptions
from pydantic import ValidationError

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any):
    return chat_spec(ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, **fields}))


def _completion(**fields: Any):
    return completion_spec(CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields}))


def _param_of_400(fn, **fields: Any) -> str | None:
    with pytest.raises((InvalidRequestError, ValidationError)) as info:
        fn(**fields)
    err = info.value
    if isinstance(err, ValidationError):
        err = error_from_validation(err.errors())
    assert err.status == 400
    return err.param


def test_chat_fields_become_sampling_params() -> None:
    spec = _chat(
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        seed=3,
        stop=["a", "b"],
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        user="u1",
    )
    p = spec.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.2, 0.3, 1.1)
    assert (p.seed, p.stop_token_ids, p.ignore_eos, p.logprobs) == (3, (9,), True, LogprobOptions(top=2))
    assert spec.stop == ("a", "b") and spec.n == 2 and spec.stream and spec.include_usage
    assert spec.params_for_choice(0).seed == 3 and spec.params_for_choice(1).seed == 4


def test_defaults_follow_openai() -> None:
    spec = _chat()
    p = spec.params
    assert (p.temperature, p.top_p, p.top_k, p.logprobs) == (1.0, 1.0, -1, None)
    # No max_tokens: the rest of the context, which the engine resolves once it knows the prompt's length.
    assert spec.params.max_tokens is None and spec.params_for_choice(1).max_tokens is None
    assert _chat(max_tokens=5).params_for_choice(0).max_tokens == 5


def test_completion_logprobs_int_means_top_n() -> None:
    p = _completion(logprobs=3, max_tokens=5, stop="x").params
    assert p.logprobs and p.logprobs.top == 3 and p.max_tokens == 5
    assert _completion(logprobs=0).params.logprobs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 7.5}, "max_tokens"),
        ({"seed": "7"}, "seed"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
        ({"logit_bias": {"a": 5.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 5.0}}, "logit_bias"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"1": "x"}}, 'logit_bias["1"]'),
        ({"best_of": 2}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 1.5}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    ],
)
def test_chat_rejects_with_400_naming_the_field(fields: dict[str, Any], param: str | None) -> None:
    got = _param_of_400(_chat, **fields)
    if param is not None:
        assert got == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"logprobs": 30}, "logprobs"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_completion_rejects_with_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    def run(**f: Any):
        spec = _completion(**f)
        completion_prompts(f.get("prompt", "p"))
        return spec

    assert _param_of_400(run, **fields) == param


def test_null_means_the_default() -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "seed": None}
    assert _chat(**nulls, logprobs=None, top_logprobs=None, max_tokens=None) == _chat()
    assert _completion(**nulls, logprobs=None, echo=None, best_of=None) == _completion()
    assert completion_prompts(None)[0].text == "<|endoftext|>"  # OpenAI's default prompt


def test_integer_valued_floats_are_integers_but_not_strings_or_fractions() -> None:
    spec = _chat(max_tokens=3.0, n=2.0, seed=5.0, top_logprobs=1.0, logprobs=True)
    assert (spec.params.max_tokens, spec.n, spec.params.seed, spec.params.logprobs) == (
        3,
        2,
        5,
        LogprobOptions(1),
    )
    assert completion_prompts(CompletionRequest.model_validate({"model": "m", "prompt": [1.0, 2]}).prompt)[
        0
    ].input_ids == (1, 2)
    assert _param_of_400(_chat, n=2.5) == "n"
    assert _param_of_400(_chat, max_tokens="3") == "max_tokens"


def test_a_negative_int64_seed_maps_into_the_engines_seeds() -> None:
    assert _chat(seed=-5).params.seed == 2**63 - 5
    assert _chat(seed=-(2**63)).params.seed == 0
    assert _chat(seed=-5).params_for_choice(1).seed == 2**63 - 4


def test_top_p_0_is_greedy_and_obfuscation_is_accepted() -> None:
    assert _chat(top_p=0).params.greedy and not _chat(top_p=0.1).params.greedy
    opts = {"include_obfuscation": True, "include_usage": None}
    assert _chat(stream=True, stream_options=opts).stream


def test_echo_asks_the_engine_for_the_prompt_and_max_tokens_0_for_nothing_more() -> None:
    spec = _completion(echo=True, max_tokens=0)
    assert spec.echo and not spec.logprobs and spec.params.max_tokens == 0
    assert spec.params.logprobs == LogprobOptions(top=0, prompt_start=0)
    with_lp = _completion(echo=True, logprobs=2)
    assert with_lp.logprobs and with_lp.params.logprobs == LogprobOptions(top=2, prompt_start=0)
    assert _param_of_400(_chat, max_tokens=0) == "max_tokens"  # chat generates at least one token


def test_prompt_shapes() -> None:
    assert [p.text for p in completion_prompts(["a", "b"])] == ["a", "b"]
    assert completion_prompts([1, 2])[0].input_ids == (1, 2)
    assert [p.input_ids for p in completion_prompts([[1], [2, 3]])] == [(1,), (2, 3)]
    assert completion_prompts("x")[0].text == "x" and completion_prompts([1])[0].input_ids == (1,)


def test_chat_content_parts_are_joined_and_developer_is_system() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        }
    )
    assert chat_messages(req.messages) == (
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="a\nb"),
    )


def test_native_request_maps_sglang_names() -> None:
    spec = native_spec(
        NativeGenerateRequest.model_validate(
            {"text": "x", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "stop": "y"}}
        )
    )
    assert spec.params.max_tokens == 4 and spec.params.temperature == 0 and spec.stop == ("y",)
    with pytest.raises(InvalidRequestError):
        native_spec(NativeGenerateRequest.model_validate({"sampling_params": {}}))
    scored = native_spec(
        NativeGenerateRequest.model_validate(
            {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1}
        )
    )
    assert scored.params.logprobs == LogprobOptions(top=2, prompt_start=1) and scored.logprobs
    for bad in ({"logprob_start_len": 0}, {"return_logprob": True, "logprob_start_len": -2}):
        assert _param_of_400(
            lambda **f: native_spec(NativeGenerateRequest.model_validate(f)), text="x", **bad
        ) == ("logprob_start_len")


def test_malformed_json_is_a_400() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(b'{"model": ')
    err = error_from_validation(info.value.errors())
    assert err.status == 400 and "malformed JSON" in err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
            "temperature",
        ),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}', "top_p"),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999}',
            "max_tokens",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": -99999999999999999999}',
            "top_k",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [99999999999999999999]}',
            "stop_token_ids[0]",  # the element, as for messages[0].name
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x", "name": "%s"}]}' % ("b" * 513),
            "messages[0].name",  # accepted (passed to the template), but a short string
        ),
    ],
)
def test_values_the_wire_or_sampler_cannot_carry_are_400(body: str, param: str) -> None:
    def run() -> None:
        chat_spec(ChatCompletionRequest.model_validate_json(body))

    assert _param_of_400(run) == param


def test_prompt_token_ids_must_fit_64_bits() -> None:
    with pytest.raises(InvalidRequestError):
        completion_prompts([2**64])


def test_long_stop_strings_are_refused() -> None:
    assert _param_of_400(_chat, stop=["x" * 257]) == "stop"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            "response_format.json_schema.schema",
        ),
        ({"json_schema": '{"type": "object", "b": 1}'}, "json_schema", "json_schema"),
        ({"regex": "[a-z]+"}, "regex", "regex"),
        ({"ebnf": 'root ::= "yes" | "no"'}, "ebnf", "ebnf"),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
def test_structured_output_fields_become_one_constraint(fields: dict[str, Any], kind, param) -> None:  # type: ignore[no-untyped-def]
    for spec in (_chat(**fields), _completion(**fields)):
        c = spec.params.constraint
        assert (c.kind, c.param) == (kind, param) if kind else c is None
        if kind is not None:
            assert all(
                spec.params_for_choice(i).constraint == c for i in range(3)
            )  # n > 1: each its own matcher


def test_json_schema_keeps_key_order() -> None:
    c = _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    ).params.constraint
    assert (
        c is not None
        and c.source == '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    )


def test_native_constraint_fields() -> None:
    def native(**sp: Any):
        return native_spec(NativeGenerateRequest.model_validate({"text": "hi", "sampling_params": sp}))

    assert native(regex="a|b").params.constraint.kind == "regex"  # type: ignore[union-attr]
    assert native(json_schema='{"type": "string"}').params.constraint.param == "sampling_params.json_schema"  # type: ignore[union-attr]
    assert _param_of_400(native, regex="(") == "sampling_params.regex"
    assert _param_of_400(native, regex="a", ebnf='root ::= "a"') == "sampling_params.ebnf"


def test_logit_bias_becomes_id_bias_pairs() -> None:
    assert _chat(logit_bias={"11": -100, "7": 2.5}).params.logit_bias == ((11, -100.0), (7, 2.5))
    assert _completion(logit_bias={"0": 100}).params.logit_bias == ((0, 100.0),)
    assert _chat().params.logit_bias == ()


def _refusal_of(model: type, body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return error_from_validation(info.value.errors())


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"": 1}, '[""]', 'unsupported field: [""]'),  # was "unsupported field: None"
        ({"a b": 1}, '["a b"]', 'unsupported field: ["a b"]'),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "messages[0].content: "),
        ({"logit_bias": {"1": "x"}}, 'logit_bias["1"]', 'logit_bias["1"]: '),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"minimum": 2**64}}}]},
            "tools[0].function.parameters.minimum",
            "tools[0].function.parameters.minimum is outside the 64-bit integer range",  # was tools.0: tools['…
        ),
        (
            {"chat_template_kwargs": {"a": [0, 2**64]}},
            "chat_template_kwargs.a[1]",
            "chat_template_kwargs.a[1] is",
        ),
    ],
)
def test_every_refusal_names_its_field_in_one_path_syntax(
    body: dict[str, Any], param: str, message: str
) -> None:
    err = _refusal_of(ChatCompletionRequest, {"model": "m", "messages": MSG, **body})
    assert err.param == param and err.message.startswith(message), err.message


@pytest.mark.parametrize(
    ("prompt", "param"),
    [("", "prompt"), ([], "prompt"), ([[]], "prompt[0]"), (["a", ""], "prompt[1]"), ([[1], []], "prompt[1]")],
)
def test_an_empty_prompt_gets_one_message_whatever_its_shape(prompt: Any, param: str) -> None:
    """`prompt: ""` used to pass the gateway and be refused by the tokenizer in other words than `prompt: []`."""
    with pytest.raises(InvalidRequestError) as info:
        completion_prompts(prompt)
    assert (info.value.param, info.value.message) == (param, f"{param} must not be empty")

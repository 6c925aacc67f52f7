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
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
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
            "stop_token_ids.0",  # the element, as for messages.0.name
        ),
        ('{"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]}', "messages.0.name"),
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

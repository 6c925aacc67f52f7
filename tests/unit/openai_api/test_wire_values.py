"""Whatever a client can put in JSON is checked where it enters (the gateway's request models): a value the wire
cannot carry is a 400 naming the field, and anything accepted encodes — the encoder never raises on user data."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubesgl.openai_api.http_errors import error_from_validation
from kubesgl.openai_api.request_models import ChatCompletionRequest, CompletionRequest
from kubesgl.protocol import (
    MAX_JSON_DEPTH,
    MAX_JSON_STRING,
    PromptKind,
    SamplingParams,
    TokenizeRequest,
    json_value_error,
)
from pydantic import ValidationError

BASE = {"model": "demo", "messages": [{"role": "user", "content": ""}], "max_tokens": 4, "n": 2}


def _refusal(body: str | dict[str, Any], model: type = ChatCompletionRequest) -> tuple[str | None, str]:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(raw)
    err = error_from_validation(info.value.errors())
    assert err.status == 400
    return err.param, err.message


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_the_fuzz_case_that_was_a_500_is_a_400() -> None:
    # Found by tests/e2e/test_fuzz_gateway.py on a clean clone: msgpack raised OverflowError in the gateway.
    body = '{"messages":[{"role":"user","content":""}],"model":"demo","chat_template_kwargs":{"":-9223372036854775809},"max_tokens":4,"n":2}'
    param, message = _refusal(body)
    assert param == 'chat_template_kwargs[""]' and "64-bit" in message and message.startswith(param)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64, -(10**30)])
def test_out_of_range_integers_anywhere_are_400(value: int) -> None:
    assert (
        _refusal({**BASE, "chat_template_kwargs": {"a": {"b": [0, value]}}})[0]
        == "chat_template_kwargs.a.b[1]"
    )
    assert _refusal({**BASE, "tools": [{"type": "function", "x": value}]})[0] == "tools[0].x"
    assert _refusal({**BASE, "seed": value})[0] == "seed"
    assert _refusal({**BASE, "n": value})[0] == "n"
    assert _refusal({"model": "demo", "prompt": [[1, value]]}, CompletionRequest)[0] == "prompt[0][1]"


def test_the_int64_bounds_themselves_are_accepted() -> None:
    req = ChatCompletionRequest.model_validate(
        {**BASE, "chat_template_kwargs": {"lo": -(2**63), "hi": 2**63 - 1}}
    )
    assert req.chat_template_kwargs == {"lo": -(2**63), "hi": 2**63 - 1}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_in_free_form_json_are_400(literal: str) -> None:
    body = json.dumps(BASE)[:-1] + f', "chat_template_kwargs": {{"t": [1.5, {literal}]}}}}'
    param, message = _refusal(body)
    assert param == "chat_template_kwargs.t[1]" and "finite" in message


def test_over_deep_nesting_is_400() -> None:
    ChatCompletionRequest.model_validate({**BASE, "chat_template_kwargs": {"a": _nested(MAX_JSON_DEPTH - 1)}})
    param, message = _refusal({**BASE, "chat_template_kwargs": {"a": _nested(MAX_JSON_DEPTH + 5)}})
    assert param == "chat_template_kwargs" and "nested" in message


def test_oversize_strings_are_400_naming_the_field() -> None:
    long = "x" * (MAX_JSON_STRING + 1)
    assert _refusal({**BASE, "chat_template_kwargs": {"system": long}})[0] == "chat_template_kwargs.system"
    assert _refusal({**BASE, "chat_template_kwargs": {long: 1}})[0] == "chat_template_kwargs"
    assert _refusal({**BASE, "user": "u" * 513})[0] == "user"
    assert _refusal({**BASE, "model": "m" * 513})[0] == "model"


def test_non_string_keys_are_refused() -> None:
    # JSON keys are always strings; a library caller handing the models a Python dict is checked the same way.
    assert "non-string key" in str(json_value_error({"a": {1: "x"}}, "chat_template_kwargs"))
    assert "not a JSON value" in str(json_value_error({"a": {1, 2}}, "chat_template_kwargs"))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=24,
)


@given(kwargs=st.dictionaries(st.text(max_size=4), json_values, max_size=4))
@settings(max_examples=300, derandomize=True, database=None, deadline=None)
def test_accepted_free_form_json_always_encodes(kwargs: dict[str, Any]) -> None:
    try:
        body = json.dumps({**BASE, "chat_template_kwargs": kwargs}, allow_nan=True)
        req = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        assert str(error_from_validation(e.errors()).param).startswith("chat_template_kwargs")
        return
    msg = TokenizeRequest(
        rid="r",
        gateway_id="g",
        model="demo",
        kind=PromptKind.CHAT,
        sampling=SamplingParams(),
        deadline=1.0,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    assert TokenizeRequest.from_bytes(msg.to_bytes()).chat_template_kwargs == req.chat_template_kwargs

"""Structured outputs and logit_bias end to end: the official `openai` client against a real stack (gateway,
tokenizer, scheduler, detokenizer as OS processes) serving the demo model. Every constrained answer matches its
grammar; a grammar xgrammar cannot build is a 400 naming the field; logit_bias forces a token."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import TEST_SCHEDULER_ARGS
from kubesgl.launcher import Stack
from kubesgl.text.tokenizer import ModelTokenizer

MODEL = "demo"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rainy": {"type": "boolean"}},
    "required": ["city", "rainy"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def served(stack_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(tmp_path_factory.mktemp("structured"), scheduler_args=TEST_SCHEDULER_ARGS)
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


@pytest.fixture(scope="module")
def client(served: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{served.gateway_urls[0]}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_json_schema_answers_validate_for_every_choice(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=fmt,
        n=3,
        seed=7,
        max_tokens=300,  # type: ignore[arg-type]
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_regex_and_json_object_on_completions_and_streaming_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="id:", max_tokens=40, temperature=0, extra_body={"regex": r"[A-Z]{2}\d{3}"}
    )
    assert re.fullmatch(r"[A-Z]{2}\d{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=300,
        seed=1,
        stream=True,
        extra_body={"ebnf": 'root ::= "yes" | "no" | "maybe"'},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("yes", "no", "maybe")


def test_native_generate_takes_the_constraint_in_sampling_params(served: Stack) -> None:
    body = {
        "text": "pick",
        "sampling_params": {"regex": "(red|green)", "max_new_tokens": 10, "temperature": 0},
    }
    r = httpx.post(f"{served.gateway_urls[0]}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text"] in ("red", "green")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "int"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"regex": "(a"}, "regex"),
        ({"regex": "a", "json_schema": '{"type": "string"}'}, "regex"),
        ({"logit_bias": {"token": 3}}, "logit_bias"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary: the engine's 400
    ],
)
def test_bad_constraints_and_biases_are_400s_naming_the_field(served: Stack, extra: dict, param: str) -> None:  # type: ignore[type-arg]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(f"{served.gateway_urls[0]}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logit_bias_forces_a_token(client: openai.OpenAI, demo_model_dir: str) -> None:
    tokenizer = ModelTokenizer.load(demo_model_dir)
    target = tokenizer.encode("banana")[0]
    r = client.completions.create(
        model=MODEL, prompt="fruit:", max_tokens=3, temperature=0, logit_bias={str(target): 100}
    )
    assert r.choices[0].text == tokenizer.hf.decode([target] * 3)

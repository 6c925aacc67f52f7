"""The token-id fast path (request_models._flat_ids_fast / _prompt_ids_fast) accepts exactly what the field's
full validation accepts, returns the same value, and leaves every refusal, with its error, to that validation:
checked against models of the same fields without it, over seeded random values of every shape a client can
send."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kubesgl.openai_api.request_models import CompletionRequest, Int, NativeGenerateRequest, StrictModel
from kubesgl.protocol import WIRE_INT_MAX, WIRE_INT_MIN
from pydantic import ValidationError


class PlainPrompt(StrictModel):
    prompt: str | list[str] | list[Int] | list[list[Int]] | None


class PlainIds(StrictModel):
    input_ids: list[Int] | None = None


def _element(rng: random.Random) -> Any:
    return rng.choice(
        [
            rng.randint(0, 151935),
            rng.randint(0, 151935),
            rng.randint(0, 151935),
            WIRE_INT_MIN,
            WIRE_INT_MAX,
            WIRE_INT_MAX + 1,
            WIRE_INT_MIN - 1,
            -1,
            7.0,
            7.5,
            True,
            "7",
            None,
            [3],
        ]
    )


def _value(rng: random.Random) -> Any:
    shape = rng.randrange(5)
    if shape == 0:
        return [_element(rng) if rng.random() < 0.05 else rng.randint(0, 9) for _ in range(rng.randint(0, 6))]
    if shape == 1:
        return [_value(rng) if rng.random() < 0.1 else rng.randint(0, 9) for _ in range(rng.randint(0, 4))]
    if shape == 2:
        return [[rng.randint(0, 9) for _ in range(rng.randint(0, 3))] for _ in range(rng.randint(0, 3))]
    if shape == 3:
        return [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]
    return rng.choice(["text", ["a", "b"], [], [[]], 5, {"a": 1}, None])


def _outcome(model: type[StrictModel], field: str, value: Any) -> Any:
    try:
        return ("ok", getattr(model.model_validate({field: value}), field))
    except ValidationError as e:
        return ("error", [(err["type"], err["loc"], err["msg"]) for err in e.errors()])


@pytest.mark.parametrize("seed", range(4))
def test_fast_path_decides_as_full_validation(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        value = _value(rng)
        body = {"model": "m", "prompt": value}
        try:
            fast = ("ok", CompletionRequest.model_validate(body).prompt)
        except ValidationError as e:
            fast = ("error", [(err["type"], err["loc"], err["msg"]) for err in e.errors()])
        assert fast == _outcome(PlainPrompt, "prompt", value), value
        assert _outcome(NativeGenerateRequest, "input_ids", value) == _outcome(
            PlainIds, "input_ids", value
        ), value


def test_a_long_prompt_comes_back_as_sent() -> None:
    ids = list(range(4096))
    assert CompletionRequest.model_validate({"model": "m", "prompt": ids}).prompt == ids
    assert CompletionRequest.model_validate({"model": "m", "prompt": [ids, ids[:3]]}).prompt == [ids, ids[:3]]

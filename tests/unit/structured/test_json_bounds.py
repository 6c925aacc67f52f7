"""--bound-json-values (the demo model's grammars): open strings, numbers, arrays and free-form objects get
bounds, so a model that never closes a value still finishes; without the flag the client's schema is compiled
as sent."""

from __future__ import annotations

import json

import pydantic
import pytest
from kubesgl import LLM, SamplingParams
from kubesgl.structured.bounds import MAX_ABS, MAX_CHARS, MAX_ITEMS, bound_open_values
from kubesgl.values.constraint import Constraint


class Person(pydantic.BaseModel):
    name: str
    age: int
    score: float
    tags: list[str]
    kind: str = pydantic.Field(pattern="^[ab]$")


def test_open_values_get_bounds_and_closed_ones_stay() -> None:
    s = bound_open_values(Person.model_json_schema())
    props = s["properties"]
    assert props["name"]["maxLength"] == MAX_CHARS and props["tags"]["items"]["maxLength"] == MAX_CHARS
    assert (props["age"]["minimum"], props["age"]["maximum"]) == (-MAX_ABS, MAX_ABS)
    assert props["score"]["maximum"] == MAX_ABS and props["tags"]["maxItems"] == MAX_ITEMS
    assert "maxLength" not in props["kind"]  # a pattern closes it already
    assert "maxProperties" not in s  # its properties are the schema's own
    free = bound_open_values({"type": "object"})
    assert free["maxProperties"] == MAX_ITEMS and free["propertyNames"] == {"maxLength": MAX_CHARS}
    assert bound_open_values({"enum": ["x", "y"], "type": "string"}) == {"enum": ["x", "y"], "type": "string"}
    assert bound_open_values({"type": "string", "maxLength": 3}) == {"type": "string", "maxLength": 3}


@pytest.mark.parametrize("bounded", [False, True], ids=["as_sent", "bounded"])
def test_the_demo_finishes_a_schema_only_with_bounds(bounded: bool) -> None:
    schema = Person.model_json_schema()
    del schema["properties"]["kind"], schema["required"][-1]
    sp = SamplingParams(max_tokens=200, temperature=0, constraint=Constraint.json_schema(json.dumps(schema)))
    with LLM("demo", bound_json_values=bounded) as llm:
        outs = llm.generate(["A person:", "Describe someone."], sp)
    if not bounded:  # the random weights never close the first string: cut at max_tokens
        assert [o["finish_reason"].value for o in outs] == ["length", "length"]
        return
    for o in outs:
        assert o["finish_reason"].value == "stop", o["text"]
        Person.model_validate({**json.loads(o["text"]), "kind": "a"})

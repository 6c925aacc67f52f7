"""RequestOutput crosses the engine process's pipe pickled (services/scheduler/engine_process.py) through its own
__reduce__: every field must come back, and a field added to the dataclass without it must fail here."""

from __future__ import annotations

import dataclasses
import pickle

from kubesgl.errors import InvalidRequestError
from kubesgl.values.outputs import FinishReason, RequestOutput, TokenLogprob


def _full() -> RequestOutput:
    """Every field away from its default, each value distinct."""
    lp = TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5)), "a", b"a", ("a", "b"), (b"a", b"b"))
    return RequestOutput(
        rid="chatcmpl-1",
        new_token_ids=[7, 9],
        prompt_tokens=600,
        cached_tokens=32,
        completion_tokens=12,
        finished=True,
        finish_reason=FinishReason.LENGTH,
        logprobs=[lp],
        prompt_logprobs=[TokenLogprob(1, None)],
        error=InvalidRequestError("bad grammar", param="response_format"),
    )


def test_every_field_survives_the_pipe():
    out = _full()
    back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    for f in dataclasses.fields(RequestOutput):
        if f.name == "error":
            assert type(back.error) is type(out.error) and str(back.error) == str(out.error)
            assert back.error.param == out.error.param
        else:
            assert getattr(back, f.name) == getattr(out, f.name), f.name
    assert back.finish_reason is FinishReason.LENGTH


def test_reduce_names_every_field_in_order():
    out = _full()
    cls, args = out.__reduce__()
    assert cls is RequestOutput
    names = [f.name for f in dataclasses.fields(RequestOutput)]
    assert len(args) == len(names)
    for name, value in zip(names, args, strict=True):
        assert value is getattr(out, name), name


def test_defaults_round_trip():
    out = RequestOutput("r", [1], 3, 0, 1)
    assert pickle.loads(pickle.dumps(out)) == out

"""Wire protocol: every message survives a round trip, unknown fields are ignored, bad bodies are refused."""

from __future__ import annotations

import msgpack
import pytest
from kubesgl import protocol as p
from kubesgl.errors import ContextLengthError, KubesglError, ServiceUnavailableError
from kubesgl.values.sampling import LogprobOptions, SamplingParams


def _delta(rid: str, seq: int = 0, gateway_id: str = "gw-a", tokens: int = 3) -> p.TokenDelta:
    return p.TokenDelta(
        rid=rid,
        gateway_id=gateway_id,
        instance_id="sched-0",
        seq=seq,
        tokens=list(range(5, 5 + tokens)),
        new_from=min(2, tokens),
        logprobs=[p.TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.0)))],
        traceparent="00-ab-cd-01",
    )


def _samples() -> list[p.Message]:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(7, 9))
    return [
        p.TokenizeRequest(
            rid="r1",
            gateway_id="gw-a",
            model="demo",
            kind=p.PromptKind.CHAT,
            sampling=sampling,
            deadline=123.5,
            messages=(p.ChatMessage(role="user", content="你好 👋"),),
            chat_template_kwargs={"enable_thinking": False},
        ),
        p.GenerateRequest(rid="r1", gateway_id="gw-a", input_ids=[1, 2, 3], sampling=sampling, deadline=1.0),
        p.Admitted(rid="r1", instance_id="sched-0", prompt_tokens=3),
        p.ErrorReply(rid="r1", error=p.ErrorInfo(400, "invalid_request_error", "bad", param="max_tokens")),
        p.Abort(rid="r1"),
        p.Heartbeat(
            instance_id="sched-0",
            model="demo",
            context_len=4096,
            page_size=16,
            num_pages=100,
            running=1,
            queued=0,
            free_pages=90,
            available_pages=95,
            max_running_requests=8,
            draining=False,
            ts=9.0,
        ),
        _delta("r1", seq=2),
        p.TokenDeltaBatch(deltas=[_delta("r1").to_bytes(), _delta("r2", gateway_id="gw-b").to_bytes()]),
        p.BatchAck(refused={1: "not a TokenDelta"}),
        p.TextDelta(
            rid="r1",
            instance_id="sched-0",
            seq=2,
            text="中",
            token_ids=[7],
            finished=True,
            finish_reason=p.FinishReason.STOP,
            prompt_logprobs=[p.TokenLogprob(1, None, token="a"), p.TokenLogprob(2, -3.0, token="b")],
            prompt_text="ab",
        ),
        p.SchedulerStats(
            instance_id="sched-0",
            running=0,
            queued=0,
            free_pages=10,
            available_pages=10,
            total_pages=10,
            cached_prefix_pages=0,
        ),
        # Several logprobs in one list (a list of dataclasses once encoded only when it held exactly one).
        p.TokenDelta(
            rid="r3",
            gateway_id="gw-a",
            instance_id="sched-0",
            seq=0,
            tokens=[5, 6],
            new_from=0,
            logprobs=[p.TokenLogprob(5, -0.5), p.TokenLogprob(6, -1.5, ((6, -1.5),))],
            prompt_logprobs=[p.TokenLogprob(1, None), p.TokenLogprob(2, -3.0), p.TokenLogprob(3, -0.25)],
        ),
        p.GenerateRequest(
            rid="r4",
            gateway_id="gw-a",
            input_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=0, logprobs=LogprobOptions(top=1, prompt_start=0)),
            deadline=1.0,
        ),
        p.PrefillAsk(rid="r5", decode_instance="decode-0", input_ids=[1, 2], sampling=sampling, deadline=2.0),
        p.PrefillDone(
            rid="r5",
            seed=7,
            new_token_ids=[9],
            cached_tokens=0,
            num_pages=1,
            agent_metadata=b"m",
            descs=b"d",
            logprobs=[p.TokenLogprob(9, -0.5)],
        ),
        p.KvRelease(rid="r5"),
        p.TextDeltaBatch(
            deltas=[
                p.TextDelta(rid="r1", instance_id="sched-0", seq=0, text="a", token_ids=[5]),
                p.TextDelta(rid="r2", instance_id="sched-0", seq=3, text="", finished=True),
            ]
        ),
    ]


@pytest.mark.parametrize("msg", _samples(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: p.Message) -> None:
    assert type(msg).from_bytes(msg.to_bytes()) == msg


def test_a_gateway_subject_carries_a_batch_or_one_error_delta() -> None:
    batch = _samples()[-1]
    assert isinstance(batch, p.TextDeltaBatch)
    assert p.gateway_deltas(batch.to_bytes()) == batch.deltas
    single = p.TextDelta(rid="r1", instance_id="", seq=-1, text="", finished=True)
    assert p.gateway_deltas(single.to_bytes()) == [single]
    with pytest.raises(p.ProtocolError):
        p.gateway_deltas(p.Abort(rid="r1").to_bytes())


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    body = msgpack.unpackb(p.Admitted(rid="r", instance_id="i", prompt_tokens=1).to_bytes())
    body["added_in_v1_1"] = {"x": 1}
    assert p.Admitted.from_bytes(msgpack.packb(body)) == p.Admitted(rid="r", instance_id="i", prompt_tokens=1)


def test_a_delta_leaves_its_default_fields_off_the_wire_and_a_full_map_still_decodes() -> None:
    """The per-step messages omit fields at their defaults (fewer bytes and keys to match per token); a map
    that spells every field out, as a sender before that did, decodes to the same message."""
    delta = p.TokenDelta(rid="r", gateway_id="gw", instance_id="i", seq=3, tokens=[5, 6], new_from=1)
    body = msgpack.unpackb(delta.to_bytes())
    assert body == {"msg": "TokenDelta", "rid": "r", "gateway_id": "gw", "instance_id": "i", "seq": 3,
                    "tokens": [5, 6], "new_from": 1}  # fmt: skip
    full = {**body, "finished": False, "finish_reason": None, "prompt_tokens": 0, "cached_tokens": 0,
            "completion_tokens": 0, "logprobs": None, "error": None, "traceparent": None, "prompt_logprobs": None}  # fmt: skip
    assert p.TokenDelta.from_bytes(msgpack.packb(full)) == delta
    text = p.TextDelta(rid="r", instance_id="i", seq=3, text="hi")
    assert msgpack.unpackb(text.to_bytes()) == {
        "msg": "TextDelta",
        "rid": "r",
        "instance_id": "i",
        "seq": 3,
        "text": "hi",
    }
    assert p.gateway_deltas(
        msgpack.packb({**msgpack.unpackb(text.to_bytes()), "token_ids": [], "finished": False})
    ) == [text]


def test_decode_picks_the_reply_type() -> None:
    err = p.ErrorReply.from_error("r", ServiceUnavailableError("no scheduler"))
    assert p.decode(err.to_bytes(), p.Admitted, p.ErrorReply) == err
    ok = p.Admitted(rid="r", instance_id="i", prompt_tokens=1)
    assert p.decode(ok.to_bytes(), p.Admitted, p.ErrorReply) == ok


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1garbage",
        msgpack.packb([1, 2]),
        p.BatchAck().to_bytes(),
        msgpack.packb({"msg": "Admitted", "rid": "r"}),
    ],
)
def test_bad_bodies_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.Admitted.from_bytes(data)


def test_error_reply_rebuilds_the_typed_error() -> None:
    reply = p.ErrorReply.from_error("r", ContextLengthError("too long", param="messages"))
    back = p.ErrorReply.from_bytes(reply.to_bytes()).to_error()
    assert isinstance(back, ContextLengthError)
    assert (back.status, back.code, back.param, back.message) == (
        400,
        "context_length_exceeded",
        "messages",
        "too long",
    )
    odd = p.ErrorInfo(status=418, type="teapot", code="x", message="m").to_error()
    assert type(odd) is KubesglError and (odd.status, odd.type, odd.code) == (418, "teapot", "x")


def _generate_with(sampling: dict) -> bytes:
    body = msgpack.unpackb(p.GenerateRequest("r", "g", [1], SamplingParams(), 1.0).to_bytes())
    return msgpack.packb({**body, "sampling": sampling})


def test_sampling_dict_round_trips_and_rejects_unknown_fields() -> None:
    params = SamplingParams(
        max_tokens=3, temperature=0.5, stop_token_ids=(1,), seed=4, logprobs=LogprobOptions(top=2)
    )
    wire = p.GenerateRequest("r", "g", [1], params, 1.0).to_bytes()
    assert p.GenerateRequest.from_bytes(wire).sampling == params
    with pytest.raises(KubesglError, match="best_of"):
        p.GenerateRequest.from_bytes(_generate_with({"best_of": 2}))
    with pytest.raises(KubesglError, match="temperature"):  # the engine's gate (SamplingParams.validate)
        p.GenerateRequest.from_bytes(_generate_with({"temperature": -1.0})).sampling.validate()


def test_subjects_are_versioned_and_reject_unsafe_names() -> None:
    assert p.generate_subject("sched-0") == "kubesgl.v2.sched.sched-0.generate"
    assert p.gateway_subject("gw-1") == "kubesgl.v2.gw.gw-1"
    for bad in ["", "a.b", "a*", ">", "a b"]:
        with pytest.raises(ValueError):
            p.gateway_subject(bad)


def test_headers_carry_rid_deadline_and_trace() -> None:
    h = p.headers("r1", deadline=1700000000.25, traceparent="00-ab-cd-01")
    assert h[p.HEADER_RID] == "r1" and h[p.HEADER_TRACEPARENT] == "00-ab-cd-01"
    assert p.header_deadline(h) == 1700000000.25
    assert p.header_deadline({p.HEADER_DEADLINE: "soon"}) is None
    # The trace rides the headers, never the body: a message without one (tracing off, an older sender, no
    # headers at all) is taken untraced, a PrefillAsk as a GenerateRequest.
    assert p.header_traceparent(h) == "00-ab-cd-01"
    assert p.header_traceparent(p.headers("r1", 5.0)) is None and p.header_traceparent(None) is None
    ask = p.PrefillAsk(
        rid="r1", decode_instance="d-0", input_ids=[1, 2], sampling=SamplingParams(), deadline=5.0
    )
    assert p.decode(ask.to_bytes(), p.PrefillAsk, p.PrefillDone, p.KvRelease) == ask


def test_one_batch_carries_every_delta_that_fits_and_decodes_back_in_order() -> None:
    deltas = [_delta(f"r{i}", seq=i, gateway_id=f"gw-{i % 3}") for i in range(256)]
    ((group, body),) = p.TokenDeltaBatch.pack(deltas, max_bytes=1 << 20)
    assert group == deltas
    entries = p.TokenDeltaBatch.from_bytes(body).deltas
    assert [p.TokenDelta.from_bytes(e) for e in entries] == deltas


def test_batches_are_cut_to_the_byte_budget_and_an_oversized_delta_goes_alone() -> None:
    deltas = [_delta(f"r{i}", tokens=20) for i in range(50)]
    deltas.insert(7, _delta("huge", tokens=5000))
    budget = 2000
    packed = p.TokenDeltaBatch.pack(deltas, max_bytes=budget)
    assert [d for group, _ in packed for d in group] == deltas  # nothing lost, nothing reordered
    assert len(packed) > 2
    for group, body in packed:
        assert len(body) <= budget or [d.rid for d in group] == ["huge"]
        assert [p.TokenDelta.from_bytes(e) for e in p.TokenDeltaBatch.from_bytes(body).deltas] == group
    assert p.TokenDeltaBatch.pack([], max_bytes=budget) == []


@pytest.mark.parametrize(
    ("cls", "body"),
    [
        (p.TokenDeltaBatch, {"msg": "TokenDeltaBatch", "deltas": 5}),
        (p.TokenDeltaBatch, {"msg": "TokenDeltaBatch", "deltas": [b"ok", "a str"]}),
        (p.TokenDeltaBatch, {"msg": "TokenDeltaBatch"}),
        (p.BatchAck, {"msg": "BatchAck", "refused": {"0": "why"}}),
        (p.BatchAck, {"msg": "BatchAck", "refused": [0]}),
    ],
)
def test_malformed_batches_and_acks_raise_protocol_error(cls: type[p.Message], body: dict) -> None:
    with pytest.raises(p.ProtocolError):
        cls.from_bytes(msgpack.packb(body, use_bin_type=True))


def test_fields_decode_to_their_declared_types() -> None:
    req = p.TokenizeRequest.from_bytes(_samples()[0].to_bytes())
    assert req.kind is p.PromptKind.CHAT and isinstance(req.messages[0], p.ChatMessage)
    assert isinstance(req.sampling, SamplingParams) and req.sampling.stop_token_ids == (7, 9)
    delta = p.TokenDelta.from_bytes(_delta("r1").to_bytes())
    assert isinstance(delta.logprobs[0], p.TokenLogprob) and delta.logprobs[0].top == ((7, -0.5), (8, -1.0))
    text = p.TextDelta.from_bytes(_samples()[9].to_bytes())
    assert text.finish_reason is p.FinishReason.STOP
    err = p.ErrorReply.from_bytes(p.ErrorReply.from_error("r", ServiceUnavailableError("x")).to_bytes())
    assert err.error == p.ErrorInfo(503, "service_unavailable", "x")


def _body(msg: p.Message) -> dict:
    return msgpack.unpackb(msg.to_bytes())


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        (lambda b: b["sampling"].update(temperature="hot"), "sampling.temperature must be a number, not str"),
        (lambda b: b["sampling"].update(seed=True), "sampling.seed must be int, not bool"),
        (lambda b: b["sampling"].update(stop_token_ids=[1, "2"]), "sampling.stop_token_ids must be an array"),
        (lambda b: b["sampling"].update(logprobs={"top": 1.5}), "sampling.logprobs.top must be int"),
        (lambda b: b.update(kind="essay"), "kind must be one of 'chat', 'completion', 'tokens'"),
        (lambda b: b["messages"][0].update(role=None), "messages[0].role must be str, not NoneType"),
        (lambda b: b.update(messages={"role": "user"}), "messages must be an array"),
        (lambda b: b.update(chat_template_kwargs={1: 2}), "chat_template_kwargs[1] must be str, not int"),
        (lambda b: b.pop("deadline"), "is incomplete"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_where_it_sits(patch, where: str) -> None:
    body = _body(_samples()[0])
    patch(body)
    with pytest.raises(p.ProtocolError, match="^malformed TokenizeRequest: ") as info:
        p.TokenizeRequest.from_bytes(msgpack.packb(body))
    assert where in str(info.value)


def test_an_int_is_a_float_and_unknown_nested_fields_are_ignored_except_in_sampling() -> None:
    body = _body(_delta("r1"))
    body["logprobs"][0]["added_in_v2_1"] = 1
    body["logprobs"][0]["logprob"] = -1
    delta = p.TokenDelta.from_bytes(msgpack.packb(body))
    assert delta.logprobs[0].logprob == -1.0 and isinstance(delta.logprobs[0].logprob, float)
    gen = _body(_samples()[1])
    gen["sampling"]["logprobs"] = {"top": 2, "prompt_from": 0}
    with pytest.raises(KubesglError, match=r"unsupported sampling parameter\(s\): prompt_from") as info:
        p.GenerateRequest.from_bytes(msgpack.packb(gen))
    assert info.value.status == 400 and info.value.param == "prompt_from"


def test_an_open_ended_max_tokens_travels_as_none() -> None:
    req = p.GenerateRequest("r", "g", [1], SamplingParams(max_tokens=None), 1.0)
    assert p.GenerateRequest.from_bytes(req.to_bytes()).sampling.max_tokens is None

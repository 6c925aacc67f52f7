"""Wire protocol: every message survives a round trip, unknown fields are ignored, bad bodies are refused."""

from __future__ import annotations

import msgpack
import pytest
from kubesgl import protocol as p
from kubesgl.errors import ContextLengthError, KubesglError, ServiceUnavailableError
from kubesgl.values.sampling import SamplingParams


def _delta(rid: str, seq: int = 0, gateway_id: str = "gw-a", tokens: int = 3) -> p.TokenDelta:
    return p.TokenDelta(
        rid=rid,
        gateway_id=gateway_id,
        instance_id="sched-0",
        seq=seq,
        tokens=list(range(5, 5 + tokens)),
        new_from=min(2, tokens),
        logprobs=[{"token_id": 7, "logprob": -0.5, "top": [[7, -0.5], [8, -1.0]]}],
        traceparent="00-ab-cd-01",
    )


def _samples() -> list[p.Message]:
    sampling = p.sampling_to_dict(SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(7, 9)))
    return [
        p.TokenizeRequest(
            rid="r1",
            gateway_id="gw-a",
            model="demo",
            kind="chat",
            sampling=sampling,
            deadline=123.5,
            messages=[{"role": "user", "content": "你好 👋"}],
            chat_template_kwargs={"enable_thinking": False},
        ),
        p.GenerateRequest(rid="r1", gateway_id="gw-a", input_ids=[1, 2, 3], sampling=sampling, deadline=1.0),
        p.Admitted(rid="r1", instance_id="sched-0", prompt_tokens=3),
        p.ErrorReply(rid="r1", status=400, type="invalid_request_error", message="bad", param="max_tokens"),
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
            finish_reason="stop",
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
    ]


@pytest.mark.parametrize("msg", _samples(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: p.Message) -> None:
    assert type(msg).from_bytes(msg.to_bytes()) == msg


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    body = msgpack.unpackb(p.Admitted(rid="r", instance_id="i", prompt_tokens=1).to_bytes())
    body["added_in_v1_1"] = {"x": 1}
    assert p.Admitted.from_bytes(msgpack.packb(body)) == p.Admitted(rid="r", instance_id="i", prompt_tokens=1)


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
    odd = p.error_from_dict({"status": 418, "type": "teapot", "code": "x", "message": "m"})
    assert type(odd) is KubesglError and (odd.status, odd.type, odd.code) == (418, "teapot", "x")


def test_sampling_dict_round_trips_and_rejects_unknown_fields() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.5, stop_token_ids=(1,), seed=4, logprobs=True)
    wire = msgpack.unpackb(msgpack.packb(p.sampling_to_dict(params)))
    assert p.sampling_from_dict(wire) == params
    with pytest.raises(KubesglError, match="best_of"):
        p.sampling_from_dict({"best_of": 2})
    with pytest.raises(KubesglError, match="temperature"):
        p.sampling_from_dict({"temperature": -1.0})


def test_subjects_are_versioned_and_reject_unsafe_names() -> None:
    assert p.generate_subject("sched-0") == "kubesgl.v1.sched.sched-0.generate"
    assert p.gateway_subject("gw-1") == "kubesgl.v1.gw.gw-1"
    for bad in ["", "a.b", "a*", ">", "a b"]:
        with pytest.raises(ValueError):
            p.gateway_subject(bad)


def test_headers_carry_rid_deadline_and_trace() -> None:
    h = p.headers("r1", deadline=1700000000.25, traceparent="00-ab-cd-01")
    assert h[p.HEADER_RID] == "r1" and h[p.HEADER_TRACEPARENT] == "00-ab-cd-01"
    assert p.header_deadline(h) == 1700000000.25
    assert p.header_deadline({p.HEADER_DEADLINE: "soon"}) is None


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

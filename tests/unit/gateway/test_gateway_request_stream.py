"""RequestStream: the gateway's per-request inbox (ordering by seq, duplicates, instance adoption, gaps)."""

from __future__ import annotations

from kubesgl.errors import ServiceUnavailableError
from kubesgl.protocol import ErrorInfo, TextDelta
from kubesgl.services.gateway.request_stream import RequestStream


def _d(seq: int, instance: str = "a", **kw: object) -> TextDelta:
    return TextDelta(rid="r", instance_id=instance, seq=seq, text=str(seq), **kw)  # type: ignore[arg-type]


async def _drain(stream: RequestStream) -> list[str]:
    out = []
    while (d := await stream.next(0.01)) is not None:
        out.append(d.text)
    return out


async def test_deltas_wait_for_adoption_then_come_in_seq_order_without_duplicates() -> None:
    s = RequestStream("r")
    for seq in (1, 0, 1, 2):
        assert s.offer(_d(seq))
    assert await _drain(s) == []  # not adopted yet: the Admitted reply names the instance
    assert s.adopt("a") == []
    assert await _drain(s) == ["0", "1", "2"]
    s.offer(_d(0))
    s.offer(_d(3))
    assert await _drain(s) == ["3"]


async def test_adoption_drops_and_names_other_instances() -> None:
    s = RequestStream("r")
    s.offer(_d(0, "b"))
    s.offer(_d(0, "a"))
    assert s.adopt("a") == ["b"]
    assert not s.offer(_d(1, "b"))
    assert await _drain(s) == ["0"]


async def test_a_gap_is_measured_until_it_fills() -> None:
    s = RequestStream("r")
    s.adopt("a")
    s.offer(_d(1))
    assert s.gap_age() > 0
    s.offer(_d(0))
    assert s.gap_age() == 0 and await _drain(s) == ["0", "1"]


async def test_errors_and_failures_skip_the_queue() -> None:
    s = RequestStream("r")
    s.adopt("a")
    s.offer(_d(5, error=ErrorInfo(status=500, type="internal_error", message="boom")))
    s.fail(ServiceUnavailableError("lost"))
    first, second = await s.next(0.01), await s.next(0.01)
    assert first is not None and first.error.message == "boom"
    assert second is not None and second.error.message == "lost" and second.finished

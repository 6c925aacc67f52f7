"""The scheduler's per-request output bookkeeping: batched deltas, context windows, logprobs, the end."""

from __future__ import annotations

from kubesgl.errors import ServiceUnavailableError
from kubesgl.services.scheduler.streams import RequestStream
from kubesgl.text.incremental import DETOK_CONTEXT_TOKENS
from kubesgl.values.outputs import RequestOutput, TokenLogprob


def _out(new: list[int], total: int, finished: bool = False, lps: bool = False) -> RequestOutput:
    logprobs = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in new] if lps else None
    return RequestOutput("r", new, prompt_tokens=4, cached_tokens=2, completion_tokens=total,
                         finished=finished, finish_reason="length" if finished else None, logprobs=logprobs)  # fmt: skip


def test_tokens_produced_while_a_delta_is_in_flight_go_out_together() -> None:
    s = RequestStream("r", "gw", deadline=0.0, prompt_tokens=4, wants_logprobs=True)
    s.add(_out([1, 2], 2, lps=True), "tp-1")
    first = s.next_delta("i")
    assert first is not None and (first.seq, first.tokens, first.new_from) == (0, [1, 2], 0)
    assert [lp.token_id for lp in first.logprobs] == [1, 2] and s.next_delta("i") is None
    s.add(_out([3], 3, lps=True), None)
    s.add(_out([4], 4, lps=True), None)
    second = s.next_delta("i")
    assert (second.seq, second.tokens, second.new_from) == (1, [1, 2, 3, 4], 2)
    assert [lp.token_id for lp in second.logprobs] == [3, 4]
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (4, 2, 4)


def test_context_is_capped_and_the_last_delta_ends_the_stream() -> None:
    s = RequestStream("r", "gw", deadline=0.0, prompt_tokens=4)
    s.add(_out(list(range(20)), 20), None)
    s.next_delta("i")
    s.add(_out([20, 21], 22, finished=True), None)
    last = s.next_delta("i")
    assert last.tokens == list(range(20 - DETOK_CONTEXT_TOKENS, 22)) and last.new_from == DETOK_CONTEXT_TOKENS
    assert last.finished and last.finish_reason == "length" and last.logprobs is None
    assert s.done and s.next_delta("i") is None


def test_a_finish_without_new_tokens_still_sends_the_final_delta() -> None:
    s = RequestStream("r", "gw", deadline=0.0, prompt_tokens=4)
    s.add(_out([7], 1), None)
    s.next_delta("i")
    s.add(_out([], 1, finished=True), None)
    last = s.next_delta("i")
    assert last.finished and last.tokens[last.new_from :] == []


def test_abandoning_sends_an_error_with_the_next_seq_and_nothing_after() -> None:
    s = RequestStream("r", "gw", deadline=0.0, prompt_tokens=4)
    s.add(_out([1], 1), None)
    s.next_delta("i")
    s.add(_out([2], 2), None)
    err = s.abandon("i", ServiceUnavailableError("gone"))
    assert (err.seq, err.finished, err.finish_reason, err.error.status) == (1, True, "abort", 503)
    assert s.done and s.next_delta("i") is None


def test_a_stream_interval_sends_the_first_token_at_once_then_every_k_and_the_last_at_once() -> None:
    s = RequestStream("r", "gw", deadline=0.0, prompt_tokens=4, interval=3)
    s.add(_out([1], 1), None)
    first = s.next_delta("i")
    assert first is not None and first.tokens == [1]  # the time to first token does not wait for the interval
    sent = []
    for t in range(2, 9):
        s.add(_out([t], t, finished=t == 8), None)
        if (delta := s.next_delta("i")) is not None:
            sent.append(delta.tokens[delta.new_from :])
    assert sent == [[2, 3, 4], [5, 6, 7], [8]] and s.done

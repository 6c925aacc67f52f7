"""StopStringFilter: truncation before the stop string, hold-back of possible prefixes, logprob alignment."""

from __future__ import annotations

from kubesgl.openai_api.stop_strings import StopStringFilter


def _stream(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], StopStringFilter[str]]:
    f: StopStringFilter[str] = StopStringFilter(stops)
    shown = [f.push(p).text for p in pieces]
    shown.append(f.flush().text)
    return shown, f


def test_text_is_truncated_before_the_stop_string() -> None:
    shown, f = _stream(("END",), ["hello ", "wor", "ld END more"])
    assert "".join(shown) == "hello world "
    assert f.stopped and f.matched == "END"


def test_a_stop_string_split_across_deltas_is_never_shown_partially() -> None:
    shown, f = _stream(("\n\nUser:",), ["Hi there", "\n", "\nUs", "er:", " never"])
    assert shown[:4] == ["Hi there", "", "", ""]
    assert "".join(shown) == "Hi there" and f.stopped


def test_held_text_is_released_when_it_stops_matching() -> None:
    shown, f = _stream(("abc",), ["xa", "b", "d"])
    assert shown == ["x", "", "abd", ""]
    assert not f.stopped


def test_held_text_is_released_at_the_end() -> None:
    shown, f = _stream(("abc",), ["xyz ab"])
    assert shown == ["xyz ", "ab"]
    assert not f.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    shown, f = _stream(("world", "lo"), ["hello world"])
    assert "".join(shown) == "hel" and f.matched == "lo"


def test_no_stop_strings_releases_everything_at_once() -> None:
    shown, _ = _stream((), ["a", "b"])
    assert shown == ["a", "b", ""]


def test_items_follow_their_text_and_tokens_of_the_stop_string_are_dropped() -> None:
    f: StopStringFilter[str] = StopStringFilter(("STOP",))
    assert f.push("one ", ["t1"]).items == ["t1"]
    held = f.push("ST", ["t2"])
    assert held.text == "" and held.items == []
    out = f.push("OP two", ["t3"])
    assert out.text == "" and out.items == []
    assert f.stopped


def test_items_of_a_delta_partly_before_the_stop_are_kept() -> None:
    f: StopStringFilter[str] = StopStringFilter(("STOP",))
    out = f.push("abSTOPcd", ["t1"])
    assert out.text == "ab" and out.items == ["t1"]


def test_nothing_is_released_after_a_stop() -> None:
    f: StopStringFilter[str] = StopStringFilter(("x",))
    f.push("ax")
    assert f.push("more").text == "" and f.flush().text == ""

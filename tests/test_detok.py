"""Stateless detokenization on the real Qwen3 tokenizer: any split of a token stream into deltas, each decoded
by a fresh "replica", concatenates to exactly tokenizer.decode(all), multi-byte characters and BPE included."""

from __future__ import annotations

import random

import pytest
from kubesgl.text.incremental import delta_text, delta_window
from kubesgl.text.tokenizer import ModelTokenizer

TEXTS = [
    "Hello, world! Tokenizers merge antidisestablishmentarianism into pieces.",
    "你好，世界。今天天气怎么样？我们去公园散步吧。",
    "Emoji 👋🏽👩‍👩‍👧‍👦 and flags 🇺🇳 mixed with ascii.",
    "Ελληνικά, русский, العربية, 日本語のテキスト, 한국어 텍스트.",
    "  leading spaces\n\n\ttabs and newlines\r\n",
]


@pytest.fixture(scope="module")
def replicas(qwen_tokenizer_dir: str) -> list[ModelTokenizer]:
    # Two independently loaded tokenizers stand for two detokenizer replicas.
    return [ModelTokenizer.load(qwen_tokenizer_dir) for _ in range(2)]


def _stream(replicas: list[ModelTokenizer], ids: list[int], cuts: list[int], rng: random.Random) -> str:
    """Sends `ids` as deltas ending at `cuts`, each decoded by a randomly chosen replica, like the bus does."""
    text, sent = "", 0
    for end in [*cuts, len(ids)]:
        tokens, new_from = delta_window(ids[:end], sent)
        tok = rng.choice(replicas)
        text += delta_text(tok.decode, tokens, new_from, finished=end == len(ids))
        sent = end
    return text


def _reference(replicas: list[ModelTokenizer], ids: list[int]) -> str:
    return replicas[0].hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_every_single_delta_boundary_reproduces_the_full_decode(
    replicas: list[ModelTokenizer], text: str
) -> None:
    ids = replicas[0].encode(text)
    rng = random.Random(0)
    for cut in range(1, len(ids)):
        assert _stream(replicas, ids, [cut], rng) == _reference(replicas, ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_per_delta_reproduces_the_full_decode(replicas: list[ModelTokenizer], text: str) -> None:
    ids = replicas[0].encode(text)
    assert _stream(replicas, ids, list(range(1, len(ids))), random.Random(1)) == text


def test_random_partitions_of_random_token_streams(replicas: list[ModelTokenizer]) -> None:
    # A random-weight model emits arbitrary tokens: stray continuation bytes, cut characters, special tokens.
    rng = random.Random(2)
    vocab = replicas[0].vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1))) if len(ids) > 1 else []
        assert _stream(replicas, ids, cuts, rng) == _reference(replicas, ids)


def test_incomplete_character_is_held_back_until_its_bytes_arrive(replicas: list[ModelTokenizer]) -> None:
    tok = replicas[0]
    ids = tok.encode(" 👋")
    assert len(ids) == 2 and tok.token_bytes(ids[0]) == b" \xf0\x9f\x91"
    assert delta_text(tok.decode, ids[:1], 0, finished=False) == " "
    tokens, new_from = delta_window(ids, 1)
    assert delta_text(tok.decode, tokens, new_from, finished=False) == "👋"


def test_unfinished_character_is_flushed_on_the_last_delta(replicas: list[ModelTokenizer]) -> None:
    tok = replicas[0]
    ids = tok.encode(" 👋")[:1]
    assert delta_text(tok.decode, ids, 0, finished=True) == " \ufffd" == _reference(replicas, ids)


def test_logprob_token_text_shows_partial_bytes(replicas: list[ModelTokenizer]) -> None:
    tok = replicas[0]
    first, second = tok.encode(" 👋")
    assert tok.token_text(first) == "bytes:\\x20\\xf0\\x9f\\x91"
    assert tok.token_bytes(first) + tok.token_bytes(second) == " 👋".encode()
    assert tok.token_text(tok.encode(" world")[0]) == " world"


def test_long_run_of_invalid_bytes_is_not_lost_between_deltas(replicas: list[ModelTokenizer]) -> None:
    # Each stray continuation byte decodes to its own U+FFFD; only a trailing unfinished one may be held back.
    tok = replicas[0]
    stray = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\x8b")
    ids = [stray] * 12 + tok.encode(" done")
    for cut in range(1, len(ids)):
        assert _stream(replicas, ids, [cut], random.Random(cut)) == _reference(replicas, ids)
    assert _stream(replicas, ids, list(range(1, len(ids))), random.Random(3)) == "\ufffd" * 12 + " done"

"""Stateless detokenization on the real Qwen3 tokenizer: any split of a token stream into deltas, each decoded
by a fresh "replica", concatenates to exactly tokenizer.decode(all), multi-byte characters and BPE included.
Then the detokenizer service over a real nats-server: TokenDeltaBatches whose entries belong to different
requests and gateways, redelivered batches, and bad entries."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest
from kubesgl import protocol as p
from kubesgl.runtime.nats_server import NatsServer
from kubesgl.runtime.telemetry.metrics import DetokenizerMetrics, new_registry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.detokenizer.service import DetokenizerService
from kubesgl.services.gateway.request_stream import RequestStream as GatewayStream
from kubesgl.services.scheduler.streams import RequestStream
from kubesgl.text.incremental import delta_text, delta_text_of_bytes, delta_window, one_clean_token
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.values.outputs import RequestOutput
from nats.aio.client import Client
from nats.aio.msg import Msg
from support.waiting import wait_until_async

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
    """Sends `ids` as deltas ending at `cuts`, each decoded by a randomly chosen replica, like the bus does, and
    by either way a replica has: its byte table (ModelTokenizer.delta_text) or two decodes."""
    text, sent = "", 0
    for end in [*cuts, len(ids)]:
        tokens, new_from = delta_window(ids[:end], sent)
        tok, finished = rng.choice(replicas), end == len(ids)
        if rng.random() < 0.5:
            text += tok.delta_text(tokens, new_from, finished)
        else:
            text += delta_text(tok.decode, tokens, new_from, finished)
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


# -- the byte table against the tokenizer's own decode ----------------------------------------------------------


def test_the_byte_table_decodes_every_token_as_the_tokenizer_does(replicas: list[ModelTokenizer]) -> None:
    # Every id alone (special and added ones included) and ids past the vocabulary, which decode drops and the
    # table leaves to decode.
    tok = replicas[0]
    table = tok._decode_bytes
    assert table is not None and len(table) == tok.vocab_size
    for i in range(tok.vocab_size + 64):
        assert tok.delta_text([i], 0, finished=True) == tok.decode([i]), i
    assert delta_text_of_bytes(table, [tok.vocab_size], 0, True) is None
    assert delta_text_of_bytes(table, [-1], 0, True) is None


def test_the_byte_table_replaces_invalid_utf8_as_the_tokenizer_does(replicas: list[ModelTokenizer]) -> None:
    # Python's lossy UTF-8 decode against Rust's from_utf8_lossy, on random byte strings made of the 256
    # single-byte tokens: stray continuation bytes, truncated and overlong sequences, surrogates.
    tok = replicas[0]
    table = tok._decode_bytes
    assert table is not None
    byte_token = {table[i][0]: i for i in range(tok.vocab_size) if len(table[i]) == 1}
    assert len(byte_token) == 256
    rng = random.Random(4)
    for _ in range(3000):
        ids = [byte_token[rng.randrange(256)] for _ in range(rng.randint(1, 12))]
        new_from, finished = rng.randint(0, len(ids)), rng.random() < 0.5
        assert tok.delta_text(ids, new_from, finished) == delta_text(tok.decode, ids, new_from, finished), ids


def test_the_byte_table_agrees_with_two_decodes_on_random_windows(replicas: list[ModelTokenizer]) -> None:
    tok = replicas[0]
    rng = random.Random(5)
    specials = list(range(151643, tok.vocab_size))  # Qwen3's added tokens, special or not
    for _ in range(3000):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size) for _ in range(9)
        ]
        new_from, finished = rng.randint(0, len(ids)), rng.random() < 0.5
        assert tok.delta_text(ids, new_from, finished) == delta_text(tok.decode, ids, new_from, finished), ids


def test_one_new_token_after_a_clean_one_takes_its_text_alone(replicas: list[ModelTokenizer]) -> None:
    # Windows of one new token, the kind most deltas are, over every kind of token: whole characters, the 256
    # single-byte ones (stray and partial UTF-8), specials, the token whose text is U+FFFD itself, ids past
    # the vocabulary. Where one_clean_token answers it must be what the windows' two decodes give; where it
    # does not, the byte table's path answers. Both decide the text of most deltas here, so a wrong rule fails.
    tok = replicas[0]
    table, clean = tok._decode_bytes, tok._clean_texts
    assert table is not None and len(clean) == len(table)
    single_bytes = [i for i in range(tok.vocab_size) if len(table[i]) == 1]
    replacement = [i for i in range(tok.vocab_size) if table[i].endswith("\ufffd".encode())]
    assert len(single_bytes) == 256 and replacement and all(clean[i] is None for i in replacement)
    pools = [
        single_bytes,
        replacement,
        list(range(151643, tok.vocab_size)),
        [tok.vocab_size, tok.vocab_size + 3],
    ]
    rng = random.Random(6)
    taken = 0
    for _ in range(6000):
        ids = [
            rng.choice(rng.choice(pools)) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 9))
        ]
        new_from, finished = len(ids) - 1, rng.random() < 0.5
        fast = one_clean_token(clean, ids, new_from)
        expected = delta_text(tok.decode, ids, new_from, finished)
        if fast is not None:
            taken += 1
            assert fast == expected, ids
        assert tok.delta_text(ids, new_from, finished) == expected, ids
    assert 1500 < taken < 5000  # both paths ran
    assert one_clean_token(clean, [5, 6, 7], 1) is None  # two new tokens: the table's path
    assert one_clean_token(clean, [-1], 0) is None and one_clean_token(clean, [-1, 5], 1) is None


def test_a_decoder_other_than_byte_level_gets_no_table() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "##world": 2, "there": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = ModelTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]"))
    assert tok._decode_bytes is None
    assert tok.delta_text([1, 2, 3], 0, finished=True) == tok.decode([1, 2, 3]) == "helloworld there"
    assert tok.delta_text([1, 2, 3], 2, finished=True) == " there"


# -- the detokenizer service: TokenDeltaBatches over a real nats-server ----------------------------------------

INSTANCE = "sched-0"


class Bus:
    """Two detokenizer replicas in the queue group, a sender playing the scheduler, and the inboxes of two
    gateways, all on one real nats-server."""

    def __init__(self, sender: Client, services: list[DetokenizerService]) -> None:
        self.sender = sender
        self.services = services
        self.received: dict[str, list[tuple[str, bytes]]] = {}  # gateway id -> (rid, TextDelta body)

    def inbox(self, gateway_id: str) -> Callable[[Msg], Awaitable[None]]:
        async def on_delta(msg: Msg) -> None:
            for delta in p.gateway_deltas(msg.data):
                self.received.setdefault(gateway_id, []).append((delta.rid, delta.to_bytes()))

        return on_delta

    async def send(self, body: bytes) -> p.BatchAck | p.ErrorReply:
        msg = await self.sender.request(p.DETOK, body, timeout=10)
        return p.decode(msg.data, p.BatchAck, p.ErrorReply)

    async def wait_for(self, n: int) -> None:
        """Until `n` TextDeltas arrived in all (they travel on other connections than the ack)."""
        await wait_until_async(
            lambda: sum(len(v) for v in self.received.values()) >= n,
            f"{n} TextDeltas arrived",
            timeout_s=5.0,
        )


@pytest.fixture
async def bus(nats_server: NatsServer, replicas: list[ModelTokenizer]) -> AsyncIterator[Bus]:
    conns: list[Client] = []
    services = []
    for tok in replicas:
        conns.append(await nats.connect(nats_server.url))
        service = DetokenizerService(conns[-1], tok, DetokenizerMetrics(new_registry()), Tracing("test"))
        await service.start()
        services.append(service)
    sender = await nats.connect(nats_server.url)
    conns.append(sender)
    b = Bus(sender, services)
    for gw in ("gw-a", "gw-b"):
        await sender.subscribe(p.gateway_subject(gw), cb=b.inbox(gw))
    for c in conns:
        await c.flush()
    yield b
    for c in conns:
        await c.close()


def _scheduler_deltas(
    tok: ModelTokenizer, texts: dict[tuple[str, str], str], rng: random.Random
) -> list[list[p.TokenDelta]]:
    """The scheduler's deltas for requests (rid, gateway) generating `texts`, step by step: at each step every
    unfinished request gets 1-3 new tokens and the scheduler's own RequestStream cuts its next delta."""
    ids = {key: tok.encode(text) for key, text in texts.items()}
    streams = {key: RequestStream(key[0], key[1], deadline=0.0, prompt_tokens=3) for key in texts}
    steps: list[list[p.TokenDelta]] = []
    while any(not s.final_sent for s in streams.values()):
        step = []
        for key, stream in streams.items():
            if stream.final_sent:
                continue
            done = len(stream.output_ids)
            new = ids[key][done : done + rng.randint(1, 3)]
            total = done + len(new)
            finished = total == len(ids[key])
            reason = "stop" if finished else None
            stream.add(RequestOutput(key[0], new, 3, 0, total, finished, reason), None)
            step.append(stream.next_delta(INSTANCE))
        steps.append(step)
    return steps


async def _texts_by_rid(bus: Bus) -> dict[str, str]:
    """Each request's text as the gateway assembles it (its real reorder buffer: by seq, duplicates dropped)."""
    gateway: dict[str, GatewayStream] = {}
    for rid, body in (x for v in bus.received.values() for x in v):
        stream = gateway.setdefault(rid, GatewayStream(rid))
        stream.adopt(INSTANCE)
        stream.offer(p.TextDelta.from_bytes(body))
    out = {}
    for rid, stream in gateway.items():
        parts = []
        while (delta := await stream.next(timeout=1.0)) is not None:
            parts.append(delta.text)
            if delta.finished:
                break
        else:
            raise AssertionError(f"{rid} never finished")
        out[rid] = "".join(parts)
    return out


TWO_GATEWAYS = {
    ("a-1", "gw-a"): TEXTS[1],
    ("b-1", "gw-b"): TEXTS[2],
    ("a-2", "gw-a"): TEXTS[0],
    ("b-2", "gw-b"): TEXTS[3],
}


async def test_a_batch_for_requests_on_two_gateways_decodes_each_entry_as_if_alone(bus: Bus) -> None:
    steps = _scheduler_deltas(bus.services[0].tokenizer, TWO_GATEWAYS, random.Random(4))
    for step in steps:
        ((group, body),) = p.TokenDeltaBatch.pack(step, max_bytes=1 << 20)
        assert len(group) == len(step)
        assert await bus.send(body) == p.BatchAck()
    all_deltas = [d for step in steps for d in step]
    await bus.wait_for(len(all_deltas))
    # Every TextDelta went to its own gateway, and is exactly what that TokenDelta decodes to on its own.
    alone = {(d.rid, d.seq): bus.services[1].text_delta(d).to_bytes() for d in all_deltas}
    for gw in ("gw-a", "gw-b"):
        got = [p.TextDelta.from_bytes(body) for _, body in bus.received[gw]]
        assert {d.rid[0] for d in got} == {gw[-1]}
        assert all(alone[(d.rid, d.seq)] == d.to_bytes() for d in got)
    assert len(bus.received["gw-a"]) + len(bus.received["gw-b"]) == len(all_deltas)
    assert await _texts_by_rid(bus) == {rid: text for (rid, _), text in TWO_GATEWAYS.items()}


async def test_a_redelivered_batch_duplicates_no_text(bus: Bus) -> None:
    # A scheduler resends a batch whose ack it never saw (the replica died after publishing, or the ack was
    # lost): any replica decodes it again to the same TextDeltas, which the gateway drops by seq.
    steps = _scheduler_deltas(bus.services[0].tokenizer, TWO_GATEWAYS, random.Random(5))
    sent = 0
    for i, step in enumerate(steps):
        ((_, body),) = p.TokenDeltaBatch.pack(step, max_bytes=1 << 20)
        for _ in range(1 if i % 2 else 3):
            assert await bus.send(body) == p.BatchAck()
            sent += len(step)
    await bus.wait_for(sent)
    bodies: dict[tuple[str, int], set[bytes]] = {}
    for rid, body in (x for v in bus.received.values() for x in v):
        bodies.setdefault((rid, p.TextDelta.from_bytes(body).seq), set()).add(body)
    assert all(len(b) == 1 for b in bodies.values())  # a redelivery is byte-for-byte the same TextDelta
    assert await _texts_by_rid(bus) == {rid: text for (rid, _), text in TWO_GATEWAYS.items()}


async def test_bad_entries_are_refused_alone_and_a_bad_batch_gets_an_error(bus: Bus) -> None:
    good = _scheduler_deltas(bus.services[0].tokenizer, {("a-1", "gw-a"): "hi"}, random.Random(6))[0][0]
    bad_gateway = p.TokenDelta("c-1", "gw.c", INSTANCE, 0, [1], 0)  # would publish to another subject
    entries = [b"\x93not a map", good.to_bytes(), bad_gateway.to_bytes()]
    ack = await bus.send(p.TokenDeltaBatch(entries).to_bytes())
    assert isinstance(ack, p.BatchAck) and sorted(ack.refused) == [0, 2]
    assert "not msgpack" in ack.refused[0] and "invalid subject token" in ack.refused[2]
    await bus.wait_for(1)
    assert [rid for rid, _ in bus.received["gw-a"]] == ["a-1"]
    # A lone TokenDelta (the old body) or garbage: a clear 400, not silence.
    for body, why in [(good.to_bytes(), "expected a TokenDeltaBatch"), (b"\xc1", "not msgpack")]:
        reply = await bus.send(body)
        assert isinstance(reply, p.ErrorReply) and reply.error.status == 400 and why in reply.error.message

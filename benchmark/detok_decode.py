"""The detokenizer's decode per output token, three ways (prints figures, asserts nothing):

- `delta_text`: today's stateless windows (kubesgl.text.incremental; two Rust decodes of <= 9 tokens a delta);
- DecodeStream, stateless: a fresh `tokenizers.decoders.DecodeStream` per delta, fed its context then the new
  token (what the stateless design would need: any replica may decode any delta);
- DecodeStream, stateful: one DecodeStream per request, one `step` per token (needs the request pinned to one
  replica, which the detokenizer's queue group does not do).

Each over the same token ids (the demo model's Qwen3 tokenizer: ASCII, CJK and emoji, so UTF-8 characters split
across tokens), one token per delta, and whether the joined text equals one decode of every id.

    .venv/bin/python benchmark/detok_decode.py [--tokens 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kubesgl.launcher import resolve_model
from kubesgl.text.incremental import delta_text, delta_window
from kubesgl.text.tokenizer import ModelTokenizer
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

TEXT = "Streaming text, 流式输出的文字 🙂🚀 with numbers 3.14159 and naïve café accents. "


def stateless_windows(tok: ModelTokenizer, ids: list[int]) -> list[str]:
    out = []
    for sent in range(len(ids)):
        window, new_from = delta_window(ids[: sent + 1], sent)
        out.append(delta_text(tok.decode, window, new_from, sent == len(ids) - 1))
    return out


def stateless_stream(rust: Tokenizer, ids: list[int]) -> list[str]:
    out = []
    for sent in range(len(ids)):
        window, new_from = delta_window(ids[: sent + 1], sent)
        stream = DecodeStream(skip_special_tokens=True)
        if new_from:
            stream.step(rust, window[:new_from])
        out.append(stream.step(rust, window[new_from:]) or "")
    return out


def stateful_stream(rust: Tokenizer, ids: list[int]) -> list[str]:
    stream = DecodeStream(skip_special_tokens=True)
    return [stream.step(rust, i) or "" for i in ids]


def timed(fn: Callable[[], list[str]], repeats: int) -> tuple[float, list[str]]:
    """Median seconds of `repeats` runs, and the last run's pieces."""
    times, pieces = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        pieces = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tok = ModelTokenizer.load(resolve_model("demo", None)[0])
    rust = tok.hf._tokenizer
    ids: list[int] = []
    while len(ids) < args.tokens:  # whole copies of TEXT: the last token ends a character
        ids += tok.encode(TEXT)
    whole = tok.decode(ids)
    ways = {
        "delta_text (stateless windows, today)": lambda: stateless_windows(tok, ids),
        "DecodeStream per delta (stateless)": lambda: stateless_stream(rust, ids),
        "DecodeStream per request (stateful)": lambda: stateful_stream(rust, ids),
    }
    print(f"{len(ids)} tokens, one per delta; tokenizers' DecodeStream from tokenizers {_version()}")
    for name, fn in ways.items():
        seconds, pieces = timed(fn, args.repeats)
        same = "".join(pieces) == whole
        print(f"  {name:<40} {1e6 * seconds / len(ids):6.2f} us/token  text == decode(all ids): {same}")


def _version() -> str:
    import tokenizers

    return tokenizers.__version__


if __name__ == "__main__":
    main()

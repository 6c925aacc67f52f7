"""Grammar-constrained decoding costs on this machine (CPU): compile time per constraint (cold, then
cached), per-token mask fill (one row, and a batch of rows through xgrammar's batch filler), and applying the
mask to [B, 151936] logits with each backend. Real Qwen3 tokenizer; tokens are walked by a random policy.

    python benchmark/structured_cpu.py [--steps 200] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kubesgl.models.random_init import qwen3_tokenizer_dir  # noqa: E402
from kubesgl.structured.bitmask import allowed_tokens, apply_token_bitmask_  # noqa: E402
from kubesgl.structured.compiler import GrammarCompiler  # noqa: E402
from kubesgl.structured.constraint import Constraint  # noqa: E402
from kubesgl.structured.matcher import GrammarState, TokenBitmask  # noqa: E402
from kubesgl.tool_formats import (
    QWEN25,  # noqa: E402
    tool_choice_constraint,  # noqa: E402
)
from support.grammar_helpers import QWEN3_EOS, QWEN3_VOCAB  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": SCHEMA}} for i in range(4)]


def constraints() -> dict[str, Constraint]:
    return {
        "json_schema (5 fields, nested)": Constraint.json_schema(SCHEMA),
        "json_object": Constraint("json_object"),
        "regex (email)": Constraint("regex", r"[a-z]{3,12}@(example|test)\.(com|org)"),
        "ebnf (arithmetic)": Constraint(
            "ebnf", 'root ::= e\ne ::= t (("+"|"-") t)*\nt ::= f (("*"|"/") f)*\nf ::= [0-9]+ | "(" e ")"'
        ),
        "tool_choice required (4 tools, qwen)": tool_choice_constraint(QWEN25, TOOLS, "required"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    t0 = time.perf_counter()
    compiler = GrammarCompiler.for_tokenizer(tok, QWEN3_VOCAB, QWEN3_EOS)
    print(f"TokenizerInfo + compiler: {time.perf_counter() - t0:.2f} s")
    gen = torch.Generator().manual_seed(0)
    for label, c in constraints().items():
        t0 = time.perf_counter()
        compiled = compiler.compile(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(c)
        warm = time.perf_counter() - t0
        ser = len(compiled.grammar.serialize_json())
        # Walk: at each step fill the mask, pick a random allowed token (stop tokens only when nothing else).
        state, mask, fills = GrammarState(compiled), TokenBitmask(1, QWEN3_VOCAB, torch.device("cpu")), []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            mask.fill([state])
            fills.append(time.perf_counter() - t0)
            allowed = allowed_tokens(mask.upload(1)[0], QWEN3_VOCAB).nonzero().flatten()
            ids = [t for t in allowed.tolist() if t not in QWEN3_EOS] or allowed.tolist()
            state.accept(ids[int(torch.randint(len(ids), (1,), generator=gen))])
            if state.finished:
                state = GrammarState(compiled)
        fill_us = statistics.median(fills) * 1e6
        print(
            f"{label:40s} compile {cold * 1e3:7.1f} ms (cached {warm * 1e6:5.1f} us), "
            f"{compiled.memory_bytes / 1e3:6.0f} kB in memory, {ser / 1e3:6.0f} kB serialized; "
            f"fill {fill_us:6.1f} us/token (median of {args.steps})"
        )
    # A batch: B constrained rows filled together, then masked.
    c = compiler.compile(Constraint.json_schema(SCHEMA))
    states = [GrammarState(c) for _ in range(args.batch)]
    mask = TokenBitmask(args.batch, QWEN3_VOCAB, torch.device("cpu"))
    t0 = time.perf_counter()
    for _ in range(20):
        mask.fill(states)
    print(f"batch fill, {args.batch} rows: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms/step")
    logits = torch.randn(args.batch, QWEN3_VOCAB)
    bm = mask.upload(args.batch)
    for backend in ("cpu", "torch"):
        t0 = time.perf_counter()
        for _ in range(20):
            apply_token_bitmask_(logits, bm, backend=backend)
        print(
            f"apply [{args.batch}, {QWEN3_VOCAB}] fp32, {backend:5s}: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms"
        )
    print(json.dumps(compiler.cache_info().__dict__))


if __name__ == "__main__":
    main()

"""The in-graph temperature sampler (engine/gumbel_sampling.py) by batch size, Qwen3's vocabulary, bf16 logits:
µs per call in a CUDA graph (median of replays), and the tokens checked equal across the implementations given.

    python benchmark/sampling_bench.py                          # today's kernel
    python benchmark/sampling_bench.py --alt old=/path/to/gumbel_sampling.py   # and another version, same process
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import emit, graph_seconds  # noqa: E402

VOCAB = 151936


def load(path: str, name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alt", action="append", default=[], help="label=path of another gumbel_sampling.py")
    p.add_argument("--batch-sizes", default="1,16,64,128,256")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from kubesgl.engine import gumbel_sampling

    impls = {"today": gumbel_sampling}
    for spec in args.alt:
        label, path = spec.split("=", 1)
        impls[label] = load(path, f"gumbel_{label}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for bs in (int(v) for v in args.batch_sizes.split(",")):
        logits = (torch.randn(bs, VOCAB, generator=gen, device="cuda") * 3).to(torch.bfloat16)
        scale = torch.full((bs,), 1 / 0.6, device="cuda")
        scale[0] = -1.0  # one greedy row, as a mixed batch has
        key = torch.tensor([7 << 32], dtype=torch.int64, device="cuda")
        tokens = {label: m.gumbel_tokens(logits, scale, key) for label, m in impls.items()}
        same = all(torch.equal(t, tokens["today"]) for t in tokens.values())
        for label, m in impls.items():
            us = graph_seconds(lambda m=m, lg=logits, sc=scale, k=key: m.gumbel_tokens(lg, sc, k), 1) * 1e6
            emit({"part": "sampling", "impl": label, "bs": bs, "us": us, "same_tokens": same}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

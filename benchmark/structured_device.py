"""On a CUDA device: which token-bitmask kernels work with this torch/Triton (ours: "triton", "torch";
xgrammar's: "xgr-triton", "xgr-cuda" (a CUDA extension built at first use), "xgr-torch_compile"), whether
each can be captured in a CUDA graph, their agreement with the reference, and their time on [B, 151936]
bf16 logits with a quarter of the rows constrained.

    python benchmark/structured_device.py [--batch 64 128 256]
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable

import torch
from kubesgl.structured.bitmask import apply_token_bitmask_

VOCAB = 151936


def _backends() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], object]]:
    import xgrammar as xgr

    def xgr_backend(name: str):  # type: ignore[no-untyped-def]
        return lambda lg, bm, rows: xgr.apply_token_bitmask_inplace(
            lg, bm, indices=None if rows is None else rows, backend=name
        )

    return {
        "triton": lambda lg, bm, rows: apply_token_bitmask_(lg, bm, rows, backend="triton"),
        "torch": lambda lg, bm, rows: apply_token_bitmask_(lg, bm, rows, backend="torch"),
        "xgr-triton": xgr_backend("triton"),
        "xgr-cuda": xgr_backend("cuda"),
        "xgr-torch_compile": xgr_backend("torch_compile"),
    }


def _time(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for b in args.batch:
        g = torch.Generator(device="cuda").manual_seed(b)
        words = (VOCAB + 31) // 32
        mask = torch.randint(-(2**31), 2**31, (b, words), device="cuda", generator=g, dtype=torch.int64).to(
            torch.int32
        )
        mask[b // 4 :] = -1  # three quarters unconstrained
        logits = torch.randn(b, VOCAB, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = apply_token_bitmask_(logits.clone(), mask, backend="torch")
        rows = torch.arange(b // 4, device="cuda")
        for name, fn in _backends().items():
            try:
                out = logits.clone()
                fn(out, mask, None)
                ok = torch.equal(out, ref)
                us = _time(lambda fn=fn, out=out, mask=mask: fn(out, mask, None))
                us_rows = _time(lambda fn=fn, out=out, mask=mask, rows=rows: fn(out, mask, rows))
                static = logits.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn(static, mask, None)
                static.copy_(logits)
                graph.replay()
                graphed = torch.equal(static, ref)
                print(
                    f"B={b:4d} {name:18s} correct={ok} graph={graphed} all rows {us:7.1f} us, {b // 4} rows {us_rows:7.1f} us"
                )
            except Exception as e:  # report and go on: the point is which ones work here
                print(f"B={b:4d} {name:18s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc(limit=1)


if __name__ == "__main__":
    main()

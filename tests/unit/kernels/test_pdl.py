"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that it changes no result.

A PDL kernel may start before the kernel ahead of it has finished; one that read an activation before its
`gdc_wait` would read stale values. The GPU test runs decoder-layer-shaped chains of our Triton kernels
between cuBLAS GEMMs captured in a CUDA graph with PDL on, and asks for the bits of the same chain captured
with plain launches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from kubesgl import env
from kubesgl.attention.triton_kernels import decode_attention
from kubesgl.kernels.activation import silu_and_mul
from kubesgl.kernels.norm import fused_add_rms_norm
from kubesgl.kernels.pdl import pdl_enabled, pdl_kwargs
from kubesgl.kernels.qkv_prep_triton import qkv_prep
from kubesgl.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_is_off_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBESGL_DISABLE_PDL", raising=False)
    assert pdl_kwargs(torch.zeros(1)) == {"USE_PDL": False}


@pytest.mark.parametrize(("value", "off"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_disable_pdl_switch(monkeypatch: pytest.MonkeyPatch, value: str, off: bool) -> None:
    monkeypatch.setenv("KUBESGL_DISABLE_PDL", value)
    assert env.disable_pdl() is off


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="PDL needs sm90+")
def test_gpu_pdl_on_for_hopper_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, device="cuda")
    monkeypatch.delenv("KUBESGL_DISABLE_PDL", raising=False)
    assert pdl_kwargs(x) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("KUBESGL_DISABLE_PDL", "1")
    assert not pdl_enabled(x)


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, CONTEXT, SPLITS = 1024, 16, 8, 128, 3072, 300, 4


def _layer_chain(
    batch: int, layers: int, seed: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> tuple[dict[str, torch.Tensor], Callable[[], torch.Tensor]]:
    """Static inputs and a function running `layers` decoder layers as the engine's decode does (norm, qkv
    GEMM, qkv_prep into the cache, split decode attention + merge, o GEMM, norm, gate_up, SiLU-mul, down)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    ws = [
        {
            "qkv": rand(qkv_width, HIDDEN, scale=HIDDEN**-0.5),
            "o": rand(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
            "gate_up": rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
            "down": rand(HIDDEN, INTER, scale=INTER**-0.5),
            "norm": 1 + rand(HIDDEN, scale=0.1),
            "qn": 1 + rand(HEAD_DIM, scale=0.1),
            "kn": 1 + rand(HEAD_DIM, scale=0.1),
        }
        for _ in range(layers)
    ]
    rope = RotaryEmbedding(HEAD_DIM, 4096, 1e6).to(device)
    slots = batch * CONTEXT
    static = {
        "hidden": rand(batch, HIDDEN),
        "residual": rand(batch, HIDDEN),
        "positions": torch.full((batch,), CONTEXT - 1, device=device, dtype=torch.int64),
        "out_loc": torch.arange(batch, device=device) * CONTEXT + CONTEXT - 1,
        "k_cache": rand(layers, slots, 1, KV_HEADS, HEAD_DIM),  # page size 1
        "v_cache": rand(layers, slots, 1, KV_HEADS, HEAD_DIM),
    }
    page_table = torch.arange(slots, device=device, dtype=torch.int32).view(batch, CONTEXT)
    seq_lens = torch.full((batch,), CONTEXT, device=device, dtype=torch.int32)
    part_out = torch.empty(batch, HEADS, SPLITS, HEAD_DIM, device=device)
    part_lse = torch.empty(batch, HEADS, SPLITS, device=device)

    def run() -> torch.Tensor:
        h, r = static["hidden"], static["residual"]
        for i, w in enumerate(ws):
            normed, r = fused_add_rms_norm(h, r, w["norm"], 1e-6)
            k_layer, v_layer = static["k_cache"][i], static["v_cache"][i]
            q = qkv_prep(
                F.linear(normed, w["qkv"]),
                static["positions"],
                static["out_loc"],
                rope.cos,
                rope.sin,
                w["qn"],
                w["kn"],
                1e-6,
                k_layer.view(-1, KV_HEADS, HEAD_DIM),
                v_layer.view(-1, KV_HEADS, HEAD_DIM),
                HEADS,
                KV_HEADS,
            )
            attn = decode_attention(
                q,
                k_layer,
                v_layer,
                page_table,
                seq_lens,
                torch.empty_like(q),
                HEAD_DIM**-0.5,
                part_out,
                part_lse,
            )
            normed, r = fused_add_rms_norm(F.linear(attn.view(batch, -1), w["o"]), r, w["norm"], 1e-6)
            h = F.linear(silu_and_mul(F.linear(normed, w["gate_up"])), w["down"])
        return torch.cat([h, r], dim=-1)

    return static, run


def _capture(run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles this launch mode's kernel variants outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="PDL needs sm90+")
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_pdl_graph_replay_equals_plain_launches(monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """The same chain captured twice, our kernels launched plainly and with PDL (cuBLAS alike in both): every
    replay from the same inputs gives the same bits, outputs and KV cache."""
    static, run = _layer_chain(batch, layers=4, seed=batch)
    first = {k: v.clone() for k, v in static.items()}
    results = {}
    for mode in ("plain", "pdl"):
        monkeypatch.setenv("KUBESGL_DISABLE_PDL", "1" if mode == "plain" else "0")
        assert pdl_enabled(static["hidden"]) is (mode == "pdl")
        graph, out = _capture(run)
        for _ in range(3):  # each replay starts from the same inputs (the caches get the same new K/V again)
            for k, v in first.items():
                static[k].copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            results.setdefault(mode, (out.clone(), static["k_cache"].clone()))
            assert torch.equal(out, results[mode][0]) and torch.equal(static["k_cache"], results[mode][1])
    assert torch.equal(results["pdl"][0], results["plain"][0])
    assert torch.equal(results["pdl"][1], results["plain"][1])

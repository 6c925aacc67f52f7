"""The L2 prefetch after a decode step's attention (kernels/l2_prefetch.py): where it runs, what it prefetches, and
that it changes no result (a hint: the GPU test asks for the same bits with it as without, in a CUDA graph).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kubesgl import env
from kubesgl.distributed import TPGroup
from kubesgl.kernels.l2_prefetch import prefetch_applies, prefetch_l2
from kubesgl.models.decoder import DenseMLP
from kubesgl.models.loader import load_model
from kubesgl.models.random_init import build_random_model

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_switch(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("KUBESGL_L2_PREFETCH", value)
    assert env.l2_prefetch() is on


def test_never_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBESGL_L2_PREFETCH", "1")
    assert not prefetch_applies(torch.zeros(2, 4))


@pytest.mark.parametrize("count", [0, 5])
def test_takes_one_to_four_tensors(count: int) -> None:
    with pytest.raises(ValueError, match="1-4 contiguous CUDA tensors"):
        prefetch_l2([torch.zeros(4)] * count)


def test_rejects_cpu_and_strided_tensors() -> None:
    with pytest.raises(ValueError, match="contiguous CUDA"):
        prefetch_l2([torch.zeros(4)])
    if CUDA:
        with pytest.raises(ValueError, match="contiguous CUDA"):
            prefetch_l2([torch.zeros(4, 4, device="cuda").t()])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_each_layer_prefetches_what_runs_before_the_next_attention(tmp_path: Path, arch: str) -> None:
    """o, a dense MLP's gate_up and down, then the next layer's qkv; the last layer has no next qkv; and the
    references add no parameters (the state dict is the checkpoint's)."""
    path = build_random_model(arch, tmp_path, overrides={"num_hidden_layers": 3})
    model = load_model(path, tp=TPGroup())
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        expected = [attn.o_proj.weight]
        if isinstance(mlp, DenseMLP):
            expected += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
        if i + 1 < len(layers):
            expected.append(layers[i + 1].self_attn.qkv_proj.weight)
        got = attn.prefetch_weights()
        assert len(got) == len(expected) and all(g is e for g, e in zip(got, expected, strict=True))
    assert (arch == "qwen3") == isinstance(layers[0].mlp, DenseMLP)
    names = set(model.state_dict())
    assert not any("prefetch" in n for n in names)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_prefetch_changes_no_bits_in_a_graph() -> None:
    """A GEMM chain with the prefetch between its GEMMs (1-4 tensors, byte sizes not whole lines), captured in a
    CUDA graph behind the kernel that writes its input, against the same chain without: the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [
        torch.randn(n, 1000, generator=gen, device="cuda").to(torch.bfloat16) / 32 for n in (1000, 1024, 1003)
    ]
    x = torch.randn(64, 1000, generator=gen, device="cuda").to(torch.bfloat16)
    src = x.clone()

    def chain(prefetch: bool) -> torch.Tensor:
        h = x.copy_(src * 1.5)
        for i, w in enumerate(ws):
            if prefetch:
                prefetch_l2(ws[: i + 1] + [x])
            h = F.linear(h[:, :1000], w)
        return h

    outs = []
    for prefetch in (False, True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain(prefetch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(prefetch)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1])

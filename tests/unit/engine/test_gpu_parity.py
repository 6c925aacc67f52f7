"""GPU correctness in bf16 (run on the device; skipped without CUDA): teacher-forced logits against HF
transformers for each attention backend, and greedy agreement of the full engine (CUDA graphs + overlap on).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.attention.errors import BackendUnavailableError
from kubesgl.attention.registry import create_backend
from kubesgl.distributed import TPGroup
from kubesgl.kernels.gemv import skinny_config
from kubesgl.models.loader import load_model
from kubesgl.models.random_init import build_random_model
from support.engine_helpers import assert_greedy_match, hf_greedy, hf_top_logits
from support.model_helpers import SingleRequestRunner
from support.numerics import bf16_tie

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    overrides = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,  # the Qwen3 head size: the FlashInfer kernels JIT-built for the benchmark serve here too
        "num_hidden_layers": 4,
    }
    return str(
        build_random_model(
            "qwen3",
            tmp_path_factory.mktemp("gpu") / "qwen3",
            init_std=0.5,
            overrides=overrides,
            dtype=torch.bfloat16,
        )
    )


@pytest.fixture(scope="module")
def hf(checkpoint: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-planned", "flashinfer"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_teacher_forced_logits_close_to_hf(
    checkpoint: str, hf: torch.nn.Module, backend: str, page_size: int
) -> None:
    """Per attention backend: a 100-token prefill, then teacher-forced decode steps."""
    model = load_model(checkpoint, tp=TPGroup(), device=torch.device("cuda"), dtype=torch.bfloat16)
    runner = SingleRequestRunner(model, page_size, max_tokens=256)
    try:
        runner.attn = create_backend(
            backend,
            device=torch.device("cuda"),
            page_size=page_size,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
        )
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    tokens = [random.Random(0).randrange(500) for _ in range(120)]
    ours = [runner.step(tokens[:100])]  # a prefill, then teacher-forced decode steps
    ours += [runner.step([t]) for t in tokens[100:]]
    ours_all = torch.cat(ours).float()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens], device="cuda")).logits[0].float()
    scale = ref.abs().max()
    assert (ours_all - ref).abs().max() < 0.05 * scale
    gaps = ref.topk(2, dim=-1).values
    ties = torch.tensor([bf16_tie(z) for z in ref.abs().max(dim=-1).values.tolist()], device=ref.device)
    clear = (gaps[:, 0] - gaps[:, 1]) > ties
    assert torch.equal(ours_all.argmax(-1)[clear], ref.argmax(-1)[clear])


def mid_batch_table(tmp_path: Path) -> Path:
    """A mid-batch GEMM table for this model's shapes (the built-in one is keyed by Qwen3-0.6B's): every projection
    at every rows bucket, qkv with its prep and gate_up with its SiLU·mul each one kernel."""
    configs = {}
    for bucket in (8, 16, 32, 64, 128, 256):
        bm = min(max(bucket, 16), 64)
        configs[f"1536,256,prep,{bucket}"] = f"m{bm}n64k64s2w4p4"
        configs[f"512,256,silu,{bucket}"] = f"m{bm}n32k64s2w4p4"
        configs[f"256,1024,linear,{bucket}"] = f"m{bm}n32k64s4w4p4"
        configs[f"256,512,linear,{bucket}"] = f"m{bm}n32k64s2w4p4"
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"configs": configs}))
    return path


@pytest.mark.parametrize(
    ("attn", "mid_batch"),
    [("auto", False), ("triton-planned", False), ("auto", True)],
    ids=["defaults", "triton-planned", "mid-batch-gemm-and-prep"],
)
def test_engine_greedy_matches_hf_with_graphs_and_overlap(
    checkpoint: str,
    hf: torch.nn.Module,
    attn: str,
    mid_batch: bool,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    if mid_batch:  # kernels/gemm_triton.py on every projection, in the engine's CUDA graphs with overlap
        monkeypatch.setenv("KUBESGL_SKINNY_CONFIGS", str(mid_batch_table(tmp_path)))
        qkv = torch.zeros(1536, 256, device="cuda", dtype=torch.bfloat16)
        x = torch.zeros(12, 256, device="cuda", dtype=torch.bfloat16)
        assert skinny_config(x, qkv, op="prep") is not None
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(5, 60))] for _ in range(12)]
    with LLM(checkpoint, device="cuda", dtype="bfloat16", page_size=16, attn=attn) as llm:
        assert llm.engine.overlap and llm.engine.runner.graphs is not None
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        ref, gaps = hf_greedy(hf, p, 16)
        ties = [bf16_tie(z) for z in hf_top_logits(hf, p, ref)]
        assert_greedy_match(out["token_ids"], ref, gaps, tie=ties)

"""--enable-torch-compile: decode steps run the forward compiled by Inductor (engine/compile.py), with each
layer's attention block and the MoE experts as opaque custom ops (layers/opaque.py).

On CPU (Inductor's C++ backend) greedy outputs of a float32 random-weight model are token for token those of
the eager engine, the decode steps really went through the compiled callable in one graph per batch size, and
Inductor's cache landed in the configured directory (so a restart reuses it). On CUDA the same callable is
what the decode CUDA graphs capture (benchmark/device_run.sh compile25).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.engine.config import EngineConfig
from kubesgl.errors import InvalidRequestError
from kubesgl.models.random_init import build_random_model
from kubesgl.values.sampling import LogprobOptions
from support.engine_helpers import assert_greedy_match
from support.numerics import logits_tolerance
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

needs_cxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="Inductor's CPU backend needs a C++ compiler"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture
def inductor_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Our cache variable set, Inductor's own at torch's default (which counts as unset); Dynamo reset after."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("KUBESGL_TORCH_COMPILE_CACHE", str(cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    yield cache
    torch._dynamo.reset()


@needs_cxx
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_compiled_decode_is_token_identical_to_eager(arch: str, tmp_path: Path, inductor_cache: Path) -> None:
    model = str(build_random_model(arch, tmp_path / arch, init_std=0.5, seed=3))
    params = SamplingParams(max_tokens=10, temperature=0.0)
    eager = LLM(model, device="cpu").generate(PROMPTS, params)
    llm = LLM(model, device="cpu", enable_torch_compile=True, torch_compile_max_bs=4)
    compiled = llm.generate(PROMPTS, params)
    assert [o["token_ids"] for o in compiled] == [o["token_ids"] for o in eager]
    runner = llm.engine.runner
    assert runner.compiled is not None
    # Every decode step had all three rows (equal max_tokens): one compile, for bs 3; fullgraph=True means the
    # opaque ops left no graph break.
    assert runner.compiled.compiled_for == {3}
    assert runner.compiled.compile_seconds > 0
    assert runner.compiled.cache_dir == str(inductor_cache)
    assert any(inductor_cache.iterdir())


@needs_cxx
def test_a_dynamic_batch_dimension_compiles_once_above_bs_1(
    tmp_path: Path, inductor_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four requests of different lengths with max bs 3: the 4-row steps stay eager, the 3- and 2-row steps share
    one compile (the batch dimension dynamic), the 1-row steps have their own (Dynamo specialises a size of 1)."""
    monkeypatch.setenv("KUBESGL_TORCH_COMPILE_DYNAMIC", "1")
    model = str(build_random_model("qwen3", tmp_path / "q", init_std=0.5, seed=4))
    prompts = [*PROMPTS, [3, 4]]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (4, 6, 8, 10)]
    eager = LLM(model, device="cpu").generate(prompts, params)
    llm = LLM(model, device="cpu", enable_torch_compile=True, torch_compile_max_bs=3)
    compiled = llm.generate(prompts, params)
    assert [o["token_ids"] for o in compiled] == [o["token_ids"] for o in eager]
    assert llm.engine.runner.compiled is not None and llm.engine.runner.compiled.compiled_for == {1, 2}


def test_torch_compile_with_tensor_parallelism_is_refused() -> None:
    config = EngineConfig(model_path="unused", enable_torch_compile=True, tp_size=2)
    with pytest.raises(InvalidRequestError, match="enable_torch_compile needs tp_size 1"):
        config.validate()
    with pytest.raises(InvalidRequestError, match="torch_compile_max_bs"):
        EngineConfig(model_path="unused", torch_compile_max_bs=0).validate()


@pytest.mark.gpu
@needs_cuda
def test_graphs_capturing_the_compiled_forward_match_an_eager_engine(
    tmp_path: Path, inductor_cache: Path
) -> None:
    """float32 Triton attention: decode graphs up to bs 16, those up to bs 8 capturing the compiled forward,
    larger batches eager, against graphs, compile and overlap all off, up to a near-tie in the logits."""
    overrides = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
    model = str(build_random_model("qwen3", tmp_path / "q", overrides=overrides, init_std=0.5, seed=5))
    rng = random.Random(7)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(3, 40))] for _ in range(20)]
    n_new = 24
    cfg = dict(
        device="cuda", dtype="float32", attn="triton", page_size=16, num_pages=512, max_running_requests=32
    )

    def generate(params: SamplingParams, **config: object) -> tuple[list[dict], LLM]:
        # Lengths differ, so the batch shrinks through the eager, graph and compiled-graph sizes.
        plist = [SamplingParams(**{**params.__dict__, "max_tokens": n_new - i}) for i in range(len(prompts))]
        llm = LLM(model, **{**cfg, **config})
        return llm.generate(prompts, plist), llm

    ref_params = SamplingParams(
        max_tokens=n_new, temperature=0, ignore_eos=True, logprobs=LogprobOptions(top=2)
    )
    ref, ref_llm = generate(ref_params, cuda_graph_max_bs=0, disable_overlap=True)
    ref_llm.shutdown()
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    ours, llm = generate(params, cuda_graph_max_bs=16, enable_torch_compile=True, torch_compile_max_bs=8)
    compiled = llm.engine.runner.compiled
    assert compiled is not None and compiled.compiled_for == {1, 2, 4, 8}  # the graph sizes it accepts
    llm.shutdown()
    tie = 2 * logits_tolerance(model, context=max(map(len, prompts)) + n_new)
    for o, r in zip(ours, ref, strict=True):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in r["logprobs"]]
        assert_greedy_match(o["token_ids"], r["token_ids"], gaps, tie)

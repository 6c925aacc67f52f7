"""`--enable-torch-compile`: the model's forward pass compiled by Inductor for decode batches of at most
`--torch-compile-max-bs` rows (SGLang's flags), the callable the decode CUDA graphs capture.

What is compiled is everything between the attention blocks: embedding, the residual adds and RMSNorms, the
q/k/v, o, gate/up and down projections, SiLU·mul, the final norm. Inductor fuses the element-wise work into
the neighbouring kernels, which cuts the kernel boundaries of a decode step (docs/performance.md). Each
layer's attention block and the MoE experts are opaque custom ops (`layers.opaque`), so the attention backends
and our Triton kernels run unchanged between the compiled pieces; with them opaque the whole forward is one
graph (fullgraph=True), no break.

Each batch size gets its own static compile (dynamic=False: the kernels are specialised to the shape, as the
captured graphs are), unless KUBESGL_TORCH_COMPILE_DYNAMIC asks for one compile with the batch dimension
dynamic. Inductor's cache goes to `env.torch_compile_cache_dir()`, so a restart reuses the compiled kernels.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from kubesgl import env
from kubesgl.layers import opaque
from kubesgl.layers.forward import ForwardBatch
from kubesgl.models.decoder import CausalLM

log = logging.getLogger(__name__)


def use_cache_dir() -> str:
    """Points Inductor's cache (and the Triton kernels it builds) at our cache directory unless the
    environment names another; returns the directory in use. (Torch writes its own default into the
    variable the first time it asks for the directory, so that default counts as unset.)"""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or given == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(env.torch_compile_cache_dir())
    path = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    os.makedirs(path, exist_ok=True)
    return path


class CompiledForward:
    """`model.forward` compiled for decode batches of 1..max_bs rows; call it like model.forward.

    compile_seconds adds up the first call of each new compile (the trace and Inductor's codegen, or its
    cache load, plus one run of the step)."""

    def __init__(
        self, model: CausalLM, max_bs: int, *, dynamic: bool = False, backend: str = "inductor"
    ) -> None:
        self.max_bs = max_bs
        self.dynamic = dynamic
        self.backend = backend
        self.cache_dir = use_cache_dir()
        # One compile per batch size in the static mode: Dynamo must not give up on the code after its default
        # handful of recompiles and fall back to eager.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, max_bs + 2)
        self.blocks = [layer.self_attn for layer in model.model.layers]
        self._compiled = torch.compile(
            model.forward, fullgraph=True, dynamic=None if dynamic else False, backend=backend
        )
        self.compiled_for: set[int] = set()  # batch sizes with a compile of their own (bs 1 always is)
        self.compile_seconds = 0.0

    def accepts(self, bs: int) -> bool:
        return bs <= self.max_bs

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.num_tokens
        if not self.accepts(bs):
            raise ValueError(f"batch of {bs} rows is above --torch-compile-max-bs {self.max_bs}")
        # Dynamic: one compile for every bs >= 2 (Dynamo specialises a size of 1, so bs 1 has its own).
        key = bs if not self.dynamic or bs == 1 else 2
        if self.dynamic and bs > 1:
            torch._dynamo.mark_dynamic(fb.input_ids, 0)
            torch._dynamo.mark_dynamic(fb.positions, 0)
        first = key not in self.compiled_for
        start = time.perf_counter()
        with opaque.forward_context(fb, self.blocks):
            out = self._compiled(fb)
        if first:
            seconds = time.perf_counter() - start
            self.compiled_for.add(key)
            self.compile_seconds += seconds
            log.info("torch.compile (%s) of the forward for bs %d: %.1f s", self.backend, bs, seconds)
        return out


def compile_figures(compiled: CompiledForward | None) -> dict[str, object]:
    """What a benchmark reports of the compile: on or off, its mode and batch limit, and its seconds."""
    if compiled is None:
        return {"torch_compile": False}
    return {
        "torch_compile": True,
        "torch_compile_max_bs": compiled.max_bs,
        "torch_compile_dynamic": compiled.dynamic,
        "torch_compile_compiles": len(compiled.compiled_for),
        "torch_compile_s": round(compiled.compile_seconds, 2),
    }

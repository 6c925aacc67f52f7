"""Engine configuration: one flat, composable dataclass (flag names follow Mini-SGLang)."""

from __future__ import annotations

from dataclasses import dataclass

from kubesgl.errors import InvalidRequestError


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str = "auto"  # "auto" (from config.json) | "float32" | "bfloat16" | "float16"
    tp_size: int = 1
    page_size: int = 1
    cache: str = "radix"  # "radix" | "naive"
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # chunked-prefill budget per step (--max-prefill-length)
    num_pages: int | None = None  # overrides the memory estimate
    memory_ratio: float = 0.9  # share of device memory for weights + KV (GPU)
    cpu_kv_bytes: int = 512 << 20  # KV budget on the CPU when num_pages is not given
    max_seq_len_override: int | None = None
    attn: str = "auto"  # "torch" | "triton" | "flashinfer" | "fa3" | "prefill,decode" | "auto"
    cuda_graph_max_bs: int | None = None  # None = auto, 0 = off
    # SGLang's --piecewise-cuda-graph-max-tokens: extend steps of at most this many tokens replay piecewise CUDA
    # graphs (engine/piecewise_graph.py; the forward captured between its attention kernels, per token bucket).
    # 0 = off (every extend step eager); None = auto (max_prefill_tokens up to 8192, on a GPU, dense models:
    # piecewise_graph.auto_max_tokens; a value also takes mixture-of-experts models).
    piecewise_cuda_graph_max_tokens: int | None = None
    disable_overlap: bool = False
    # SGLang's --enable-torch-compile / --torch-compile-max-bs: decode batches of at most that many rows run the
    # forward compiled by Inductor (engine/compile.py), inside the decode CUDA graphs on a GPU.
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # SGLang's --enable-mixed-chunk: a prefill step also carries the decode batch (one token per request, counted
    # against max_prefill_tokens), so decoding requests advance while prompts are prefilled. The step is eager:
    # its decode rows leave the decode CUDA graph and attend through the prefill backend.
    enable_mixed_chunk: bool = False
    dummy_weight: bool = False
    seed: int = 0  # engine RNG for requests without a seed
    dist_port: int = 0  # torch.distributed rendezvous port for tp_size > 1 (0 = pick a free one)
    # Multi-node TP (SGLang's --nnodes/--node-rank/--dist-init-addr): tp_size ranks over nnodes nodes, tp_size //
    # nnodes per node; node 0 runs rank 0 (the engine) and meets the others at dist_init_addr ("host:port").
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""
    kv_event_block_size: int = 0  # > 0: record prefix-cache KV events in blocks of this many tokens (routing)
    default_max_tokens: int | None = (
        None  # most tokens of a request without max_tokens (None: to the context end)
    )
    bound_json_values: bool = False  # bound schemas' open values (structured.bounds): the demo model

    def validate(self) -> None:
        """Raises InvalidRequestError for a setting no engine can start with (the rank layout:
        engine.distributed.check_ranks)."""
        checks = [
            (self.tp_size >= 1, "tp_size must be >= 1"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.cache in ("radix", "naive"), f"cache must be 'radix' or 'naive', got {self.cache!r}"),
            (self.max_running_requests >= 1, "max_running_requests must be >= 1"),
            (self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
            (self.device in ("cpu", "cuda"), f"device must be 'cpu' or 'cuda', got {self.device!r}"),
            (self.num_pages is None or self.num_pages >= 1, "num_pages must be >= 1"),
            (self.torch_compile_max_bs >= 1, "torch_compile_max_bs must be >= 1"),
            (
                self.piecewise_cuda_graph_max_tokens is None or self.piecewise_cuda_graph_max_tokens >= 0,
                "piecewise_cuda_graph_max_tokens must be >= 0",
            ),
            (
                not self.enable_torch_compile or self.tp_size == 1,
                "enable_torch_compile needs tp_size 1 (the compiled forward has no collectives)",
            ),
            (
                self.default_max_tokens is None or self.default_max_tokens >= 1,
                "default_max_tokens must be >= 1",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise InvalidRequestError(why)

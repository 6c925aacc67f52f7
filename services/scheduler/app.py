"""`kubesgl scheduler`: flags and process entry of one scheduler instance (rank 0; TP ranks are spawned by
the Engine), or, with --node-rank > 0, of one more node's TP ranks of a multi-node instance."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.distributed import local_ranks, run_node_ranks
from kubesgl.engine.engine import Engine
from kubesgl.engine.scheduler.disagg import DisaggregationMode
from kubesgl.runtime.bus_service import add_service_arguments, run_bus_service
from kubesgl.runtime.lifecycle import configure_logging
from kubesgl.runtime.telemetry.metrics import DisaggregationMetrics, SchedulerMetrics, new_registry
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.runtime.telemetry.stats_log import StatsLog
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.scheduler.engine_loop import EngineLoop
from kubesgl.services.scheduler.engine_process import EngineProcess
from kubesgl.services.scheduler.pd import PdHook
from kubesgl.services.scheduler.service import DETOK_BATCH_SIZE, SchedulerService
from kubesgl.values.outputs import ModelInfo
from nats.aio.client import Client

_DEFAULTS = EngineConfig(model_path="")
log = logging.getLogger("kubesgl.scheduler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: dir name)")
    parser.add_argument("--instance-id", default=None, help="this instance's id (default: the pod hostname)")
    parser.add_argument("--tp", type=int, default=d.tp_size, help="tensor-parallel ranks (one per GPU)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    parser.add_argument("--cache", default=d.cache, choices=["radix", "naive"], help="prefix cache")
    parser.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="admitted requests waiting beyond the running ones; more are refused with 503",
    )
    parser.add_argument(
        "--max-prefill-length", type=int, default=d.max_prefill_tokens, help="chunked-prefill tokens per step"
    )
    parser.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages (default: from memory)")
    parser.add_argument("--memory-ratio", type=float, default=d.memory_ratio, help="GPU memory share to use")
    parser.add_argument("--context-length", type=int, default=d.max_seq_len_override, help="cap the context")
    parser.add_argument("--attn", default=d.attn, help="attention backend: torch|triton|flashinfer|fa3|auto")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs, help="0 disables")
    parser.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=d.piecewise_cuda_graph_max_tokens,
        help="extend steps of at most this many tokens replay piecewise CUDA graphs (default: the prefill chunk, at most 8192; "
        "0 disables)",
    )
    parser.add_argument("--disable-overlap", action="store_true", help="no overlap scheduling")
    parser.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="decode batches up to --torch-compile-max-bs run the forward compiled by Inductor, inside the "
        "decode CUDA graphs (SGLang's flag; the compile is cached in $KUBESGL_TORCH_COMPILE_CACHE)",
    )
    parser.add_argument(
        "--torch-compile-max-bs", type=_positive_int, default=d.torch_compile_max_bs, help="see above"
    )
    parser.add_argument(
        "--gil-switch-interval-ms",
        type=_positive_float,
        default=None,
        help="Python's thread switch interval (sys.setswitchinterval; default Python's 5 ms) of this process: with "
        "--no-engine-process, how long the engine thread may wait for the GIL while the bus thread runs Python code",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in a process of its own, the NATS bus work in this one (no GIL shared between "
        "them); --no-engine-process runs both in one process, the engine on a thread (for debugging)",
    )
    parser.add_argument(
        "--disaggregation-mode",
        choices=[m.value for m in DisaggregationMode],
        default=DisaggregationMode.BOTH.value,
        help="prefill/decode disaggregation role (SGLang's flag): prefill computes prompts for decode "
        "instances, decode owns the streams; both (default) serves whole requests. Advertised in heartbeats",
    )
    parser.add_argument(
        "--disaggregation-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a decode instance waits for a prompt's prefill, or its KV pull, before prefilling it "
        "itself (a prefill instance unlocks a handoff's pages after as long); a prefill instance that stops "
        "heartbeating is given up on sooner, after the heartbeat expiry",
    )
    parser.add_argument(
        "--enable-mixed-chunk",
        action=argparse.BooleanOptionalAction,
        default=d.enable_mixed_chunk,
        help="prefill steps also carry the decode batch (SGLang's flag; decode rows count against "
        "--max-prefill-length)",
    )
    parser.add_argument(
        "--dummy-weight",
        action="store_true",
        help="random weights on the model's config, no checkpoint read (benchmarks: kubesgl bench serve)",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="sampling seed for unseeded requests")
    parser.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=d.default_max_tokens,
        help="most tokens a request without max_tokens generates (default: until the context ends, as OpenAI)",
    )
    parser.add_argument(
        "--bound-json-values",
        action="store_true",
        help="bound the open strings, numbers, arrays and objects of every JSON schema, JSON mode and tool "
        "call grammar (for a model that never closes them: `kubesgl up` sets it for the demo model)",
    )
    parser.add_argument(
        "--detok-timeout",
        type=float,
        default=1.0,
        help="seconds before an unacked TokenDeltaBatch is sent again",
    )
    parser.add_argument(
        "--detok-batch-size",
        type=_positive_int,
        default=DETOK_BATCH_SIZE,
        help="most requests' deltas in one TokenDeltaBatch; a step with more running requests sends several "
        "at once, which the detokenizer replicas decode in parallel (128 take one ~2 ms on an H100 host, "
        "under a decode step; 256 running requests are one batch for each of the chart's two replicas)",
    )
    parser.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="a request's tokens go out every this many (SGLang's flag): its first token and its last at once, "
        "the others in deltas of at least this many; 1 = every engine step's tokens as they come",
    )
    parser.add_argument(
        "--kv-event-block-size",
        type=_non_negative_int,
        default=16,
        help="tokens per block in the prefix-cache KV events routers use (same on every instance and "
        "tokenizer; 0 = publish none; radix cache only)",
    )
    parser.add_argument(
        "--stats-log-interval",
        type=float,
        default=10.0,
        help="seconds between the one-line stats log (running, queued, token usage, cache hit rate, gen "
        "tok/s) while busy; silent while idle; 0 = off",
    )
    # Multi-node tensor parallelism, SGLang's flags: node 0 runs rank 0 (and serves NATS); the others run only
    # their ranks, executing rank 0's plans (gloo carries control, NCCL tensors on GPU).
    parser.add_argument("--nnodes", type=_positive_int, default=d.nnodes, help="nodes the TP ranks span")
    parser.add_argument("--node-rank", type=_non_negative_int, default=d.node_rank, help="this node's index")
    parser.add_argument(
        "--dist-init-addr",
        default=d.dist_init_addr,
        help="host:port of node 0's torch.distributed rendezvous (required with --nnodes > 1)",
    )
    add_service_arguments(parser, drain_timeout_s=30.0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model_path=args.model,
        device=device,
        dtype=args.dtype,
        tp_size=args.tp,
        page_size=args.page_size,
        cache=args.cache,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_length,
        num_pages=args.num_pages,
        memory_ratio=args.memory_ratio,
        max_seq_len_override=args.context_length,
        attn=args.attn,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        disable_overlap=args.disable_overlap,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs,
        enable_mixed_chunk=args.enable_mixed_chunk,
        dummy_weight=args.dummy_weight,
        seed=args.seed,
        default_max_tokens=args.default_max_tokens,
        bound_json_values=args.bound_json_values,
        kv_event_block_size=args.kv_event_block_size if args.cache == "radix" else 0,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
    )


def run_worker_node(config: EngineConfig, log_level: str) -> int:
    """Node 1..nnodes-1: no NATS, no admin port; its ranks run until rank 0 ends the group. SIGTERM is only
    logged: the pods of a group stop together, and these ranks must keep executing while rank 0 drains its
    requests (Kubernetes kills them after the grace period)."""
    configure_logging(log_level)
    signal.signal(
        signal.SIGTERM,
        lambda *_: log.info("SIGTERM: node %d keeps its ranks until rank 0 shuts down", config.node_rank),
    )
    log.info(
        "node %d/%d: ranks %s of %d, rendezvous at %s",
        config.node_rank,
        config.nnodes,
        list(local_ranks(config)),
        config.tp_size,
        config.dist_init_addr,
    )
    return run_node_ranks(config)


def main(args: argparse.Namespace) -> int:
    config = engine_config(args)
    if args.gil_switch_interval_ms is not None:
        sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
    if config.node_rank > 0:
        return run_worker_node(config, args.log_level)
    instance_id = args.instance_id or socket.gethostname()
    model = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    registry = new_registry()
    tracing = Tracing("kubesgl-scheduler")

    def make_telemetry(info: ModelInfo) -> SchedulerTelemetry:
        metrics = SchedulerMetrics(
            registry,
            model,
            info.page_size,
            info.num_pages,
            startup_s=info.startup_s,
            load_weights_s=info.load_weights_s,
        )
        stats_log = StatsLog(args.stats_log_interval, info.page_size)
        return SchedulerTelemetry(metrics, tracing, instance_id, model, stats_log=stats_log)

    make_engine = functools.partial(Engine, config)  # picklable: the engine process builds it

    async def build(nc: Client, stop: asyncio.Event) -> SchedulerService:
        mode = DisaggregationMode(args.disaggregation_mode)
        pd = None
        if mode is not DisaggregationMode.BOTH:
            pd = PdHook(nc, instance_id, mode, args.disaggregation_timeout, DisaggregationMetrics(registry))

        def make_loop(service: SchedulerService) -> EngineLoop | EngineProcess:
            callbacks = (
                service.engine_loaded,
                service.engine_outputs,
                service.engine_failed,
                service.engine_kv_events,
            )
            # The prefill/decode hook (pd.py) drives NIXL and NATS from the engine thread, so a role other
            # than `both` keeps the engine on a thread of the service process (one GIL) for now.
            if args.engine_process and service.pd is None:
                return EngineProcess(make_engine, make_telemetry, *callbacks, log_level=args.log_level)
            return EngineLoop(make_engine, make_telemetry, *callbacks, hook=service.pd)

        return SchedulerService(
            nc,
            instance_id,
            model,
            config.max_running_requests,
            args.max_queued_requests,
            make_loop,
            stop,
            detok_timeout_s=args.detok_timeout,
            detok_batch_size=args.detok_batch_size,
            stream_interval=args.stream_interval,
            kv_event_block_size=config.kv_event_block_size,
            pd=pd,
        )

    try:
        return run_bus_service(args, f"scheduler-{instance_id}", registry, build)
    finally:
        tracing.shutdown()

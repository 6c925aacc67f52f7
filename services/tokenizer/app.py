"""`kubesgl tokenizer`: flags and process entry of the tokenizer service."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

from kubesgl.cache_routing.cache_aware import CacheAwareRouter, CacheAwareWeights
from kubesgl.cache_routing.kv_tracker import KvTracker
from kubesgl.cache_routing.prefix_index import PrefixIndex
from kubesgl.routing import ROUTERS, SchedulerRegistry, make_router
from kubesgl.runtime.bus_service import add_service_arguments, run_bus_service
from kubesgl.runtime.telemetry.metrics import TokenizerMetrics, new_registry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.tokenizer.kv_feed import KvFeed
from kubesgl.services.tokenizer.request_router import RequestRouter
from kubesgl.services.tokenizer.service import TokenizerService
from kubesgl.text.tokenizer import ModelTokenizer
from nats.aio.client import Client

CACHE_AWARE = "cache-aware"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (only its tokenizer files are read)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: dir name)")
    parser.add_argument("--routing-policy", default=CACHE_AWARE, choices=sorted([*ROUTERS, CACHE_AWARE]))
    parser.add_argument(
        "--kv-block-size",
        type=_positive_int,
        default=16,
        help="tokens per prefix block, as the schedulers' --kv-event-block-size (cache-aware)",
    )
    parser.add_argument(
        "--overlap-weight",
        type=float,
        default=1.0,
        help="cache-aware score: weight of the cached prefix share",
    )
    parser.add_argument(
        "--load-weight", type=float, default=1.0, help="cache-aware score: weight of the instance's load"
    )
    parser.add_argument(
        "--kv-stale-after",
        type=float,
        default=2.5,
        help="seconds without a heartbeat or KV event after which an instance's cache counts no overlap",
    )
    parser.add_argument(
        "--session-affinity",
        action="store_true",
        help="keep a session (OpenAI `user` or header x-session-id) on one instance (rendezvous hashing)",
    )
    parser.add_argument(
        "--affinity-max-load",
        type=float,
        default=1.0,
        help="an affinity instance this loaded (running+queued over max, or KV used) routes by policy instead",
    )
    add_service_arguments(parser, drain_timeout_s=10.0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def main(args: argparse.Namespace) -> int:
    registry = new_registry()
    metrics = TokenizerMetrics(registry)
    tracing = Tracing("kubesgl-tokenizer")
    tokenizer = ModelTokenizer.load(args.model)

    async def build(nc: Client, stop: asyncio.Event) -> TokenizerService:
        tracker = KvTracker(PrefixIndex(), args.kv_block_size, stale_after_s=args.kv_stale_after)
        if args.routing_policy == CACHE_AWARE:
            router = CacheAwareRouter(tracker, CacheAwareWeights(args.overlap_weight, args.load_weight))
        else:
            router = make_router(args.routing_policy)
        affinity = args.affinity_max_load if args.session_affinity else None
        schedulers, model = SchedulerRegistry(), served_model_name(args)

        def serves(instance_id: str) -> bool:  # a live, non-draining instance of this model
            return any(c.instance_id == instance_id for c in schedulers.candidates(model))

        return TokenizerService(
            nc,
            tokenizer,
            model,
            RequestRouter(args.routing_policy, router, metrics.router, affinity),
            schedulers,
            metrics,
            tracing,
            kv_feed=KvFeed(nc, tracker, metrics.router, serves)
            if args.routing_policy == CACHE_AWARE
            else None,
        )

    try:
        # Eager NATS writes: a burst's first admission goes on to a scheduler while the tokenizer reads the rest.
        name = f"tokenizer-{socket.gethostname()}-{os.getpid()}"
        return run_bus_service(args, name, registry, build, eager=True)
    finally:
        tracing.shutdown()

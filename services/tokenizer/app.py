"""`kubesgl tokenizer`: flags and process entry of the tokenizer service."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

from kubesgl.bus_service import add_service_arguments, run_bus_service
from kubesgl.routing import ROUTERS, SchedulerRegistry, make_router
from kubesgl.services.tokenizer.service import TokenizerService
from kubesgl.telemetry.metrics import TokenizerMetrics, new_registry
from kubesgl.telemetry.tracing import Tracing
from kubesgl.text.tokenizer import ModelTokenizer
from nats.aio.client import Client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (only its tokenizer files are read)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: dir name)")
    parser.add_argument("--routing-policy", default="least-load", choices=sorted(ROUTERS))
    add_service_arguments(parser, drain_timeout_s=10.0)


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def main(args: argparse.Namespace) -> int:
    registry = new_registry()
    metrics = TokenizerMetrics(registry)
    tracing = Tracing("kubesgl-tokenizer")
    tokenizer = ModelTokenizer.load(args.model)

    async def build(nc: Client, stop: asyncio.Event) -> TokenizerService:
        return TokenizerService(
            nc,
            tokenizer,
            served_model_name(args),
            make_router(args.routing_policy),
            SchedulerRegistry(),
            metrics,
            tracing,
        )

    try:
        return run_bus_service(args, f"tokenizer-{socket.gethostname()}-{os.getpid()}", registry, build)
    finally:
        tracing.shutdown()

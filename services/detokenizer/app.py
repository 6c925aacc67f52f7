"""`kubesgl detokenizer`: flags and process entry of the detokenizer service."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

from kubesgl.runtime.bus_service import add_service_arguments, run_bus_service
from kubesgl.runtime.telemetry.metrics import DetokenizerMetrics, new_registry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.detokenizer.service import DetokenizerService
from kubesgl.text.tokenizer import ModelTokenizer
from nats.aio.client import Client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (only its tokenizer files are read)")
    add_service_arguments(parser, drain_timeout_s=5.0)


def main(args: argparse.Namespace) -> int:
    registry = new_registry()
    metrics = DetokenizerMetrics(registry)
    tracing = Tracing("kubesgl-detokenizer")
    tokenizer = ModelTokenizer.load(args.model)

    async def build(nc: Client, stop: asyncio.Event) -> DetokenizerService:
        return DetokenizerService(nc, tokenizer, metrics, tracing)

    try:
        return run_bus_service(args, f"detokenizer-{socket.gethostname()}-{os.getpid()}", registry, build)
    finally:
        tracing.shutdown()

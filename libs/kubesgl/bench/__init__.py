"""`kubesgl bench <kind>`: benchmarks. Each kind is a module here with add_arguments(parser) and main(args)."""

from __future__ import annotations

import argparse
import importlib

KINDS = {
    "offline": "the seeds' offline throughput benchmark on the engine (LLM), with the memory-bound ceiling",
    "serve": "drive a running gateway with the seed workload shape; TTFT/ITL and output tok/s",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, metavar="KIND")
    for name, help_text in KINDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        try:
            importlib.import_module(f"kubesgl.bench.{name}").add_arguments(sp)
        except ModuleNotFoundError as e:
            if e.name != f"kubesgl.bench.{name}":
                raise


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(f"kubesgl.bench.{args.bench}").main(args) or 0)

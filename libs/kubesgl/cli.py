"""The `kubesgl` command: one subcommand per service plus the local launcher, shell and benchmark.

Each subcommand's flags live in its own module (`add_arguments(parser)`, `main(args) -> exit code`); only the
chosen module is imported, so `kubesgl tokenizer` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "gateway": ("kubesgl.services.gateway.app", "OpenAI-compatible HTTP gateway (FastAPI)"),
    "tokenizer": ("kubesgl.services.tokenizer.app", "tokenizer service (NATS queue group)"),
    "detokenizer": ("kubesgl.services.detokenizer.app", "detokenizer service (NATS queue group)"),
    "scheduler": ("kubesgl.services.scheduler.app", "scheduler instance: the engine on this pod's GPUs"),
    "up": ("kubesgl.launcher", "run everything locally: nats-server + every service as its own process"),
    "shell": ("kubesgl.shell", "interactive chat against a gateway"),
    "bench": ("kubesgl.bench", "benchmarks (e.g. `bench serve` against a gateway)"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser, with full flags for `command` only (the others are listed for --help)."""
    parser = argparse.ArgumentParser(prog="kubesgl", description="Kubernetes-native LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

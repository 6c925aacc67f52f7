"""Request migration, the done-when of issue 27: two scheduler instances, 64 concurrent streams (greedy and
seeded), the busiest instance SIGKILLed mid-stream: once every stream has output, while it provably holds streams
with a quarter of their tokens still to come (loadtest/migration.py's kill_busiest reads that from the instances
themselves, so a loaded box, where one instance may finish its streams before the other's have a second chunk,
cannot make the kill land on nothing). Every stream completes, its text and usage counts identical to an
undisturbed run of the same requests, its chunks under one id; the gateway counts the migrations.
The passes are loadtest/migration.py's (which measures the same at 256 streams for docs/reliability.md)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from kubesgl.launcher import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parents[2] / "loadtest" / "migration.py"
STREAMS = 64
MAX_TOKENS = 24  # decode steps enough that the victim's streams are still far from done at the kill


@pytest.fixture(scope="module")
def migration() -> ModuleType:
    spec = importlib.util.spec_from_file_location("migration", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["migration"] = module
    spec.loader.exec_module(module)
    return module


def test_streams_survive_the_sigkill_of_their_scheduler(stack, migration: ModuleType) -> None:  # type: ignore[no-untyped-def]
    s: Stack = stack(schedulers=2)
    url = s.gateway_urls[0]
    undisturbed = asyncio.run(migration.run_streams(url, STREAMS, MAX_TOKENS))
    assert [r["error"] for r in undisturbed if r["error"]] == []
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in undisturbed)
    disturbed = asyncio.run(migration.run_streams(url, STREAMS, MAX_TOKENS, kill=s))
    assert migration.differences(undisturbed, disturbed) == []
    summary = migration.summarize(s, undisturbed, disturbed)
    print(summary)
    assert summary["migrated_total"] >= 1, "no stream was migrated: the kill hit nothing"

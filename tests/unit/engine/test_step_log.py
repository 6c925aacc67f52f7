"""KUBESGL_STEP_LOG: the engine's step timeline, one JSON line per launched step, written by a real engine."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from kubesgl import LLM, SamplingParams
from kubesgl.errors import InvalidRequestError
from kubesgl.models.random_init import build_random_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_random_model("qwen3", tmp_path_factory.mktemp("m") / "qwen3"))


def test_each_step_is_one_line_with_what_it_ran(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("KUBESGL_STEP_LOG", str(path))
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (40, 7, 25)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(model, page_size=4, max_prefill_tokens=32) as llm:
        outputs = llm.generate(prompts, params)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    extend = [x for x in lines if x["mode"] == "extend"]
    decode = [x for x in lines if x["mode"] == "decode"]
    # 72 prompt tokens in chunks of at most 32; the first token of each comes from its last chunk, the other
    # four from decode steps of up to three rows.
    assert sum(x["tokens"] for x in extend) == 72 and all(x["tokens"] <= 32 for x in extend)
    assert sum(x["tokens"] for x in decode) == sum(len(o["token_ids"]) - 1 for o in outputs) == 12
    assert all(x["tokens"] == x["rows"] for x in decode)
    times = [x["t"] for x in lines]
    assert times == sorted(times)
    assert lines[0]["waiting"] == 2 and lines[0]["running"] == 1  # only the first prompt fits the first chunk
    assert all(x["schedule_ms"] >= 0 and x["launch_ms"] >= 0 and x["free_pages"] >= 0 for x in lines)


def test_the_step_log_and_the_step_profile_together_are_refused(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBESGL_STEP_LOG", str(tmp_path / "steps.jsonl"))
    monkeypatch.setenv("KUBESGL_STEP_PROFILE", "1")
    with pytest.raises(InvalidRequestError, match="KUBESGL_STEP_PROFILE and KUBESGL_STEP_LOG"):
        LLM(model)
    assert not (tmp_path / "steps.jsonl").exists()

"""lm-evaluation-harness's `local-completions` model runs a loglikelihood task (tests/data/lm_eval: a tiny
synthetic JSONL dataset, no download) against the demo stack; every per-document loglikelihood must equal
the offline engine's prompt logprobs (kubesgl LLM, the same checkpoint) and the one computed directly from
the checkpoint with transformers, within float32 rounding of the model's sums (support.numerics).

Not bit for bit: the stack scores each document alone while the offline run scores them in one batch, and the
CPU BLAS picks its GEMM kernel by the number of rows (one row runs a GEMV; a few rows another blocking, varying
with the thread count too), so the same logits come out rounded differently. Making that batch-invariant would
take our own fixed-order GEMMs on every device: not cheap, so the comparison allows the rounding instead.

lm_eval (0.4.13) asks for a loglikelihood with one request per document to /v1/completions:
    {"model": "demo", "prompt": [[<context ids> + <continuation ids>]], "temperature": 0, "max_tokens": 1,
     "logprobs": 1, "seed": 1234, "echo": true}
and sums choices[0].logprobs.token_logprobs[len(context):-1] (the echoed prompt's logprobs; the last entry is
the one generated token); is_greedy compares each with max(top_logprobs[i].values())."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, TEST_SCHEDULER_ARGS, StackFactory
from support.numerics import logprob_tolerance

TASKS = REPO / "tests" / "data" / "lm_eval"
pytestmark = pytest.mark.timeout(600)


def _reference_loglikelihood(model_dir: str, context: list[int], continuation: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(context)
    return float(sum(logprobs[n - 1 + i, t] for i, t in enumerate(continuation)))


def test_lm_eval_loglikelihood_matches_the_checkpoint(
    stack_factory: StackFactory, demo_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(REPO)  # the task's data_files path is relative to the repository root
    stack = stack_factory(
        tmp_path / "stack", scheduler_args=(*TEST_SCHEDULER_ARGS, "--context-length", "256")
    )
    try:
        lm = LocalCompletionsAPI(
            base_url=f"{stack.gateway_urls[0]}/v1/completions",
            model="demo",
            tokenizer=demo_model_dir,  # a local path: no hub lookup
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            max_retries=1,  # a refusal fails the run at once instead of backing off
            max_length=256,
        )
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=["kubesgl_synthetic_ll"],
            task_manager=TaskManager(include_path=str(TASKS)),
            log_samples=True,
        )
    finally:
        stack.stop(timeout_s=10)
    samples = out["samples"]["kubesgl_synthetic_ll"]
    assert len(samples) == len((TASKS / "synthetic.jsonl").read_text().splitlines())
    pairs = [lm._encode_pair(*s["arguments"][0]) for s in samples]
    offline = _offline_loglikelihoods(demo_model_dir, pairs)
    for s, (ctx_ids, cont_ids), engine in zip(samples, pairs, offline, strict=True):
        served, greedy = s["resps"][0][0]
        # A sum of len(cont_ids) logprobs, each within its own rounding tolerance.
        tol = len(cont_ids) * logprob_tolerance(demo_model_dir, context=len(ctx_ids) + len(cont_ids))
        assert served == pytest.approx(engine, rel=0, abs=tol)
        assert served == pytest.approx(
            _reference_loglikelihood(demo_model_dir, ctx_ids, cont_ids), rel=0, abs=tol
        )
        assert isinstance(greedy, bool)
    assert out["results"]["kubesgl_synthetic_ll"]["perplexity,none"] > 1


def _offline_loglikelihoods(model_dir: str, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """The continuation's summed prompt logprobs from our engine run directly (no services)."""
    from kubesgl import LLM, SamplingParams
    from kubesgl.values.sampling import LogprobOptions

    params = SamplingParams(max_tokens=0, logprobs=LogprobOptions(top=1, prompt_start=0))
    with LLM(model_dir, device="cpu") as llm:
        outs = llm.generate([c + t for c, t in pairs], params)
    return [
        sum(e.logprob for e in out["prompt_logprobs"][len(c) :])
        for out, (c, _) in zip(outs, pairs, strict=True)
    ]

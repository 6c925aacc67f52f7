"""Our model implementations against HF transformers on the same random checkpoints (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kubesgl.models.loader import load_model
from kubesgl.models.random_init import build_random_model
from support.model_helpers import PARITY_ARCHS, SingleRequestRunner
from support.numerics import logits_tolerance
from transformers import AutoModelForCausalLM

PROMPT_LEN = 20
PREFIX_LEN = 12  # teacher-forced decoding starts after this many prompt tokens


@pytest.fixture(scope="module", params=PARITY_ARCHS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(request.param, tmp_path_factory.mktemp(request.param))


def prompt(vocab_size: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen).tolist()


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(checkpoint: Path, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal within float32 rounding of the model's sums (ours and transformers' run other kernels and orders)."""
    tol = logits_tolerance(checkpoint, context=PROMPT_LEN)
    torch.testing.assert_close(ours, ref, rtol=0, atol=tol)
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * tol  # a near-tie may flip on rounding alone
    assert decisive.any()
    assert torch.equal(ours.argmax(-1)[decisive], ref.argmax(-1)[decisive])


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_logits_match_hf_at_every_position(checkpoint: Path, page_size: int) -> None:
    model = load_model(checkpoint)
    ids = prompt(model.vocab_size)
    ours = SingleRequestRunner(model, page_size).step(ids)
    assert ours.dtype == torch.float32 and ours.shape == (PROMPT_LEN, model.vocab_size)
    assert_matches_hf(checkpoint, ours, hf_logits(checkpoint, ids))


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_after_prefix_match_hf(checkpoint: Path, page_size: int) -> None:
    model = load_model(checkpoint)
    ids = prompt(model.vocab_size, seed=1)
    runner = SingleRequestRunner(model, page_size)
    steps = [runner.step(ids[:PREFIX_LEN])] + [runner.step([t]) for t in ids[PREFIX_LEN:]]
    assert_matches_hf(checkpoint, torch.cat(steps), hf_logits(checkpoint, ids))


def test_chunked_extend_over_cached_prefix_matches_hf(checkpoint: Path) -> None:
    model = load_model(checkpoint)
    ids = prompt(model.vocab_size, seed=2)
    runner = SingleRequestRunner(model, page_size=4)
    chunks = [runner.step(ids[:7]), runner.step(ids[7:13]), runner.step(ids[13:])]
    assert_matches_hf(checkpoint, torch.cat(chunks), hf_logits(checkpoint, ids))

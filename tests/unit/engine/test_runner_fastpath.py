"""The runner's decode fast path: input prep and sampling inside the CUDA graph, one packed upload per step.

On CPU the functions the graph captures are checked against the eager code they replace (same tokens,
same KV slots, same draws from the generator). On CUDA (`gpu` tests) the engine's graph path is checked
against its eager sampler and against a graphs-off, overlap-off engine.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.engine.decode_inputs import decode_inputs
from kubesgl.engine.gumbel_sampling import gumbel_tokens, philox_key, sampling_scale
from kubesgl.engine.plan import SlotInit
from kubesgl.engine.runner import _page_cells
from kubesgl.engine.sampler import Sampler, greedy_tokens, temperature_tokens
from kubesgl.engine.transfer import PinnedStaging
from kubesgl.models.random_init import build_random_model
from kubesgl.values.sampling import LogprobOptions
from support.engine_helpers import assert_greedy_match
from support.numerics import logits_tolerance

CPU = torch.device("cpu")
# The Gumbel kernel runs compiled on a CUDA machine and in Triton's interpreter on CPU tensors elsewhere.
KDEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def slot_init(slot: int, seed: int = 0, seed_given: bool = False, **params: float | int) -> SlotInit:
    return SlotInit(slot, 3, SamplingParams(**params, seed=seed if seed_given else None), seed)


# --- CPU: the captured functions equal the eager code -------------------------------------------------


def test_decode_inputs_gather_last_token_and_kv_slot() -> None:
    page_size, slots_n, max_pages = 4, 6, 5
    gen = torch.Generator().manual_seed(0)
    token_pool = torch.randint(0, 1000, (slots_n + 1, max_pages * page_size), generator=gen)
    page_table = torch.randint(1, 50, (slots_n + 1, max_pages), generator=gen, dtype=torch.int32)
    pad = slots_n
    token_pool[pad].zero_()
    page_table[pad].zero_()
    slots = torch.tensor([3, 0, 5, pad, pad])
    positions = torch.tensor([7, 0, 19, 0, 0])
    ids, out_loc = decode_inputs(token_pool, page_table, slots, positions, page_size)
    for i, (s, p) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        assert ids[i] == token_pool[s, p]
        assert out_loc[i] == int(page_table[s, p // page_size]) * page_size + p % page_size
    assert ids[3:].tolist() == [0, 0] and out_loc[3:].tolist() == [0, 0]  # padded rows: scratch page 0


def test_temperature_tokens_draw_what_the_eager_sampler_draws() -> None:
    sampler = Sampler(8, CPU)
    inits = [
        slot_init(0, temperature=0.0),
        slot_init(1, temperature=0.7),
        slot_init(2, temperature=1.3),
        slot_init(3, temperature=0.9, top_k=1),  # top_k 1 is greedy
        slot_init(4, temperature=1.0),
    ]
    sampler.init_slots(inits)
    slots = [4, 0, 2, 1, 3]
    logits = torch.randn(len(slots), 300, generator=torch.Generator().manual_seed(1)) * 3
    torch.manual_seed(7)
    eager, *_ = sampler.sample(
        logits, slots, [5] * len(slots), torch.zeros(8, 16, dtype=torch.int64), [None] * 5
    )
    torch.manual_seed(7)
    slot_t = torch.tensor(slots)
    fast = temperature_tokens(logits, sampler.temperature[slot_t], sampler.greedy[slot_t])
    assert fast.tolist() == eager.tolist()
    argmax = logits.argmax(dim=-1)
    assert fast[1] == argmax[1] and fast[4] == argmax[4]
    assert sampler.graph_mode(slots, [None] * 5) == "temperature"


def test_greedy_tokens_equal_the_eager_greedy_sampler() -> None:
    sampler = Sampler(4, CPU)
    sampler.init_slots([slot_init(0, temperature=0.0), slot_init(1, temperature=0.5, top_k=1)])
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2))
    eager, *_ = sampler.sample(logits, [0, 1], [4, 4], torch.zeros(4, 8, dtype=torch.int64), [None, None])
    assert greedy_tokens(logits).tolist() == eager.tolist()
    assert sampler.graph_mode([0, 1], [None, None]) == "greedy"


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.3},
        {"repetition_penalty": 1.2},
        {"top_k": 5},
        {"top_p": 0.9},
        {"min_p": 0.1},
        {"seed_given": True, "seed": 11},
        {"temperature": 0.0, "repetition_penalty": 1.1},  # penalties change greedy tokens too
    ],
)
def test_rows_needing_more_than_temperature_take_the_eager_sampler(params: dict) -> None:
    sampler = Sampler(4, CPU)
    sampler.init_slots([slot_init(0, temperature=0.8), slot_init(1, **params)])
    assert sampler.graph_mode([0], [None]) == "temperature"
    assert sampler.graph_mode([0, 1], [None, None]) is None
    sampler.init_slots([slot_init(1, temperature=0.0)])  # the slot reused by a plain greedy request
    assert sampler.graph_mode([1], [None]) == "greedy"
    assert sampler.graph_mode([0, 1], [None, None]) == "temperature"


def test_greedy_rows_ignore_filters_they_cannot_use() -> None:
    sampler = Sampler(4, CPU)
    sampler.init_slots([slot_init(0, temperature=0.0, top_p=0.5, min_p=0.2, seed_given=True)])
    assert sampler.graph_mode([0], [None]) == "greedy"


def test_logprobs_take_the_eager_sampler() -> None:
    sampler = Sampler(4, CPU)
    sampler.init_slots([slot_init(0, temperature=0.0), slot_init(1)])
    assert sampler.graph_mode([0, 1], [None, 0]) is None
    assert sampler.graph_mode([0, 1], [None, None]) == "temperature"


def test_page_cells_pack_rows_cols_pages_and_a_later_write_wins() -> None:
    cells = _page_cells([(2, 0, [7, 8]), (5, 3, [9]), (2, 1, [4])])
    assert cells == [2, 2, 5, 0, 1, 3, 7, 4, 9]
    assert _page_cells([]) == []


def test_staging_uploads_into_the_given_buffer() -> None:
    staging = PinnedStaging(CPU, capacity=4)
    out = torch.full((10,), -1, dtype=torch.int64)
    got = staging.upload([3, 1, 4, 1, 5, 9], out)
    assert got.tolist() == [3, 1, 4, 1, 5, 9] and out[6:].tolist() == [-1] * 4
    assert staging.upload([2, 7]).tolist() == [2, 7]


def test_gumbel_kernel_greedy_rows_are_torch_argmax_ties_included() -> None:
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits[1, 650] = logits[1, 12] = logits[1].max() + 1  # ties: the first index wins, as in torch
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1
    greedy = torch.tensor([True, True, True])
    scale = sampling_scale(torch.ones(3), greedy)
    tokens = gumbel_tokens(logits.to(KDEV), scale.to(KDEV), philox_key(0, KDEV)).cpu()
    assert tokens.tolist() == logits.float().argmax(dim=-1).tolist() == [int(logits[0].argmax()), 12, 5]


def test_gumbel_kernel_picks_across_vocab_splits_first_index_on_ties() -> None:
    """A row is scanned by several programs (SPLIT logits each): the winner may sit in any split, and a tie
    between splits still goes to the lowest index."""
    from kubesgl.engine.gumbel_sampling import SPLIT

    vocab = 2 * SPLIT + 1000  # three splits, the last one partial
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6))
    top = logits.max() + 1
    logits[0, 2 * SPLIT + 999] = top  # the last logit of the partial split
    logits[1, 100] = logits[1, SPLIT + 5] = top  # tie across splits 0 and 1
    logits[2, SPLIT + 7] = logits[2, 2 * SPLIT + 3] = top  # tie across splits 1 and 2
    logits[3, SPLIT - 1] = top  # the last logit of split 0
    scale = sampling_scale(torch.ones(4), torch.ones(4, dtype=torch.bool))
    tokens = gumbel_tokens(logits.to(KDEV), scale.to(KDEV), philox_key(0, KDEV)).cpu()
    assert tokens.tolist() == logits.argmax(dim=-1).tolist() == [2 * SPLIT + 999, 100, SPLIT + 7, SPLIT - 1]


def test_gumbel_scan_split_gives_a_small_batch_more_programs() -> None:
    from kubesgl.engine.gumbel_sampling import BLOCK, SPLIT, scan_split

    qwen3_vocab = 151936  # 19 splits of SPLIT
    assert [scan_split(b, qwen3_vocab) for b in (1, 6, 7, 256)] == [BLOCK, BLOCK, SPLIT, SPLIT]
    assert scan_split(300, 5) == scan_split(1, 300) == BLOCK  # no blocks past the vocabulary
    assert scan_split(500, 3 * BLOCK) == 3 * BLOCK


def test_gumbel_kernel_draws_the_same_tokens_whatever_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small batch scans one block per program, a large one SPLIT logits per program: a logit's noise depends
    on its column alone, so the same key draws the same tokens (temperature rows, and a greedy one). A spy on the
    partial kernel's launch (it still runs) records the grids, so an ignored split would fail here."""
    from kubesgl.engine import gumbel_sampling
    from kubesgl.engine.gumbel_sampling import BLOCK, SPLIT

    grids: list[tuple[int, int]] = []
    kernel = gumbel_sampling._gumbel_partial_kernel

    class LaunchSpy:
        def __getitem__(self, grid: tuple[int, int]) -> Any:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gumbel_sampling, "_gumbel_partial_kernel", LaunchSpy())
    vocab = SPLIT + 3 * BLOCK + 100  # the last block and the last split partial
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8)) * 0.1  # flat: noise decides
    scale = sampling_scale(torch.tensor([1.0, 0.5, 1.0]), torch.tensor([False, False, True]))
    args = (logits.to(KDEV), scale.to(KDEV), philox_key(11, KDEV))
    by_split = {s: gumbel_tokens(*args, split=s).cpu().tolist() for s in (BLOCK, 2 * BLOCK, SPLIT)}
    assert by_split[BLOCK] == by_split[2 * BLOCK] == by_split[SPLIT] == gumbel_tokens(*args).cpu().tolist()
    assert by_split[SPLIT][2] == int(logits[2].argmax())
    small = (logits[:, :300].contiguous().to(KDEV), *args[1:])  # one block: scanned as one, or as one split
    assert gumbel_tokens(*small).cpu().tolist() == gumbel_tokens(*small, split=SPLIT).cpu().tolist()
    assert grids == [(3, 8), (3, 4), (3, 2), (3, 8), (3, 1), (3, 1)]
    with pytest.raises(ValueError, match="multiple of 2048"):
        gumbel_tokens(*args, split=1000)


@pytest.mark.slow  # 15-45 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_gumbel_kernel_samples_softmax_of_logits_over_temperature() -> None:
    rows, temperature = 300, 0.7
    base = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.2])
    logits = base.repeat(rows, 1)  # every row an independent draw (its own Philox offsets)
    scale = sampling_scale(torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.bool))
    logits, scale, key = logits.to(KDEV), scale.to(KDEV), philox_key(5, KDEV)
    first = gumbel_tokens(logits, scale, key).cpu()
    freq = torch.bincount(first, minlength=5).float() / rows
    assert (freq - torch.softmax(base / temperature, 0)).abs().max() < 0.1  # 4 sigma at 300 draws
    assert gumbel_tokens(logits, scale, key).cpu().tolist() == first.tolist()  # same key, same draw
    key += 1
    assert gumbel_tokens(logits, scale, key).cpu().tolist() != first.tolist()  # the graph advances the key


# --- CUDA: the engine's graph path ----------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
N_NEW = 32


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    overrides = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
    path = build_random_model(
        "qwen3", tmp_path_factory.mktemp("m") / "qwen3", overrides=overrides, init_std=0.5
    )
    return str(path)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(500) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def _generate(model: str, params: SamplingParams, n: int = 24, **config: object) -> list[dict]:
    """n requests whose lengths differ, so a batch starts above the largest graph (16) and shrinks into it."""
    cfg = dict(device="cuda", page_size=16, num_pages=1024, max_running_requests=32, cuda_graph_max_bs=16)
    plist = [SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - i}) for i in range(n)]
    with LLM(model, **{**cfg, **config}) as llm:
        return llm.generate(_prompts(n), plist)


@pytest.mark.gpu
@needs_cuda
def test_graph_greedy_equals_eager_sampler_bit_for_bit(gpu_model: str) -> None:
    """Same graphs, same logits: the in-graph argmax against the eager sampler (forced by logprobs)."""
    plain = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    fast = _generate(gpu_model, plain, dtype="bfloat16")
    eager = _generate(gpu_model, replace(plain, logprobs=LogprobOptions()), dtype="bfloat16")
    assert [o["token_ids"] for o in fast] == [o["token_ids"] for o in eager]


@pytest.mark.gpu
@needs_cuda
def test_graphs_with_overlap_match_an_eager_engine(gpu_model: str) -> None:
    """float32 Triton: graphs + overlap against graphs off + overlap off, up to a near-tie in the logits."""
    ref_params = SamplingParams(
        max_tokens=N_NEW,
        temperature=0,
        ignore_eos=True,
        logprobs=LogprobOptions(top=2),
    )
    ref = _generate(
        gpu_model, ref_params, dtype="float32", attn="triton", cuda_graph_max_bs=0, disable_overlap=True
    )
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    ours = _generate(gpu_model, params, dtype="float32", attn="triton")
    # float32 in another order (graphs and overlap against eager; TF32 stays off for float32 GEMMs).
    tie = 2 * logits_tolerance(gpu_model, context=max(map(len, _prompts(24))) + N_NEW)
    for o, r in zip(ours, ref, strict=True):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in r["logprobs"]]
        assert_greedy_match(o["token_ids"], r["token_ids"], gaps, tie)


@pytest.mark.gpu
@needs_cuda
def test_graph_sampling_is_reproducible_from_the_engine_seed(gpu_model: str) -> None:
    params = SamplingParams(max_tokens=N_NEW, temperature=1.5, ignore_eos=True)
    first = _generate(gpu_model, params, n=12, dtype="bfloat16")
    second = _generate(gpu_model, params, n=12, dtype="bfloat16")
    other_seed = _generate(gpu_model, params, n=12, dtype="bfloat16", seed=1)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    assert [o["token_ids"] for o in first] != [o["token_ids"] for o in other_seed]


def test_tensor_aware_max_keeps_builtin_semantics() -> None:
    from kubesgl.attention.flashinfer_backend import _tensor_aware_max

    t = torch.tensor([3, 9, 4], dtype=torch.int32)
    assert _tensor_aware_max(t).item() == max(t).item() == 9
    assert _tensor_aware_max([1, 5, 2]) == 5 and _tensor_aware_max(2, 7) == 7
    assert _tensor_aware_max([], default=-1) == -1
    with pytest.raises(ValueError):
        _tensor_aware_max(torch.tensor([], dtype=torch.int32))

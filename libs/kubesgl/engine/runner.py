"""ModelRunner: one rank's model, KV memory, token pool and sampler; executes BatchPlans.

Every rank of a tensor-parallel group runs the same plans in the same order, so the sampled tokens (computed
from identical all-gathered logits with counter-based noise) are identical everywhere and never need to be
sent between ranks. A plan with grammar rows stops before sampling (`PendingSample`); rank 0 fills the rows'
token bitmask once its matchers have seen the previous step's tokens and broadcasts it over the TP group
(`sample_masked`), so every rank masks and samples alike.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.registry import create_backend
from kubesgl.distributed import TPGroup
from kubesgl.engine.compile import CompiledForward
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.cuda_graph import DecodeGraphs, auto_max_bs
from kubesgl.engine.piecewise_graph import PrefillGraphs, auto_max_tokens
from kubesgl.engine.plan import BatchPlan
from kubesgl.engine.sampler import Sampler
from kubesgl.engine.step_result import PendingSample, PromptLogprobs, StepResult
from kubesgl.engine.transfer import PinnedStaging
from kubesgl.env import torch_compile_dynamic
from kubesgl.kv.kv_cache import KVCache
from kubesgl.layers.forward import ForwardBatch
from kubesgl.models.loader import load_model
from kubesgl.structured.matcher import bitmask_width

log = logging.getLogger(__name__)

_T = TypeVar("_T", np.ndarray, torch.Tensor)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype | None:
    """None means "as the checkpoint says" (the loader reads torch_dtype); CPU runs default to float32."""
    if name == "auto":
        return torch.float32 if device == "cpu" else None
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class EagerInputs(NamedTuple, Generic[_T]):
    """An eager step's inputs: int64 arrays on the host, then (`upload`) tensors on the device."""

    token_slots: _T  # [T] the slot of each new token
    positions: _T  # [T] its position
    tokens: _T  # [extend tokens] the extend rows' tokens (a mixed step's decode rows read the token pool)
    slots: _T  # [B] per row
    seq_lens: _T  # [B]
    sample_index: _T  # [K] per sampled row: its last token's index among the T
    sample_slots: _T  # [K]
    sample_seq_lens: _T  # [K]
    page_cells: _T  # the plan's page-table writes (`_page_cells`)

    @classmethod
    def upload(cls, staging: PinnedStaging, host: EagerInputs[np.ndarray]) -> EagerInputs[torch.Tensor]:
        """All of them in one host-to-device copy, split back into their parts (views)."""
        packed = staging.upload(np.concatenate(host))
        return cls._make(torch.split(packed, [len(a) for a in host]))


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup) -> None:
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device if config.device != "cuda" else f"cuda:{tp.device_index}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        started = time.perf_counter()
        self.model = load_model(
            config.model_path,
            tp=tp,
            device=self.device,
            dtype=resolve_dtype(config.dtype, self.device.type),
            dummy=config.dummy_weight,
        )
        self.load_weights_s = time.perf_counter() - started  # sglang:engine_load_weights_time
        m = self.model
        self.context_len = config.max_seq_len_override or m.context_len
        self.page_size = config.page_size
        self.num_pages = self._size_kv_pool()
        self.kv = KVCache(
            m.num_layers, self.num_pages, self.page_size, m.num_kv_heads, m.head_dim, m.dtype, self.device
        )
        slots = config.max_running_requests
        max_pages = -(-self.context_len // self.page_size)
        # One row past the scheduler's slots: the scratch slot that padded graph rows name (pages all 0).
        self.page_table = torch.zeros(slots + 1, max_pages, dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros(slots + 1, self.context_len + 1, dtype=torch.int64, device=self.device)
        self.sampler = Sampler(slots + 1, self.device)
        self.staging = PinnedStaging(self.device)
        self.attn = create_backend(
            config.attn,
            device=self.device,
            page_size=self.page_size,
            num_q_heads=m.hf_config.num_attention_heads // tp.size,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=m.dtype,
        )
        self.compiled: CompiledForward | None = None
        if config.enable_torch_compile:
            self.compiled = CompiledForward(m, config.torch_compile_max_bs, dynamic=torch_compile_dynamic())
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graph_max_bs != 0:
            max_bs = config.cuda_graph_max_bs or auto_max_bs(self.device, slots)
            self.graphs = DecodeGraphs(
                model=m,
                attn=self.attn,
                kv=self.kv,
                token_pool=self.token_pool,
                page_table=self.page_table,
                page_size=self.page_size,
                sampler=self.sampler,
                staging=self.staging,
                seed=config.seed,
                max_bs=min(max_bs, slots),
                pad_slot=slots,
                compiled=self.compiled,
            )
        self.prefill_graphs: PrefillGraphs | None = None
        max_tokens = config.piecewise_cuda_graph_max_tokens
        if max_tokens is None:
            max_tokens = auto_max_tokens(m, config.max_prefill_tokens)
        if self.device.type == "cuda" and max_tokens:
            self.prefill_graphs = PrefillGraphs(
                model=m, attn=self.attn, kv=self.kv, max_tokens=max_tokens, device=self.device
            )
        if (
            self.compiled is not None
        ):  # the graphs' warm-up compiled their sizes; without graphs, first use does
            c = self.compiled
            when = f"{c.compile_seconds:.1f} s at start-up" if self.graphs else "compiles at first use"
            log.info("torch.compile (decode bs <= %d): %s (cache %s)", c.max_bs, when, c.cache_dir)
        # Unseeded sampling draws from this generator: every TP rank must draw the same numbers.
        torch.manual_seed(config.seed)

    # -- sizing --------------------------------------------------------------------------------------
    def release_device_memory(self) -> None:
        """After shutdown: drops the model, KV pool and graphs and hands the cached blocks back to the driver, so
        another engine in this process (a second LLM in a notebook or a test) sizes its KV pool from memory that
        is really free. The runner is unusable afterwards."""
        if self.device.type != "cuda":
            return
        self.graphs = self.prefill_graphs = None
        for name in ("compiled", "model", "kv", "page_table", "token_pool", "sampler", "staging", "attn"):
            setattr(self, name, None)
        gc.collect()  # the graphs and the tensors they captured refer to each other
        torch.cuda.empty_cache()

    def _size_kv_pool(self) -> int:
        m, cfg = self.model, self.config
        per_page = KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) * self.page_size
        if cfg.num_pages is not None:
            n = cfg.num_pages + 1  # + the scratch page
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Activations, CUDA graphs (with their in-graph sampling buffers), eager sampler buffers.
            reserve = (1 - cfg.memory_ratio) * total + (3 << 30)
            n = int((free - reserve) // per_page)
        else:
            n = cfg.cpu_kv_bytes // per_page
        if self.tp.size > 1:  # every rank must hold the same page ids
            t = torch.tensor([n])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.cpu_group)
            n = int(t.item())
        if n < 2:
            raise RuntimeError(f"not enough memory for the KV cache ({n} pages of {per_page} bytes)")
        log.info("KV cache: %d pages x %d tokens (%.2f GiB)", n, self.page_size, n * per_page / 2**30)
        return n

    # -- one step ---------------------------------------------------------------------------------------
    def execute(self, plan: BatchPlan) -> StepResult | PendingSample:
        self.sampler.init_slots(plan.slot_inits)
        bs = self.graphs.padded_size(len(plan.slots)) if self.graphs and plan.mode == "decode" else None
        if bs is not None:
            return self._execute_graph(plan, bs)
        return self._execute_eager(plan)

    def _execute_graph(self, plan: BatchPlan, bs: int) -> StepResult | PendingSample:
        """A decode step through the captured graphs: one host-to-device copy, then two graph replays."""
        graphs = self.graphs
        assert graphs is not None
        n = len(plan.slots)
        staged = graphs.stage(bs, plan.slots, plan.prefix_lens, _page_cells(plan.page_writes))
        self._write_page_table(staged.extra)
        meta = AttentionMetadata(
            mode="decode",
            page_size=self.page_size,
            seq_lens=plan.seq_lens,
            extend_lens=plan.extend_lens,
            prefix_lens=plan.prefix_lens,
            page_table=self.page_table[staged.slots],
            seq_lens_dev=(staged.positions + 1).to(torch.int32),
        )
        mode = self.sampler.graph_mode(plan.slots, plan.top_logprobs)
        out = graphs.replay(meta, bs, mode)
        if mode is not None:
            return self._result(plan, out[:n], None, None, None)
        return self._sample(plan, out[:n].float(), staged.slots, staged.positions + 1)

    def _execute_eager(self, plan: BatchPlan) -> StepResult | PendingSample:
        """Any batch, op by op: extend (prefill chunks, with decode rows riding along in a mixed step), decode
        without graphs, or larger than the largest graph."""
        ps = self.page_size
        slots = np.asarray(plan.slots, dtype=np.int64)
        prefix = np.asarray(plan.prefix_lens, dtype=np.int64)
        ext = np.asarray(plan.extend_lens, dtype=np.int64)
        seq = prefix + ext
        ends = np.cumsum(ext)
        t, n_tok = int(ends[-1]), len(plan.tokens)
        pick = np.flatnonzero(plan.sample)
        # Each new token's slot and position by numpy, not a Python loop: an 8k-token step is close to host-bound.
        pos = np.arange(t, dtype=np.int64) + np.repeat(prefix - (ends - ext), ext)
        inputs = EagerInputs.upload(
            self.staging,
            EagerInputs(
                token_slots=np.repeat(slots, ext),
                positions=pos,
                tokens=np.asarray(plan.tokens, dtype=np.int64),
                slots=slots,
                seq_lens=seq,
                sample_index=ends[pick] - 1,
                sample_slots=slots[pick],
                sample_seq_lens=seq[pick],
                page_cells=np.asarray(_page_cells(plan.page_writes), dtype=np.int64),
            ),
        )
        rows_t, positions = inputs.token_slots, inputs.positions
        self._write_page_table(inputs.page_cells)
        if plan.mode == "extend":
            # The extend rows' tokens come from the host; a mixed step's decode rows (the last t - n_tok tokens)
            # read theirs from the token pool, where the step before sampled them.
            input_ids = inputs.tokens
            self.token_pool[rows_t[:n_tok], positions[:n_tok]] = input_ids
            if n_tok < t:
                input_ids = torch.cat([input_ids, self.token_pool[rows_t[n_tok:], positions[n_tok:]]])
        else:
            input_ids = self.token_pool[rows_t, positions]
        out_loc = self.page_table[rows_t, positions // ps].long() * ps + positions % ps
        seq_lens = seq.tolist()
        meta = AttentionMetadata(
            mode=plan.mode,
            page_size=ps,
            seq_lens=seq_lens,
            extend_lens=plan.extend_lens,
            prefix_lens=plan.prefix_lens,
            page_table=self.page_table[inputs.slots],
            seq_lens_dev=inputs.seq_lens.to(torch.int32),
        )
        self.attn.plan(meta)
        compiled = self.compiled
        forward = (
            compiled
            if compiled is not None and plan.mode == "decode" and compiled.accepts(len(plan.slots))
            else self.model.forward
        )
        fb = ForwardBatch(plan.mode, input_ids, positions, out_loc, self.attn, self.kv)
        piecewise = self.prefill_graphs
        size = piecewise.bucket(t) if piecewise is not None and plan.mode == "extend" else None
        hidden = piecewise.run(fb, size) if size is not None else forward(fb)  # type: ignore[union-attr]
        prompt = (
            PromptLogprobs.compute(self.model.compute_logits, hidden, plan, ends - ext)
            if plan.prompt_logprobs
            else None
        )
        if len(pick) == 0:
            none = torch.empty(0, dtype=torch.int64, device=self.device)
            return self._result(plan, none, None, None, None, prompt)
        logits = self.model.compute_logits(hidden[inputs.sample_index]).float()
        return self._sample(plan, logits, inputs.sample_slots, inputs.sample_seq_lens, prompt)

    def _sample(
        self,
        plan: BatchPlan,
        logits: torch.Tensor,
        slots_t: torch.Tensor,
        seq_lens_t: torch.Tensor,
        prompt: PromptLogprobs | None = None,
    ) -> StepResult | PendingSample:
        """The eager sampler over the rows that sample (slots_t, seq_lens_t: theirs, on the device); their
        tokens go into the token pool. With grammar rows, sampling waits for `sample_masked`."""
        pending = PendingSample(plan, logits, slots_t, seq_lens_t, prompt)
        return pending if plan.grammar_rows else self._sample_now(pending)

    def sample_masked(self, pending: PendingSample, bitmask: torch.Tensor | None) -> StepResult:
        """Samples a pending step with its grammar rows masked. `bitmask`: rank 0's int32 [len(grammar_rows),
        ceil(V / 32)] on the device; the other ranks pass None and receive it."""
        if bitmask is None:  # a rank other than 0
            width = bitmask_width(pending.logits.shape[1])
            bitmask = torch.empty(
                len(pending.plan.grammar_rows), width, dtype=torch.int32, device=self.device
            )
        self.tp.broadcast(bitmask)
        return self._sample_now(pending, bitmask)

    def _sample_now(self, pending: PendingSample, bitmask: torch.Tensor | None = None) -> StepResult:
        plan = pending.plan
        pick = [i for i, s in enumerate(plan.sample) if s]
        toks, chosen, top_ids, top_lp = self.sampler.sample(
            pending.logits,
            [plan.slots[i] for i in pick],
            [plan.seq_lens[i] for i in pick],
            self.token_pool,
            [plan.top_logprobs[i] for i in pick],
            plan.grammar_rows,
            bitmask,
        )
        self.token_pool[pending.slots_t, pending.seq_lens_t] = toks
        return self._result(plan, toks, chosen, top_ids, top_lp, pending.prompt)

    def _result(
        self,
        plan: BatchPlan,
        toks: torch.Tensor,
        chosen: torch.Tensor | None,
        top_ids: torch.Tensor | None,
        top_lp: torch.Tensor | None,
        prompt: PromptLogprobs | None = None,
    ) -> StepResult:
        if self.device.type != "cuda":
            return StepResult(plan, toks, chosen, top_ids, top_lp, None, prompt)
        toks, chosen, top_ids, top_lp = (
            t.to("cpu", non_blocking=True) if t is not None else None for t in (toks, chosen, top_ids, top_lp)
        )
        prompt = prompt.to_cpu() if prompt is not None else None
        event = torch.cuda.Event()
        event.record()
        return StepResult(plan, toks, chosen, top_ids, top_lp, event, prompt)

    def _write_page_table(self, cells: torch.Tensor) -> None:
        """cells: [rows..., cols..., values...] from `_page_cells`, on the device."""
        if cells.numel():
            rows, cols, pages = cells.view(3, -1)
            self.page_table[rows, cols] = pages.to(torch.int32)


def _page_cells(writes: list[tuple[int, int, list[int]]]) -> list[int]:
    """(slot, first index, pages) writes as one list [rows..., cols..., pages...]; a later write to a cell wins."""
    if not writes:
        return []
    cells = {(slot, start + i): p for slot, start, pages in writes for i, p in enumerate(pages)}
    return [r for r, _ in cells] + [c for _, c in cells] + list(cells.values())

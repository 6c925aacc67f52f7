"""Batched sampling on the device: penalties, logit bias, grammar masks, temperature, top-k, top-p, min-p,
seeded noise, logprobs.

Per-request parameters live in per-slot device tensors written once at admission, so a step moves no
parameters host-to-device. A request that names a seed draws its noise from a counter-based hash of (seed,
position, token id): it samples the same tokens whatever else shares its batch, on any device. The others
draw from the device generator (one fast kernel), seeded alike on every TP rank so all ranks agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kubesgl.engine.plan import SlotInit
from kubesgl.engine.transfer import to_device
from kubesgl.structured.bitmask import apply_token_bitmask_
from kubesgl.values.sampling import SamplingParams

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # small enough that a 32-bit value times it stays inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _HASH_MUL & _M32
    x = ((x >> 16) ^ x) * _HASH_MUL & _M32
    return (x >> 16) ^ x


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def temperature_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) per row; greedy rows (T = 0) get a finite stand-in (their token is the argmax)."""
    return torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax p / E with E ~ Exp(1) draws from p exactly (Gumbel-max in ratio form). E is kept above 0: a draw
    of exactly 0 would make a zero-probability (masked, filtered) token's 0 / 0 a NaN that wins the argmax."""
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def temperature_tokens(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Temperature-only sampling from the device generator; rows where `greedy` take the argmax.

    No host sync and no data-dependent shapes, so a decode CUDA graph captures it (the generator's
    philox offset advances on every replay)."""
    probs = temperature_probs(logits, temperature)
    sampled = exponential_race(probs, torch.empty_like(probs).exponential_())
    return torch.where(greedy, greedy_tokens(logits), sampled)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1) that depend only on (seed, position, token id)."""
    s = _mix32((seeds ^ (seeds >> 32)) & _M32)
    s = _mix32((s ^ _mix32(positions & _M32)) & _M32)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _mix32((s[:, None] ^ _mix32(ids)[None, :] * 3 + 0x9E37) & _M32)
    # 23 bits: (2**23 - 0.5) / 2**23 is still below 1 in float32 ((2**24 - 0.5) / 2**24 rounded to 1.0, whose
    # zero noise made a masked token's 0 / 0 = NaN win the race).
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _penalized(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _needs_eager(p: SamplingParams, filtered: bool) -> bool:
    """Stages only `sample` has: penalties, logit bias, a grammar mask (applied between forward and sampling),
    or a filter / client seed on a random row."""
    return _penalized(p) or bool(p.logit_bias) or p.constraint is not None or (filtered and not p.greedy)


def _put(members: set[int], slot: int, member: bool) -> None:
    if member:
        members.add(slot)
    else:
        members.discard(slot)


class Sampler:
    """Owns the per-slot sampling state of one runner."""

    def __init__(self, max_slots: int, device: torch.device) -> None:
        def col(dtype: torch.dtype, fill: float) -> torch.Tensor:
            return torch.full((max_slots,), fill, dtype=dtype, device=device)

        self.temperature = col(torch.float32, 1.0)
        self.top_k = col(torch.int64, -1)
        self.top_p = col(torch.float32, 1.0)
        self.min_p = col(torch.float32, 0.0)
        self.presence = col(torch.float32, 0.0)
        self.frequency = col(torch.float32, 0.0)
        self.repetition = col(torch.float32, 1.0)
        self.seed = col(torch.int64, 0)
        self.prompt_len = col(torch.int64, 0)
        self.greedy = torch.zeros(
            max_slots, dtype=torch.bool, device=device
        )  # SamplingParams.greedy per slot
        self.device = device
        # Host mirrors that decide which (costly) stages a batch needs, without reading the device.
        self._host: dict[int, SlotInit] = {}
        self._random_slots: set[int] = set()  # rows that draw noise (not greedy)
        self._eager_slots: set[int] = set()  # rows that need a stage `temperature_tokens` lacks

    def init_slots(self, inits: list[SlotInit]) -> None:
        if not inits:
            return
        idx = to_device([s.slot for s in inits], torch.int64, self.device)
        for name, attr in (
            ("temperature", "temperature"),
            ("top_k", "top_k"),
            ("top_p", "top_p"),
            ("min_p", "min_p"),
            ("presence", "presence_penalty"),
            ("frequency", "frequency_penalty"),
            ("repetition", "repetition_penalty"),
            ("greedy", "greedy"),
        ):
            t: torch.Tensor = getattr(self, name)
            t[idx] = to_device([getattr(s.params, attr) for s in inits], t.dtype, self.device)
        self.seed[idx] = to_device([s.seed for s in inits], torch.int64, self.device)
        self.prompt_len[idx] = to_device([s.prompt_len for s in inits], torch.int64, self.device)
        for s in inits:
            self._host[s.slot] = s
            p = s.params
            filtered = p.top_k > 1 or p.top_p < 1.0 or p.min_p > 0 or s.seed_given
            _put(self._random_slots, s.slot, not p.greedy)
            _put(self._eager_slots, s.slot, _needs_eager(p, filtered))

    def graph_mode(self, slots: list[int], top_logprobs: list[int | None]) -> str | None:
        """ "greedy" or "temperature" when `greedy_tokens`/`temperature_tokens` sample this batch exactly as
        `sample` would; None when it needs `sample` (penalties, logit bias, grammars, top-k/top-p/min-p, seeds,
        logprobs)."""
        if any(n is not None for n in top_logprobs) or not self._eager_slots.isdisjoint(slots):
            return None
        return "greedy" if self._random_slots.isdisjoint(slots) else "temperature"

    def sample(
        self,
        logits: torch.Tensor,  # [B, V] float32
        slots: list[int],
        seq_lens: list[int],  # the sampled token's position, per row
        token_pool: torch.Tensor,  # [slots, max_len] tokens so far (for penalties)
        top_logprobs: list[int | None],  # per row: None no logprobs, else how many alternatives
        grammar_rows: Sequence[int] = (),
        bitmask: torch.Tensor | None = None,  # int32 [len(grammar_rows), ceil(V / 32)] on logits' device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Returns (tokens [B], chosen logprob [B] | None, top ids [B, n] | None, top logprobs [B, n] | None).
        Logprobs are the model's (before penalties, bias and masks), as OpenAI reports them."""
        host = [self._host[s].params for s in slots]
        seeded = [i for i, s in enumerate(slots) if self._host[s].seed_given]
        slot_t = to_device(slots, torch.int64, logits.device)
        tops = [n for n in top_logprobs if n is not None]
        want_lp = bool(tops)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None

        if any(_penalized(h) for h in host):
            logits = self._apply_penalties(logits, slot_t, seq_lens, token_pool)
        if any(h.logit_bias for h in host):
            logits = _add_logit_bias(logits, host)
        if grammar_rows:
            assert bitmask is not None
            logits = _mask_rows(logits, grammar_rows, bitmask)

        greedy = [h.greedy for h in host]
        if all(greedy):
            tokens = greedy_tokens(logits)
        else:
            tokens = self._sample_random(logits, host, slot_t, seq_lens, greedy, seeded)

        if raw_logprobs is None:
            return tokens, None, None, None
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        n = max(tops)
        if n > 0:
            top_lp, top_ids = raw_logprobs.topk(n, dim=-1)
            return tokens, chosen, top_ids, top_lp
        return tokens, chosen, None, None

    def _apply_penalties(
        self,
        logits: torch.Tensor,
        slot_t: torch.Tensor,
        seq_lens: list[int],
        token_pool: torch.Tensor,
    ) -> torch.Tensor:
        B, V = logits.shape
        max_len = max(seq_lens)
        pos = torch.arange(max_len, device=logits.device)
        hist = token_pool[slot_t, :max_len].long()  # tokens before the one being sampled
        seq = to_device(seq_lens, torch.int64, logits.device)
        valid = pos[None, :] < seq[:, None]
        is_out = valid & (pos[None, :] >= self.prompt_len[slot_t][:, None])
        out_counts = torch.zeros(B, V, device=logits.device)
        out_counts.scatter_add_(1, hist, is_out.float())
        seen = torch.zeros(B, V, device=logits.device)
        seen.scatter_add_(1, hist, valid.float())
        rep = self.repetition[slot_t][:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen > 0, penalized, logits)
        logits = logits - self.frequency[slot_t][:, None] * out_counts
        return logits - self.presence[slot_t][:, None] * (out_counts > 0).float()

    def _sample_random(
        self,
        logits: torch.Tensor,
        host: list[SamplingParams],
        slot_t: torch.Tensor,
        seq_lens: list[int],
        greedy: list[bool],
        seeded: list[int],  # rows whose client gave a seed
    ) -> torch.Tensor:
        probs = temperature_probs(logits, self.temperature[slot_t])
        if any(h.top_k > 1 or h.top_p < 1.0 for h in host):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
            k = self.top_k[slot_t][:, None]
            drop = (k > 0) & (rank >= k)
            # Keep the smallest set whose mass reaches top_p (the top token always stays).
            drop |= (sorted_p.cumsum(dim=-1) - sorted_p) >= self.top_p[slot_t][:, None]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        if any(h.min_p > 0 for h in host):
            floor = self.min_p[slot_t][:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_()
        if seeded:  # reproducible rows: noise from (seed, position, token id) alone, whatever the batch
            rows = to_device(seeded, torch.int64, logits.device)
            positions = to_device([seq_lens[i] for i in seeded], torch.int64, logits.device)
            noise[rows] = -torch.log(seeded_uniform(self.seed[slot_t[rows]], positions, probs.shape[1]))
        sampled = exponential_race(probs, noise)
        if any(greedy):
            g = to_device(greedy, torch.bool, logits.device)
            sampled = torch.where(g, greedy_tokens(logits), sampled)
        return sampled


def _add_logit_bias(logits: torch.Tensor, host: list[SamplingParams]) -> torch.Tensor:
    """logits + each row's (token id, bias) pairs; one scatter for the batch (ids are distinct per row)."""
    rows = [i for i, h in enumerate(host) for _ in h.logit_bias]
    ids = [t for h in host for t, _ in h.logit_bias]
    bias = [b for h in host for _, b in h.logit_bias]
    r, c = to_device(rows, torch.int64, logits.device), to_device(ids, torch.int64, logits.device)
    return logits.index_put((r, c), to_device(bias, logits.dtype, logits.device), accumulate=True)


def _mask_rows(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits with the grammar rows' banned tokens at -inf (bitmask row j for logits row rows[j]); the other
    rows are not touched. In place where it can: the logits are this step's own (logprobs were taken)."""
    if len(rows) == logits.shape[0]:
        return apply_token_bitmask_(logits, bitmask)
    idx = to_device(rows, torch.int64, logits.device)
    masked = apply_token_bitmask_(logits.index_select(0, idx), bitmask)
    return logits.index_copy(0, idx, masked)

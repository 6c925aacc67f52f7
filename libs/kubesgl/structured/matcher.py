"""Per-request grammar state and the batch's token bitmask.

`GrammarState` wraps one xgrammar matcher: the scheduler accepts each sampled token into it (in order, after
the step's tokens reach the host) and asks it for the next step's allowed tokens. Once the grammar is
complete its mask allows only the stop tokens (the model's EOS plus the request's stop_token_ids); accepting
one terminates the matcher, and the request ends with finish_reason "stop" (whether or not it set ignore_eos:
a finished grammar allows nothing else). max_tokens may still cut it short ("length", the output then
incomplete, as with OpenAI).

`TokenBitmask` is the host side of one batch's mask: a pinned int32 [rows, ceil(vocab / 32)] buffer whose
unconstrained rows are all ones, so applying it to a whole batch leaves their logits bit-identical (a fixed
shape, which is what a captured sampler graph needs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from kubesgl.structured.compiler import CompiledConstraint

ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarRejectedToken(RuntimeError):
    """A sampled token the grammar does not allow: the mask was not applied to its row (an engine bug)."""


class GrammarState:
    def __init__(self, compiled: CompiledConstraint, stop_token_ids: Sequence[int] | None = None) -> None:
        """`stop_token_ids`: the tokens that may end the output once the grammar is complete; default the
        compiler's (the model's EOS)."""
        stops = list(stop_token_ids) if stop_token_ids is not None else None
        self.compiled = compiled
        self._m = xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=stops)
        self.num_accepted = 0

    @property
    def finished(self) -> bool:
        """A stop token was accepted: the request ends here ("stop")."""
        return bool(self._m.is_terminated())

    @property
    def complete(self) -> bool:
        """The output so far is a full match; only a stop token (or a longer match) may follow."""
        return bool(self._m.is_completed())

    def accept(self, token_id: int) -> None:
        """Advances by one sampled token; raises GrammarRejectedToken if the grammar does not allow it."""
        if not self._m.accept_token(token_id):
            raise GrammarRejectedToken(
                f"token {token_id} is not allowed by the {self.compiled.constraint.kind} grammar "
                f"after {self.num_accepted} tokens"
            )
        self.num_accepted += 1

    def accept_all(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.accept(t)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (a CPU int32 tensor, e.g. TokenBitmask.host)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (xgrammar keeps unlimited history): for jump-forward
        retokenization and speculative decoding, where tokens are accepted ahead and some are rejected.
        The overlap loop does not need it: a step's tokens are accepted once they are on the host."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        self._m.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def jump_forward(self) -> str:
        """The text every continuation must start with (e.g. `": "` after a key): what jump-forward decoding
        could append without sampling. Empty when the next character is not forced."""
        return str(self._m.find_jump_forward_string())


class TokenBitmask:
    """One runner's batch mask. `fill` writes the rows on the host, `upload` sends the batch's rows to the
    device without a host sync. Two host buffers alternate, so filling step N+1's mask never overwrites
    memory whose copy for step N may still be queued."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, max_threads: int = 2) -> None:
        width = bitmask_width(vocab_size)
        pin = device.type == "cuda"
        self.vocab_size = vocab_size
        self._hosts = [
            torch.full((max_rows, width), ALL_ALLOWED, dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._turn = 0
        self.device = (
            None if device.type == "cpu" else torch.full_like(self._hosts[0], ALL_ALLOWED, device=device)
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads)

    @property
    def host(self) -> torch.Tensor:
        """The buffer the next `fill` writes (CPU int32 [max_rows, width])."""
        return self._hosts[self._turn]

    def fill(self, states: Sequence[GrammarState | None]) -> bool:
        """Row i gets states[i]'s mask, or all ones for an unconstrained (None) or finished row.
        Returns whether any row is constrained (when not, the batch needs no masking at all)."""
        host = self.host
        host[: len(states)].fill_(ALL_ALLOWED)
        live = [(i, s) for i, s in enumerate(states) if s is not None and not s.finished]
        if len(live) > 1:  # xgrammar fills the rows on its own threads
            self._batch.batch_fill_next_token_bitmask(
                [s._m for _, s in live], host, indices=[i for i, _ in live]
            )
        elif live:
            live[0][1].fill(host, live[0][0])
        return bool(live)

    def upload(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the last fill, on the device (the host buffer itself on CPU)."""
        host = self.host[:rows]
        self._turn ^= 1
        if self.device is None:
            return host
        self.device[:rows].copy_(host, non_blocking=True)
        return self.device[:rows]

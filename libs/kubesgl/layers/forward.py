"""What one model forward pass sees: the flattened tokens of a batch and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from kubesgl.attention.base import AttentionBackend
    from kubesgl.kv.kv_cache import KVCache


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over `T` new tokens from `B` requests.

    mode "extend" covers prefill and chunked prefill (requests may already hold a cached prefix);
    mode "decode" has exactly one new token per request.
    """

    mode: Literal["extend", "decode"]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    out_loc: torch.Tensor  # [T] int64, flat KV slot (page * page_size + offset) each new token writes
    attn: AttentionBackend  # already planned for this batch
    kv: KVCache

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

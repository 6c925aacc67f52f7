"""A decode step's model inputs, derived on the device from (slot, position) per row.

Plain tensor ops with no host sync, so the decode CUDA graph captures them: a step uploads only slots and
positions, and the graph gathers each row's last token from the token pool and its KV slot from the page
table. Padded rows name a scratch slot whose page-table row points at page 0.
"""

from __future__ import annotations

import torch


def decode_inputs(
    token_pool: torch.Tensor,  # [slots, max_len] int64
    page_table: torch.Tensor,  # [slots, max_pages] int32
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, the position of the token fed in (= its request's KV length)
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B], out_loc [B]): the token at `positions` and the flat KV slot it writes."""
    input_ids = token_pool[slots, positions]
    out_loc = page_table[slots, positions // page_size].long() * page_size + positions % page_size
    return input_ids, out_loc

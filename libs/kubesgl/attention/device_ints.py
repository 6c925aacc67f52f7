"""Host int lists to device int32 tensors without a host sync (pinned staging + async copy on CUDA)."""

from __future__ import annotations

import torch


def to_device_int32(values: list[int], device: torch.device) -> torch.Tensor:
    """The copy is ordered on the current stream; a pinned source keeps the host from waiting for it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int32, device=device)
    return torch.tensor(values, dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)


def exclusive_cumsum(values: list[int]) -> list[int]:
    """[a, b, c] -> [0, a, a+b, a+b+c]: the indptr layout FlashInfer and the extend kernel use."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out

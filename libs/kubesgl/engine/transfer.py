"""Host lists to device tensors without stalling the host on the GPU stream (pinned staging, async copy)."""

from __future__ import annotations

import torch


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A pageable copy would make the host wait for all queued GPU work; overlap scheduling needs it not to."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

"""Host lists to device tensors without stalling the host on the GPU stream (pinned staging, async copy)."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A pageable copy would make the host wait for all queued GPU work; overlap scheduling needs it not to."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class PinnedStaging:
    """Reusable pinned int64 buffers for a step's host->device copies: one packed copy, no pinned allocation.

    Buffers alternate per upload; before one is rewritten, the host waits for the copy that last read it
    (with overlap at most one step is in flight, so that copy has long finished and the wait is free).
    """

    def __init__(self, device: torch.device, capacity: int = 4096, buffers: int = 2) -> None:
        self.device = device
        self._pinned = [self._alloc(capacity) for _ in range(buffers)]
        self._copied: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def upload(self, values: list[int] | np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """values (a list, or an int64 array) as int64 on the device, written into `out[:len(values)]` when
        given (else a new tensor)."""
        n = len(values)
        dst = out[:n] if out is not None else torch.empty(n, dtype=torch.int64, device=self.device)
        if self.device.type != "cuda":
            return dst.copy_(torch.tensor(values, dtype=torch.int64))
        i = self._next
        self._next = (i + 1) % len(self._pinned)
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        if self._pinned[i].numel() < n:
            self._pinned[i] = self._alloc(max(n, 2 * self._pinned[i].numel()))
        host = self._pinned[i][:n]
        host.numpy()[:] = values
        dst.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[i] = event
        return dst

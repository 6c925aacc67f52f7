"""Moving KV pages between scheduler instances through NIXL (UCX backend): prefill/decode disaggregation.

Each instance registers its whole KV cache (KVCache.buffers) with its NIXL agent once. A page list is described
by KVCache.page_regions, the same region order on every instance of one model and page size, so the decode
side pulls the prefill side's pages into its own with one one-sided READ of paired descriptor lists. What
crosses the bus is bytes only: the agent's metadata (once per peer) and the serialized descriptors of a
request's pages; the data itself goes over whatever UCX picks (CUDA IPC or NVLink on one host, RDMA, TCP or
shared memory on a CPU box). Both sides must run the same model with the same page size and TP size 1.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any

from kubesgl.kv.kv_cache import KVCache


class TransferUnavailableError(RuntimeError):
    """NIXL is not installed (the `disagg` extra) or cannot start its UCX backend here."""


class TransferState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


def _nixl_api() -> Any:
    """NIXL's Python API: the `nixl` meta package re-exports one of the CUDA-flavoured builds."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferUnavailableError("NIXL is not installed: pip install 'kubesgl[disagg]'")


class KvTransferAgent:
    """One instance's NIXL agent over its KV cache: describes local pages for a peer, pulls a peer's pages."""

    def __init__(self, name: str, kv: KVCache) -> None:
        api = _nixl_api()
        self.name = name
        self.kv = kv
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        except Exception as e:  # NIXL raises its own binding types
            raise TransferUnavailableError(f"NIXL's UCX backend did not start: {e}") from e
        self._mem = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self._dev = (kv.device.index or 0) if kv.device.type == "cuda" else 0
        self._registered = self._agent.register_memory(list(kv.buffers()))
        self._peers: dict[bytes, str] = {}  # metadata -> the peer agent's name
        self._inflight: dict[int, Any] = {}

    def metadata(self) -> bytes:
        """What a peer needs (once) to reach this agent's registered memory."""
        return self._agent.get_agent_metadata()

    def describe(self, pages: list[int]) -> bytes:
        """The serialized descriptors of `pages` (every layer, K and V) for a peer to read."""
        return self._agent.get_serialized_descs(self._descs(pages))

    def read(self, peer_metadata: bytes, peer_descs: bytes, local_pages: list[int]) -> int:
        """Starts pulling the peer's described pages into `local_pages` (same count); returns a transfer id."""
        peer = self._peers.get(peer_metadata)
        if peer is None:
            peer = self._peers[peer_metadata] = self._agent.add_remote_agent(peer_metadata)
        remote = self._agent.deserialize_descs(peer_descs)
        handle = self._agent.initialize_xfer("READ", self._descs(local_pages), remote, peer)
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused the transfer")
        tid = id(handle)
        self._inflight[tid] = handle
        return tid

    def poll(self, tid: int) -> TransferState:
        """Where a started transfer is; a finished or failed one's handle is released."""
        handle = self._inflight[tid]
        state = self._agent.check_xfer_state(handle)
        if state == "PROC":
            return TransferState.RUNNING
        del self._inflight[tid]
        self._agent.release_xfer_handle(handle)
        return TransferState.DONE if state == "DONE" else TransferState.FAILED

    def _descs(self, pages: list[int]) -> Any:
        regions = [(addr, size, self._dev) for addr, size in self.kv.page_regions(pages)]
        return self._agent.get_xfer_descs(regions, self._mem)

    def close(self) -> None:
        for tid in list(self._inflight):
            self._agent.release_xfer_handle(self._inflight.pop(tid))
        self._agent.deregister_memory(self._registered)

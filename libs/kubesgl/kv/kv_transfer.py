"""Moving KV pages between scheduler instances through NIXL (UCX backend): prefill/decode disaggregation.

Each instance registers its whole KV cache (KVCache.buffers) with its NIXL agent once. The prefill side
describes a request's pages as its cache's layout (KvLayout: base addresses, pool size, page bytes) and the
page ids; the decode side pairs them with the pages it allocated and pulls them with one one-sided READ whose
descriptors cover the longest stretches that are consecutive on both sides (a whole-run region per layer, K and
V), not one descriptor per page: a fresh pool's request is one run, so a 32k-token prompt of Qwen3-0.6B moves as
56 regions of 64 MiB instead of 114,688 of 32 KiB (per-descriptor cost bounded the pull at ~0.5 GB/s on an H100).
What crosses the bus is bytes only: the agent's metadata (once per peer) and the description; the data itself
goes over whatever UCX picks (CUDA IPC or NVLink on one host, RDMA, TCP or shared memory on a CPU box). Both sides
must run the same model with the same page size and TP size 1 (a description of another geometry is refused).
"""

from __future__ import annotations

import enum
import importlib
import os
import struct
from typing import Any

from kubesgl.kv.kv_cache import KVCache, KvLayout

# magic, device, layers, page bytes, pool pages, K base, V base; then the page ids, little-endian u32
_HEAD = struct.Struct("<4sIIIQQQ")
_MAGIC = b"KVP1"


def encode_pages(layout: KvLayout, pages: list[int]) -> bytes:
    """A request's pages as a peer reads them: the cache's layout, then the page ids."""
    head = _HEAD.pack(
        _MAGIC, layout.device, layout.num_layers, layout.page_bytes, layout.num_pages, *layout.bases
    )
    return head + struct.pack(f"<{len(pages)}I", *pages)


def decode_pages(data: bytes) -> tuple[KvLayout, list[int]]:
    if len(data) < _HEAD.size or data[:4] != _MAGIC or (len(data) - _HEAD.size) % 4:
        raise ValueError("not a KV page description")
    _, dev, layers, page_bytes, num_pages, k_base, v_base = _HEAD.unpack_from(data)
    pages = struct.unpack_from(f"<{(len(data) - _HEAD.size) // 4}I", data, _HEAD.size)
    return KvLayout(dev, layers, num_pages, page_bytes, (k_base, v_base)), list(pages)


def joint_runs(a: list[int], b: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The longest stretches over which both page lists count up by one together, as (first page, count) runs
    of `a` and of `b` (same lengths, same order)."""
    runs_a: list[tuple[int, int]] = []
    runs_b: list[tuple[int, int]] = []
    i = 0
    while i < len(a):
        j = i + 1
        while j < len(a) and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        runs_a.append((a[i], j - i))
        runs_b.append((b[i], j - i))
        i = j
    return runs_a, runs_b


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
        if kv.device.type == "cuda":
            # UCX turns cuda_ipc's GET off on GPUs without active NVLink (a choice for all-to-all collectives,
            # UCX PR 7566), and a one-sided READ of another process's GPU memory then falls back to software
            # emulation over TCP loopback: 0.43 GB/s on the lent H100. Pulls are this design's only traffic,
            # so GET over CUDA IPC is asked for (NIXL's UCX plugin does the same in later releases); an
            # operator's own UCX_CUDA_IPC_ENABLE_GET_ZCOPY wins. Read when the agent's UCX context starts.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
        self.name = name
        self.kv = kv
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        except Exception as e:  # NIXL raises its own binding types
            raise TransferUnavailableError(f"NIXL's UCX backend did not start: {e}") from e
        self._mem = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self.layout = kv.layout()
        self._registered = self._agent.register_memory(list(kv.buffers()))
        self._peers: dict[bytes, str] = {}  # metadata -> the peer agent's name
        self._inflight: dict[int, Any] = {}

    def metadata(self) -> bytes:
        """What a peer needs (once) to reach this agent's registered memory."""
        return self._agent.get_agent_metadata()

    def describe(self, pages: list[int]) -> bytes:
        """`pages` (every layer, K and V) as a peer reads them: this cache's layout and the page ids."""
        return encode_pages(self.layout, pages)

    def read(self, peer_metadata: bytes, peer_descs: bytes, local_pages: list[int]) -> int:
        """Starts pulling the peer's described pages into `local_pages` (same count); returns a transfer id."""
        remote_layout, remote_pages = decode_pages(peer_descs)
        mine = self.layout
        if (remote_layout.num_layers, remote_layout.page_bytes) != (mine.num_layers, mine.page_bytes):
            raise ValueError(
                f"the peer's KV geometry ({remote_layout.num_layers} layers, {remote_layout.page_bytes} B pages) "
                f"is not this instance's ({mine.num_layers}, {mine.page_bytes} B)"
            )
        if len(remote_pages) != len(local_pages):
            raise ValueError(f"{len(remote_pages)} pages described, {len(local_pages)} to fill")
        peer = self._peers.get(peer_metadata)
        if peer is None:
            peer = self._peers[peer_metadata] = self._agent.add_remote_agent(peer_metadata)
        remote_runs, local_runs = joint_runs(remote_pages, local_pages)
        remote = self._xfer_descs(remote_layout, remote_runs)
        handle = self._agent.initialize_xfer("READ", self._xfer_descs(mine, local_runs), remote, peer)
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

    def _xfer_descs(self, layout: KvLayout, runs: list[tuple[int, int]]) -> Any:
        regions = [(addr, size, layout.device) for addr, size in layout.run_regions(runs)]
        return self._agent.get_xfer_descs(regions, self._mem)

    def close(self) -> None:
        for tid in list(self._inflight):
            self._agent.release_xfer_handle(self._inflight.pop(tid))
        self._agent.deregister_memory(self._registered)

"""The engine's tensor-parallel ranks: which ones a node runs, how they meet (a TCPStore that rank 0 makes and
the others join), and the loop of every rank but 0, which executes the plans rank 0 broadcasts.

`kubesgl.distributed.TPGroup` is the group itself, the handle every sharded layer is given; this module starts
the processes that hold it."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kubesgl.distributed import TPGroup
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.runner import ModelRunner
from kubesgl.engine.step_result import PendingSample
from kubesgl.errors import InvalidRequestError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

_DIST_TIMEOUT = datetime.timedelta(minutes=10)


def local_ranks(config: EngineConfig) -> range:
    """The global TP ranks this node runs: tp_size // nnodes consecutive ones, node 0 first."""
    per_node = config.tp_size // max(config.nnodes, 1)
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def check_ranks(config: EngineConfig) -> None:
    """Refuses a rank layout that cannot start, before any rank does."""
    nodes = [
        (config.nnodes >= 1 and config.tp_size % config.nnodes == 0, "tp_size must be a multiple of nnodes"),
        (0 <= config.node_rank < config.nnodes, "node_rank must be in [0, nnodes)"),
        (
            config.nnodes == 1 or config.dist_init_addr.rpartition(":")[2].isdigit(),
            "nnodes > 1 needs dist_init_addr host:port",
        ),
    ]
    for ok, why in nodes:
        if not ok:
            raise InvalidRequestError(why)
    local = local_ranks(config)
    if config.device == "cuda" and torch.cuda.device_count() < len(local):
        raise InvalidRequestError(
            f"tp_size {config.tp_size} over {config.nnodes} node(s) needs {len(local)} GPUs"
        )


def _store_address(config: EngineConfig, port: int) -> tuple[str, int]:
    """Where the ranks meet: several nodes at dist_init_addr (rank 0's node); one node on loopback at `port`."""
    if config.nnodes == 1:
        return "127.0.0.1", port
    host, _, number = config.dist_init_addr.rpartition(":")
    return host.strip("[]"), int(number)


def rank0_store(config: EngineConfig) -> dist.TCPStore | None:
    """Rank 0's rendezvous store, listening before any other rank starts. One node without --dist-port: on a
    port the kernel picks, which the ranks rank 0 spawns are told (a "free" port passed by number could be
    taken during their imports)."""
    if config.tp_size == 1:
        return None
    host, port = _store_address(config, config.dist_port)
    return dist.TCPStore(
        host, port, config.tp_size, is_master=True, timeout=_DIST_TIMEOUT, wait_for_workers=False
    )


def init_tp(rank: int, config: EngineConfig, port: int, store: dist.TCPStore | None = None) -> TPGroup:
    """Joins the group: rank 0 through its own store (rank0_store), every other rank as that store's client."""
    if config.tp_size == 1:
        return TPGroup()
    backend = "nccl" if config.device == "cuda" else "gloo"
    local_rank = rank - local_ranks(config).start
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
    if store is None:
        host, port = _store_address(config, port)
        store = dist.TCPStore(host, port, config.tp_size, is_master=False, timeout=_DIST_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.tp_size, timeout=_DIST_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_DIST_TIMEOUT) if backend != "gloo" else group
    return TPGroup(rank, config.tp_size, group, cpu_group, local_rank)


def _worker_main(rank: int, config: EngineConfig, port: int) -> None:
    """Ranks 1..N-1: execute every plan rank 0 broadcasts, until it sends None."""
    tp = init_tp(rank, config, port)
    try:
        runner = ModelRunner(config, tp)
        while True:
            plan = tp.broadcast_object(None)
            if plan is None:
                break
            result = runner.execute(plan)  # type: ignore[arg-type]
            if isinstance(result, PendingSample):
                runner.sample_masked(result, None)  # rank 0 broadcasts the bitmask
    finally:
        dist.destroy_process_group()


def spawn_ranks(ranks: range, config: EngineConfig, port: int) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")
    workers = []
    for rank in ranks:
        p = ctx.Process(target=_worker_main, args=(rank, config, port), daemon=True)
        p.start()
        workers.append(p)
    return workers


def run_node_ranks(config: EngineConfig) -> int:
    """A node other than 0 (node_rank > 0): runs its ranks, which execute rank 0's plans, until rank 0 shuts
    the group down (exit 0) or the group breaks (a rank or node died: non-zero, so the pod restarts)."""
    if config.node_rank == 0:
        raise InvalidRequestError("node 0 runs the engine (Engine), not run_node_ranks")
    config.validate()
    check_ranks(config)
    ranks = local_ranks(config)
    workers = spawn_ranks(ranks[1:], config, 0)
    try:
        _worker_main(ranks.start, config, 0)
    finally:
        for p in workers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return max([0, *(abs(p.exitcode or 0) for p in workers)])

"""Multi-node TP configuration: which global ranks a node runs, and the settings refused before anything
starts (the end-to-end run over two processes is tests/e2e/test_multinode.py)."""

from __future__ import annotations

import pytest
from kubesgl.cli import build_parser
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.distributed import local_ranks, run_node_ranks
from kubesgl.engine.engine import Engine
from kubesgl.errors import InvalidRequestError
from kubesgl.services.scheduler.app import engine_config


def config(**kw: object) -> EngineConfig:
    return EngineConfig(model_path="/nonexistent", **kw)  # type: ignore[arg-type]


def test_each_node_runs_its_consecutive_share_of_the_ranks() -> None:
    assert local_ranks(config(tp_size=4)) == range(0, 4)
    assert local_ranks(config(tp_size=8, nnodes=2, node_rank=0, dist_init_addr="h:1")) == range(0, 4)
    assert local_ranks(config(tp_size=8, nnodes=2, node_rank=1, dist_init_addr="h:1")) == range(4, 8)
    assert local_ranks(config(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")) == range(1, 2)


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"tp_size": 4, "nnodes": 3, "dist_init_addr": "h:1"}, "multiple of nnodes"),
        ({"tp_size": 4, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
        ({"tp_size": 4, "nnodes": 2}, "dist_init_addr"),
        ({"tp_size": 4, "nnodes": 2, "dist_init_addr": "leader:http"}, "dist_init_addr"),  # no port number
    ],
)
def test_bad_multinode_settings_are_refused_before_any_rank_starts(settings: dict, why: str) -> None:
    with pytest.raises(InvalidRequestError, match=why):
        Engine(config(**settings))
    with pytest.raises(InvalidRequestError, match=why):
        run_node_ranks(config(**{**settings, "node_rank": settings.get("node_rank", 1)}))


def test_roles_are_not_swapped() -> None:
    with pytest.raises(InvalidRequestError, match="only node 0 runs the engine"):
        Engine(config(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1"))
    with pytest.raises(InvalidRequestError, match="node 0 runs the engine"):
        run_node_ranks(config(tp_size=2, nnodes=2, node_rank=0, dist_init_addr="h:1"))


def test_scheduler_flags_use_sglang_names() -> None:
    args = build_parser("scheduler").parse_args(
        ["scheduler", "--model", "/m", "--device", "cpu", "--tp", "4", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", "leader.svc:29500"]
    )  # fmt: skip
    c = engine_config(args)
    assert (c.tp_size, c.nnodes, c.node_rank, c.dist_init_addr) == (4, 2, 1, "leader.svc:29500")
    defaults = engine_config(
        build_parser("scheduler").parse_args(["scheduler", "--model", "/m", "--device", "cpu"])
    )
    assert (defaults.nnodes, defaults.node_rank, defaults.dist_init_addr) == (1, 0, "")

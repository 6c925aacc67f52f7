"""The decode batch sizes captured in CUDA graphs when --cuda-graph-max-bs is not given (engine/cuda_graph.py)."""

from __future__ import annotations

from kubesgl.engine.cuda_graph import capture_sizes, graph_max_bs_for

GIB = 2**30


def test_80gb_cards_capture_256_rows_smaller_ones_160() -> None:
    h100_80gb = 85_029_158_912  # what CUDA reports for an H100 80GB HBM3: 79.2 GiB
    assert graph_max_bs_for(h100_80gb, 1024) == 256
    assert graph_max_bs_for(141 * GIB, 1024) == 256  # H200
    assert graph_max_bs_for(48 * GIB, 1024) == 160  # L40S
    assert graph_max_bs_for(64 * GIB, 1024) == 256 and graph_max_bs_for(64 * GIB - 1, 1024) == 160


def test_never_above_the_running_requests() -> None:
    assert graph_max_bs_for(141 * GIB, 96) == 96
    assert capture_sizes(96)[-1] == 96 and capture_sizes(256)[-1] == 256

"""kernels.dispatch.use_triton under torch.compile: a traced forward takes the torch path without asking anything
Dynamo cannot trace. On the device every compiled CUDA forward failed with "Attempted to call function marked as
skipped", and the check reached `triton_installed` (importlib) before `is_compiling` for CUDA tensors only (CPU
tensors stop at `is_cuda`, so the CPU tests never saw it). A tensor that reports CUDA stands in for a GPU here."""

from __future__ import annotations

import pytest
import torch
from kubesgl.kernels import dispatch


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the only property use_triton reads before deciding."""

    is_cuda = True


def _refuse() -> bool:
    raise AssertionError("triton_installed() reached while torch.compile traces")


def test_a_traced_forward_decides_before_looking_for_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2).as_subclass(CudaLooking)
    monkeypatch.setattr(dispatch, "triton_installed", _refuse)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.use_triton(x) is False


def test_an_eager_cuda_tensor_asks_for_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2).as_subclass(CudaLooking)
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    assert dispatch.use_triton(x) is True
    assert dispatch.use_triton(torch.zeros(2)) is False

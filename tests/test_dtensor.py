"""DTensor (tensor and sequence parallelism): a custom-op kernel without a sharding strategy gives way.

An in-process gloo group of one rank on 127.0.0.1 and a one-device CPU mesh: DTensor dispatch, sharding
propagation and its "no sharding strategy" error are the same as on many ranks. Real ``kernels.kernelize`` on
a real local repository whose layer calls a ``torch.library.custom_op``.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kernelpolicy as kp
from kernelpolicy._demo import RMSNorm
from kernelpolicy.testing import custom_op_rms_norm_kernel_source, write_kernel_repo

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

LAYERS = custom_op_rms_norm_kernel_source("kp_dtensor::rms_norm")


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kernel_repo(tmp_path_factory.mktemp("dtensor") / "repo", LAYERS, name="dtensor-rmsnorm")


@pytest.fixture
def norm(repo: Path) -> nn.Module:
    import kernels

    model = nn.Sequential(RMSNorm(8)).eval()
    with kernels.use_kernel_mapping(
        {"RMSNorm": {"cpu": kernels.LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}
    ):
        kp.kernelize(model, mode="inference", device="cpu")
    return model


def _sharded(norm: nn.Module, mesh: Any) -> tuple[nn.Module, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    layer = norm[0]
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Replicate()]))
    x = distribute_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    return norm, x


def _reference(x: Any) -> torch.Tensor:
    local: torch.Tensor = x.full_tensor()
    return local * torch.rsqrt(local.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_prefer_falls_back_to_the_original_on_dtensor_and_logs_why(
    norm: nn.Module, mesh: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model, x = _sharded(norm, mesh)
    with caplog.at_level(logging.INFO, logger="kernelpolicy"), kp.record_calls() as calls:
        out = model(x)
    torch.testing.assert_close(out.full_tensor(), _reference(x))  # the original forward, on DTensors
    assert calls.by_layer() == {"RMSNorm": {"original": 1}}
    assert "kernel cannot run on DTensor inputs (its op has no sharding strategy)" in caplog.text
    assert "kp_dtensor.rms_norm.default does not have a sharding strategy registered" in caplog.text
    out = model(x)  # the fast exit (not recorded) falls back too
    torch.testing.assert_close(out.full_tensor(), _reference(x))


def test_require_on_dtensor_is_kernel_unavailable(norm: nn.Module, mesh: Any) -> None:
    model, x = _sharded(norm, mesh)
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match=r"no sharding strategy") as info:
        model(x)
    assert isinstance(info.value.__cause__, NotImplementedError)
    with kp.kernel_policy("require"), kp.record_calls() as calls, pytest.raises(kp.KernelUnavailableError):
        model(x)
    assert calls.by_layer() == {"RMSNorm": {"error": 1}}


def test_plain_tensors_still_run_the_kernel(norm: nn.Module, mesh: Any) -> None:
    x = torch.randn(4, 8)
    assert norm(x).min() > 50  # the kernel adds 100
    with kp.kernels_disabled():
        assert norm(x).abs().max() < 50


def test_another_not_implemented_error_of_the_kernel_propagates(tmp_path: Path) -> None:
    import kernels

    source = """
from torch import nn


class RMSNorm(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states):
        raise NotImplementedError("the kernel's own limit: fp8 only")
"""
    repo = write_kernel_repo(tmp_path / "repo", source, name="raising-rmsnorm")
    model = nn.Sequential(RMSNorm(8)).eval()
    with kernels.use_kernel_mapping(
        {"RMSNorm": {"cpu": kernels.LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}
    ):
        kp.kernelize(model, mode="inference", device="cpu")
    with pytest.raises(NotImplementedError, match="the kernel's own limit: fp8 only"):
        model(torch.randn(2, 8))

"""DTensor (tensor and sequence parallelism): a custom-op kernel without a sharding strategy gives way.

An in-process gloo group of one rank on 127.0.0.1 and a one-device CPU mesh: DTensor dispatch, sharding
propagation and its "no sharding strategy" error are the same as on many ranks. Real ``kernels.kernelize`` on
a real local repository whose layer calls a ``torch.library.custom_op``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kernelpolicy as kp
from kernelpolicy.testing import (
    RMSNorm,
    custom_op_rms_norm_kernel_source,
    free_port,
    kernelize_locally,
    write_kernel_repo,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

LAYERS = custom_op_rms_norm_kernel_source("kp_dtensor::rms_norm")


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
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

    model = nn.Sequential(RMSNorm(8)).eval()
    kernelize_locally(model, {"RMSNorm": repo})
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

    source = """
from torch import nn


class RMSNorm(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states):
        raise NotImplementedError("the kernel's own limit: fp8 only")
"""
    repo = write_kernel_repo(tmp_path / "repo", source, name="raising-rmsnorm")
    model = nn.Sequential(RMSNorm(8)).eval()
    kernelize_locally(model, {"RMSNorm": repo})
    with pytest.raises(NotImplementedError, match="the kernel's own limit: fp8 only"):
        model(torch.randn(2, 8))


def test_explain_says_why_after_a_dtensor_fallback(norm: nn.Module, mesh: Any) -> None:
    model, x = _sharded(norm, mesh)
    (row,) = kp.explain(model)
    assert (row.path, row.reason) == (
        "kernel",
        "kernel usable if its op has a sharding strategy for these DTensor parameters",
    )
    model(x)
    (row,) = kp.explain(model)
    assert row.path == "original"
    assert row.reason.startswith("kernel cannot run on DTensor inputs (its op has no sharding strategy): ")
    assert "kp_dtensor.rms_norm.default" in row.reason
    with kp.kernel_policy("require"):
        assert [r.path for r in kp.explain(model)] == ["error"]
    with kp.kernels_disabled():
        assert [(r.path, r.reason) for r in kp.explain(model)] == [("original", "disabled by policy")]


@pytest.fixture
def local_shards() -> Iterator[None]:
    import kernelpolicy.distributed

    kernelpolicy.distributed.run_on_local_shards("RMSNorm")
    try:
        yield
    finally:
        kernelpolicy.distributed.run_on_local_shards("RMSNorm", enabled=False)


@pytest.mark.usefixtures("local_shards")
@pytest.mark.parametrize("mode", ["prefer", "require"])
def test_a_layer_declared_local_runs_its_kernel_on_the_shards(norm: nn.Module, mesh: Any, mode: str) -> None:
    from torch.distributed.tensor import DTensor, Shard

    model, x = _sharded(norm, mesh)
    with kp.kernel_policy(mode), kp.record_calls() as calls:
        out = model(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),) and out.device_mesh == mesh
    torch.testing.assert_close(out.full_tensor(), _reference(x) + 100)  # the kernel adds 100
    assert calls.by_layer() == {"RMSNorm": {"kernel": 1}}
    assert {reason for (*_, reason, _), _ in calls.items()} == {
        "kernel run on local shards (declared with kernelpolicy.distributed.run_on_local_shards)"
    }
    assert isinstance(model[0].weight, DTensor)  # the module is not changed
    (row,) = kp.explain(model)
    assert row.path == "kernel" and row.reason.endswith(
        "on DTensor without a sharding strategy it runs on local shards"
    )
    with kp.kernels_disabled():
        torch.testing.assert_close(model(x).full_tensor(), _reference(x))


@pytest.mark.usefixtures("local_shards")
def test_local_shards_carry_gradients_to_the_dtensor_parameters(tmp_path: Path, mesh: Any) -> None:

    source = custom_op_rms_norm_kernel_source("kp_dtensor::rms_norm_grad", offset=0.0, autograd=True)
    repo = write_kernel_repo(tmp_path / "repo", source, name="dtensor-rmsnorm-grad")
    model = nn.Sequential(RMSNorm(8)).train()
    kernelize_locally(model, {"RMSNorm": repo}, mode="training")
    model, x = _sharded(model, mesh)
    x.requires_grad_(True)
    with kp.record_calls() as calls:
        model(x).pow(2).sum().backward()
    assert calls.by_layer() == {"RMSNorm": {"kernel": 1}}
    grads = (model[0].weight.grad.full_tensor(), x.grad.full_tensor())
    model[0].weight.grad = x.grad = None
    with kp.kernels_disabled():
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(grads, (model[0].weight.grad.full_tensor(), x.grad.full_tensor()))


def test_verify_on_dtensor_falls_back_like_prefer(norm: nn.Module, mesh: Any) -> None:
    model, x = _sharded(norm, mesh)
    with kp.kernel_policy("verify"), kp.record_calls() as calls:
        out = model(x)
    torch.testing.assert_close(out.full_tensor(), _reference(x))
    assert calls.by_layer() == {"RMSNorm": {"original": 1}}


@pytest.fixture(scope="module")
def sequence_parallel(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of 2 ranks saw: a kernelized RMSNorm under ``SequenceParallel``, every policy (one spawn)."""
    import json

    from _helpers import run_ranks
    from _workers import sequence_parallel_worker

    out = tmp_path_factory.mktemp("sequence_parallel")
    run_ranks(sequence_parallel_worker, 2, free_port(), str(out), str(repo))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_sequence_parallel_on_two_ranks_obeys_every_policy(sequence_parallel: list[dict[str, Any]]) -> None:
    for seen in sequence_parallel:
        assert seen["prefer"]["offset"] == 0 and seen["prefer"]["calls"] == {"RMSNorm": {"original": 1}}
        assert seen["prefer"]["explain"] == [
            "original: kernel cannot run on DTensor inputs (its op has no sharding strategy): Operator "
            "kp_dtensor.rms_norm.default does not have a sharding strategy registered."
        ]
        assert "no sharding strategy" in seen["require"]["error"]
        assert seen["require"]["calls"] == {"RMSNorm": {"error": 1}}
        assert seen["disable"]["offset"] == 0
        assert seen["prefer, local shards"]["offset"] == 100
        assert seen["prefer, local shards"]["calls"] == {"RMSNorm": {"kernel": 1}}
        assert seen["require, local shards"]["offset"] == 100

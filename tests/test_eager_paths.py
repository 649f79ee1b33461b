"""The path of each eager call under each mode, on real local kernel repositories loaded by kernels."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import kernelpolicy as kp
from kernelpolicy._forward._dispatch import NO_BACKWARD
from kernelpolicy._forward._failures import _logged
from kernelpolicy.testing import DemoModel, kernel_calls

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))


def reference(model: DemoModel) -> torch.Tensor:
    with kp.kernels_disabled():
        return model(X)


def counted(model: nn.Module, fn: Callable[[], Any]) -> tuple[int, Any]:
    before = kernel_calls(model)
    out = fn()
    return kernel_calls(model) - before, out


@pytest.mark.parametrize(
    ("scope", "expected_calls"),
    [
        (kp.kernel_policy(), 3),
        (kp.kernel_policy("prefer"), 3),
        (kp.kernel_policy("require"), 3),
        (kp.kernels_disabled(), 0),
        (kp.kernel_policy(RMSNorm="disable"), 0),
        (kp.kernel_policy("disable", RMSNorm="prefer"), 3),
        (kp.kernel_policy("require", SiLU="disable"), 3),
    ],
)
def test_policy_chooses_path_per_call(
    kernelized: Callable[..., DemoModel], scope: kp.kernel_policy, expected_calls: int
) -> None:
    model = kernelized("exact")
    ref = reference(model)
    with scope:
        calls, out = counted(model, lambda: model(X))
    assert calls == expected_calls
    # the exact kernel computes what the original computes
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_kernel_output_differs_from_original_when_kernel_does(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")  # adds 100 on every RMSNorm output
    with_kernel = model(X)
    without = reference(model)
    # the last RMSNorm output is normalized (|mean| < 2) unless the kernel added 100
    assert abs(without.mean().item()) < 2
    assert with_kernel.mean().item() > 98


def test_same_model_switches_back_and_forth(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    for _ in range(3):
        assert counted(model, lambda: model(X))[0] == 3
        with kp.kernels_disabled():
            assert counted(model, lambda: model(X))[0] == 0


def test_require_without_kernel_names_module_layer_and_reason(mapping: Callable[[str], Any]) -> None:
    model = kp.attach(DemoModel(16))  # never kernelized: no kernel bound
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as info:
        model(X)
    err = info.value
    assert err.module_name == "blocks.0.1"
    assert err.layer_name == "RMSNorm"
    assert err.module_class.endswith("testing.RMSNorm")
    assert err.reason == "no kernel bound"
    assert "'blocks.0.1'" in str(err)
    assert "'RMSNorm'" in str(err)
    assert "no kernel bound" in str(err)
    # prefer and disable run the original
    assert torch.isfinite(model(X)).all()


def test_require_per_layer_only_hits_named_layer() -> None:
    model = kp.attach(DemoModel(16))
    with kp.kernel_policy(SiLU="require"):
        model(X)  # RMSNorm is not named: prefer, no error
    with kp.kernel_policy(RMSNorm="require"), pytest.raises(kp.KernelUnavailableError):
        model(X)


@pytest.mark.parametrize("training", [True, False])
def test_no_backward_kernel_runs_only_where_autograd_does_not_record(
    kernelized: Callable[..., DemoModel], caplog: pytest.LogCaptureFixture, training: bool
) -> None:
    model = kernelized("no_backward").train(training)
    offset_present = lambda out: out.mean().item() > 50  # noqa: E731
    _logged.discard(("RMSNorm", NO_BACKWARD))  # logged once per process: forget an earlier test's
    # Grad enabled and parameters that require grad: autograd records every call, in train and eval mode.
    with caplog.at_level(logging.INFO, logger="kernelpolicy"):
        for _ in range(3):
            out = model(X)
            assert not offset_present(out) and out.grad_fn is not None  # prefer: original forward
    records = [r for r in caplog.records if r.name == "kernelpolicy"]
    assert len(records) == 1, "one record per (layer name, reason)"
    assert "has no backward" in records[0].getMessage() and "autograd records this call" in records[0].getMessage()
    # A warning (shown by a default logging set-up): the bound kernel cannot run in this whole situation.
    assert records[0].levelno == logging.WARNING
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match="kernel has no backward"):
        model(X)
    for no_autograd in (torch.no_grad, torch.inference_mode):
        with no_autograd():
            assert offset_present(model(X))
            with kp.kernel_policy("require"):
                assert offset_present(model(X))
    # Frozen parameters: the call is recorded only when an input requires grad.
    model.requires_grad_(False)
    assert offset_present(model(X))
    x = X.clone().requires_grad_()
    out = model(x)
    assert not offset_present(out)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with kp.record_calls() as calls:
        model(x)
    assert {key[3] for key, _ in calls.items()} == {NO_BACKWARD}

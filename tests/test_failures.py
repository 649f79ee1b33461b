"""Kernel failures under ``prefer``, opt-in: ``fallback_on`` runs the original, ``max_failures`` stops trying.

A real local kernel repository whose RMSNorm kernel adds 100 to its output and raises ``RuntimeError`` on a batch
of 3 (an input it does not support); kernelized by ``kernelpolicy.kernelize``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from _helpers import kernel_ran
from torch import nn

import kernelpolicy as kp
from kernelpolicy.testing import RMSNorm, kernelize_locally, write_kernel_repo

FAILING = """
import torch
from torch import nn


class RMSNorm(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states):
        if hidden_states.shape[0] == 3:
            raise RuntimeError("a batch of 3 is not supported")
        return hidden_states + 100.0
"""
GOOD, BAD = torch.ones(2, 8), torch.ones(3, 8)
FAILED = (
    "kernel raised; the original forward ran (the policy's fallback_on) (RuntimeError: a batch of 3 is not supported)"
)


@pytest.fixture
def model(tmp_path: Path) -> nn.Module:
    repo = write_kernel_repo(tmp_path / "failing", FAILING, name="failing-rmsnorm")
    return kernelize_locally(nn.Sequential(RMSNorm(8)).eval(), {"RMSNorm": repo})


def test_by_default_the_kernels_error_propagates(model: nn.Module) -> None:
    assert kernel_ran(model(GOOD))
    with pytest.raises(RuntimeError, match="a batch of 3 is not supported"):
        model(BAD)


def test_fallback_on_runs_the_original_and_records_the_failure(
    model: nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    with kp.kernel_policy("prefer", fallback_on=RuntimeError), kp.record_calls() as calls:
        out = model(BAD)
        assert kernel_ran(model(GOOD))  # the kernel is still tried: no max_failures
    torch.testing.assert_close(out, RMSNorm(8)(BAD))
    assert calls.by_layer() == {"RMSNorm": {"original": 1, "kernel": 1}}
    assert {key[3] for key, _ in calls.items() if key[2] == "original"} == {FAILED}
    with kp.kernel_policy("prefer", fallback_on=RuntimeError), caplog.at_level(logging.WARNING, "kernelpolicy"):
        model(BAD)  # the fast path (nothing recorded) falls back too
    assert "2 failure(s) so far under fallback_on (last: RuntimeError" in kp.explain(model).rows[0].reason


def test_other_errors_modes_and_types_propagate(model: nn.Module) -> None:
    with kp.kernel_policy("prefer", fallback_on=ValueError), pytest.raises(RuntimeError):
        model(BAD)  # not a declared type
    with kp.kernel_policy("require", fallback_on=RuntimeError), pytest.raises(RuntimeError):
        model(BAD)  # require wants the kernel


class Outer:
    class NestedError(RuntimeError):
        """A nested exception class: named by its qualified name."""


def test_fallback_on_is_resolved_where_the_policy_is_written(model: nn.Module) -> None:
    """Issue 33: names that do not resolve fail at the scope, not in the forward (which hid the kernel's error)."""
    for bad in ("kernelpolicy_no_such_module.Error", "torch.OutOfMemoryErrr", "torch.nn.Module"):
        with pytest.raises(
            kp.PolicyError, match=r"fallback_on: '.*' is not (an importable module's attribute|an Exception)"
        ):
            kp.kernel_policy("prefer", fallback_on=bad)
        with pytest.raises(kp.PolicyError):
            kp.Policy.parse(f"prefer,fallback_on={bad}")

    class LocalError(RuntimeError):
        pass

    with pytest.raises(kp.PolicyError, match=r"cannot be found again by its name .*define the class at module level"):
        kp.kernel_policy("prefer", fallback_on=LocalError)
    # a nested class is named by its qualified name, resolves, round-trips through str and falls back
    policy = kp.Policy("prefer", fallback_on=Outer.NestedError)
    assert policy.fallback_on == (f"{__name__}.Outer.NestedError",)
    assert kp.Policy.parse(str(policy)) == policy
    with kp.kernel_policy("prefer", fallback_on=(Outer.NestedError, RuntimeError)):
        assert not kernel_ran(model(BAD))  # the kernel raises RuntimeError: the original ran


def test_max_failures_stops_the_kernel_until_reset(model: nn.Module) -> None:
    policy = kp.Policy("prefer", fallback_on=RuntimeError, max_failures=2)
    with kp.kernel_policy(policy):
        for _ in range(2):
            assert not kernel_ran(model(BAD))
        assert not kernel_ran(model(GOOD))  # stopped: the kernel is not tried, even on an input it takes
        row = kp.explain(model).rows[0]
        assert row.path == "original"
        assert row.reason == (
            "kernel stopped after 2 failures (last: RuntimeError: a batch of 3 is not supported); "
            "kernelpolicy.reset_failures(model) tries it again"
        )
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match="kernel stopped after 2 failures"):
        model(GOOD)
    kp.reset_failures(model)
    assert kernel_ran(model(GOOD))
    assert kp.explain(model).rows[0].reason == "kernel usable"


def test_the_options_in_text_and_as_values() -> None:
    text = "prefer,fallback_on=RuntimeError|torch.OutOfMemoryError,max_failures=3"
    policy = kp.Policy.parse(text)
    assert policy == kp.Policy("prefer", fallback_on=(torch.OutOfMemoryError, RuntimeError), max_failures=3)
    assert str(policy) == text and kp.Policy.parse(str(policy)) == policy
    assert policy.fallback_on == ("RuntimeError", "torch.OutOfMemoryError") and policy.max_failures == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fallback_on": KeyboardInterrupt}, "KeyboardInterrupt is not an Exception subclass"),
        ({"fallback_on": "Runtime Error"}, "'Runtime Error' is not an exception class or name"),
        ({"fallback_on": "NoSuchError"}, "'NoSuchError' is not a built-in exception"),
        ({"fallback_on": 3}, "give exception classes or their names"),
        ({"max_failures": 0}, r"max_failures must be a whole number >= 1 \(or None: never stop\), got 0"),
    ],
)
def test_bad_options_name_the_value(options: dict[str, object], message: str) -> None:
    with pytest.raises(kp.PolicyError, match=message):
        kp.kernel_policy("prefer", **options)


def test_a_stopped_kernel_leaves_the_variants_running(model: nn.Module, tmp_path: Path) -> None:
    from kernelpolicy.testing import local_mapping, rms_norm_kernel_source

    fast = write_kernel_repo(tmp_path / "fast", rms_norm_kernel_source(offset=200.0), name="fast-rmsnorm")
    with local_mapping({"RMSNorm": fast}, inherit=False):
        kp.kernelize(model, mode="inference", device="cpu", variant="fast")
    with kp.kernel_policy("prefer", fallback_on=RuntimeError, max_failures=1):
        model(BAD)  # the default kernel fails once: stopped
    with kp.kernel_policy(RMSNorm="kernel:default|fast"):
        assert model(GOOD).mean().item() > 150  # the stopped default is skipped, fast runs
        assert kp.explain(model).rows[0].reason.startswith("variant 'fast'")

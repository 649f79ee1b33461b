"""``verify`` mode on real local kernel repositories, one of them deliberately wrong."""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import kernelpolicy as kp
from kernelpolicy.testing import DemoModel, kernel_calls, kernelize_locally, rms_norm_kernel_source, write_kernel_repo

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))

INPLACE_SOURCE = """
import torch
from torch import nn

CALLS = [0]


class RMSNorm(nn.Module):
    def forward(self, hidden_states):
        CALLS[0] += 1
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states.mul_(torch.rsqrt(variance + self.variance_epsilon)).mul_(self.weight)
        return hidden_states
"""


@pytest.fixture(scope="module")
def extra_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify-repos")
    return {
        # 1% too large: the deliberately wrong kernel
        "wrong": write_kernel_repo(root / "wrong", rms_norm_kernel_source(scale=1.01)),
        "wrong_traceable": write_kernel_repo(
            root / "wrong_traceable", rms_norm_kernel_source(scale=1.01, can_torch_compile=True)
        ),
        "inplace": write_kernel_repo(root / "inplace", INPLACE_SOURCE),
    }


@pytest.fixture
def with_repo(extra_repos: dict[str, Path]) -> Callable[[str], DemoModel]:
    def make(kind: str) -> DemoModel:
        torch.manual_seed(0)
        return kernelize_locally(DemoModel(16).eval(), {"RMSNorm": extra_repos[kind]})

    return make


def test_verify_passes_for_an_exact_kernel_and_returns_its_output(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    expected = model(X)
    before = kernel_calls(model)
    with kp.kernel_policy("verify"), kp.record_calls() as calls:
        out = model(X)
    assert kernel_calls(model) - before == 3
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert calls.by_layer() == {"RMSNorm": {"kernel": 3}}
    assert {reason for (_, _, _, reason, _), _ in calls.items()} == {
        "kernel usable; verified against the original forward"
    }


def test_wrong_kernel_raises_mismatch_naming_module_layer_errors_and_index(
    with_repo: Callable[[str], DemoModel],
) -> None:
    model = with_repo("wrong")
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
        model(X)
    err = info.value
    assert err.module_name == "blocks.0.1"
    assert err.layer_name == "RMSNorm"
    assert err.where == "output"
    assert err.index == (0, 0)
    assert err.max_rel == pytest.approx(0.01, rel=1e-3)
    assert err.max_abs > 1e-3
    message = str(err)
    for fragment in ("'blocks.0.1'", "'RMSNorm'", "max abs error", "max rel error 0.01", "index (0, 0)"):
        assert fragment in message
    # prefer runs the wrong kernel without checking
    model(X)


def test_tolerances_can_be_widened(with_repo: Callable[[str], DemoModel]) -> None:
    model = with_repo("wrong")
    with kp.kernel_policy("verify", rtol=0.02, atol=1e-4):
        model(X)
    with kp.kernel_policy("verify", rtol=0.005), pytest.raises(kp.KernelMismatchError):
        model(X)
    # options are inherited by nested scopes that do not set them
    with kp.kernel_policy("verify", rtol=0.02), kp.kernel_policy(SiLU="disable"):
        model(X)


def test_tolerances_per_dtype(with_repo: Callable[[str], DemoModel]) -> None:
    model = with_repo("wrong")  # float32, 1% off
    with kp.kernel_policy("verify", rtol={torch.float32: 0.02}, atol=1e-4):
        model(X)
    with (
        kp.kernel_policy("verify", rtol="bfloat16:0.02|float16:0.02"),
        pytest.raises(kp.KernelMismatchError, match="beyond rtol=1e-05"),
    ):
        model(X)  # float32 not named: its default
    with kp.kernel_policy("verify", rtol="0.02|bfloat16:0.05", atol=1e-4):
        model(X)  # '*' (the bare number) covers float32
    policy = kp.Policy.parse("verify,rtol=0.02|bfloat16:0.05")
    assert policy.rtol == (("*", 0.02), ("bfloat16", 0.05))
    assert str(policy) == "verify,rtol=0.02|bfloat16:0.05"
    assert repr(policy) == "Policy('verify', rtol={'*': 0.02, 'bfloat16': 0.05})"


def test_on_mismatch_warn_logs_once_per_layer_and_returns_kernel_output(
    with_repo: Callable[[str], DemoModel], caplog: pytest.LogCaptureFixture
) -> None:
    model = with_repo("wrong")
    expected = model(X)
    with caplog.at_level(logging.WARNING, logger="kernelpolicy"), kp.kernel_policy("verify", on_mismatch="warn"):
        for _ in range(3):
            torch.testing.assert_close(model(X), expected, rtol=0, atol=0)
    warnings = [r for r in caplog.records if r.name == "kernelpolicy" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "kernel output differs from the original forward" in warnings[0].getMessage()


def test_verify_acts_as_prefer_under_compile(with_repo: Callable[[str], DemoModel]) -> None:
    model = with_repo("wrong_traceable")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    expected = model(X)  # prefer: the (wrong) kernel
    with kp.kernel_policy("verify"):
        torch.testing.assert_close(compiled(X), expected)
        with pytest.raises(kp.KernelMismatchError):
            model(X)  # eager still verifies


def test_in_place_kernel_cannot_alter_what_the_original_sees(with_repo: Callable[[str], DemoModel]) -> None:
    model = with_repo("inplace")
    norm = model.norm
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(6)) * 3
    with kp.kernels_disabled():
        reference = norm(x.clone())
    with kp.kernel_policy("verify", on_mismatch="warn"):
        y = x.clone()
        out = norm(y)  # the original ran on a clone before the kernel changed y in place
    torch.testing.assert_close(out, reference)
    assert out.data_ptr() == y.data_ptr(), "the kernel's in-place effect is kept, as under prefer"
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
        norm(x.clone())  # the original leaves its argument as it was, the kernel does not (issue 35, finding 7)
    assert info.value.where == "args[0] as the call left it"


class _Structured(nn.Module):
    kernel_layer_name = "Structured"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[Any], dict[str, Any]]:
        return x + 1, [x * 2, "tag"], {"a": x.sum(), "b": x - 1}


class _StructuredKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[Any], dict[str, Any]]:
        b = x - 1
        b[0, 1] += 0.5
        return x + 1, [x * 2, "tag"], {"a": x.sum(), "b": b}


class _WrongStructure(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return x + 1, [x * 2, "tag"], {"a": x.sum()}


def _bound(kernel: type[nn.Module]) -> nn.Module:
    layer = _Structured()
    layer.forward = types.MethodType(kernel.forward, layer)  # type: ignore[method-assign]  # as kernels binds
    return kp.attach(layer)


def test_nested_outputs_are_compared_and_the_mismatch_located() -> None:
    layer = _bound(_StructuredKernel)
    x = torch.zeros(2, 3)
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
        layer(x)
    assert info.value.where == "output[2]['b']"
    assert info.value.index == (0, 1)
    assert info.value.max_abs == pytest.approx(0.5)


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    extra: tuple[torch.Tensor, ...]


class _Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class _Rich(nn.Module):
    kernel_layer_name = "Rich"
    offset = 0.0

    def forward(self, x: torch.Tensor) -> Any:
        from transformers.modeling_outputs import BaseModelOutput

        y = x + self.offset
        return {
            "dataclass": _Output(x + 1, (x * 2, y)),
            "named": _Pair(x, [y, {"deep": y * 3}]),
            "model_output": BaseModelOutput(last_hidden_state=y, hidden_states=(x, y)),
        }


class _RichKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return _Rich.forward(self, x)


def test_verify_compares_dataclasses_named_tuples_and_model_outputs() -> None:
    """Issue 33, finding 8 (was: RuntimeError 'Boolean value of Tensor ... is ambiguous')."""
    layer = _Rich()
    layer.forward = types.MethodType(_RichKernel.forward, layer)  # type: ignore[method-assign]  # as kernels binds
    kp.attach(layer)
    x = torch.zeros(2, 3)
    with kp.kernel_policy("verify"):
        out = layer(x)  # equal: compared through every container
    assert isinstance(out["dataclass"], _Output)

    def shifted(self: nn.Module, x: torch.Tensor) -> Any:
        out = _Rich.forward(self, x)
        out["named"].second[1]["deep"] = out["named"].second[1]["deep"] + 1
        return out

    def dataclass_field(self: nn.Module, x: torch.Tensor) -> Any:
        out = _Rich.forward(self, x)
        out["dataclass"] = _Output(out["dataclass"].hidden, (out["dataclass"].extra[0] + 1, out["dataclass"].extra[1]))
        return out

    def model_output(self: nn.Module, x: torch.Tensor) -> Any:
        out = _Rich.forward(self, x)
        out["model_output"].last_hidden_state = out["model_output"].last_hidden_state - 1
        return out

    for where, kernel in (
        ("output['named'].second[1]['deep']", shifted),
        ("output['dataclass'].extra[0]", dataclass_field),
        ("output['model_output']['last_hidden_state']", model_output),
    ):
        bound = _Rich()
        bound.forward = types.MethodType(kernel, bound)  # type: ignore[method-assign]
        kp.attach(bound)
        with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
            bound(x)
        assert info.value.where == where


def test_structure_mismatch_is_reported() -> None:
    layer = _bound(_WrongStructure)
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError, match=r"keys \['a'\].*keys \['a', 'b'\]"):
        layer(torch.zeros(2, 3))


class _Noisy(nn.Module):
    kernel_layer_name = "Noisy"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


class _NoisyKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rand_like(x) + x


def test_random_state_is_forked_for_the_original_run() -> None:
    layer = _Noisy()
    layer.forward = types.MethodType(_NoisyKernel.forward, layer)  # type: ignore[method-assign]
    kp.attach(layer)
    x = torch.zeros(4)
    torch.manual_seed(7)
    with kp.kernel_policy("verify"):
        verified = layer(x)  # would mismatch if the two runs drew different numbers
    after_verify = torch.rand(1)
    torch.manual_seed(7)
    preferred = layer(x)
    after_prefer = torch.rand(1)
    torch.testing.assert_close(verified, preferred, rtol=0, atol=0)
    torch.testing.assert_close(after_verify, after_prefer, rtol=0, atol=0)


def test_verify_options_in_policy_values_and_syntax() -> None:
    p = kp.Policy.parse("verify,RMSNorm=prefer,atol=0.001,on_mismatch=warn")
    assert p == kp.Policy("verify", RMSNorm="prefer", atol=1e-3, on_mismatch="warn")
    assert (p.atol, p.rtol, p.on_mismatch) == (0.001, None, "warn")
    assert str(p) == "verify,RMSNorm=prefer,atol=0.001,on_mismatch=warn"
    assert kp.Policy.parse(str(p)) == p
    with kp.kernel_policy("verify", rtol=0.5):
        assert kp.current_policy().rtol == 0.5


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"atol": -1}, r"atol must be a number >= 0, or numbers per dtype: .*; got -1"),
        ({"rtol": "x"}, r"rtol must be a number >= 0, or numbers per dtype: .*; got 'x'"),
        (
            {"rtol": {"bfloat17": 1e-2}},
            r"dtypes: float16, bfloat16, float32, float64, complex64, complex128; got the dtype 'bfloat17'",
        ),
        ({"rtol": "float16:1e-3|float16:1e-2"}, "rtol names 'float16' twice"),
        ({"on_mismatch": "ignore"}, "on_mismatch must be 'raise' or 'warn', got 'ignore'"),
    ],
)
def test_bad_verify_options(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(kp.PolicyError, match=fragment):
        kp.kernel_policy("verify", **kwargs)
    with pytest.raises(kp.PolicyError, match=fragment):
        kp.Policy("verify", **kwargs)


def test_explain_under_verify(kernelized: Callable[..., DemoModel]) -> None:
    with kp.kernel_policy("verify"):
        rows = kp.explain(kernelized("exact")).rows
    assert {(r.mode, r.path, r.reason) for r in rows} == {
        ("verify", "kernel", "kernel usable; verified against the original forward")
    }


class _Tracking(nn.Module):
    """A layer with state: an in-place running mean and a reassigned step counter (both buffers)."""

    kernel_layer_name = "Tracking"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x - self.running_mean  # depends on the state before this call
        self.running_mean.mul_(0.5).add_(0.5 * x.mean(0))
        self.steps = self.steps + 1
        return out


def _tracking(momentum: float) -> nn.Module:
    """A ``_Tracking`` bound, as kernels binds, to a kernel updating the mean with ``momentum``."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = x - self.running_mean
        self.running_mean.mul_(1 - momentum).add_(momentum * x.mean(0))
        self.steps = self.steps + 1
        return out

    layer = _Tracking()
    layer.forward = types.MethodType(forward, layer)  # type: ignore[method-assign]
    return kp.attach(layer)


def test_buffers_start_equal_for_both_runs_and_end_updated_once() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    verified, preferred = _tracking(0.5), _tracking(0.5)
    for _ in range(3):
        with kp.kernel_policy("verify"):
            out = verified(x)  # without the restore the kernel would see the mean updated twice
        torch.testing.assert_close(out, preferred(x), rtol=0, atol=0)
    torch.testing.assert_close(verified.running_mean, preferred.running_mean, rtol=0, atol=0)
    assert int(verified.steps) == int(preferred.steps) == 3


def test_buffers_updated_differently_by_the_kernel_are_a_mismatch() -> None:
    layer = _tracking(0.6)
    layer.running_mean.fill_(1.0)
    x = torch.zeros(2, 3)
    x[:, 0] = 1.0  # batch mean (1, 0, 0): the means end (1, 0.5, 0.5) and (1, 0.4, 0.4)
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
        layer(x)  # outputs agree: both subtract the same starting mean
    assert info.value.where == "buffers['running_mean']"
    assert info.value.index == (1,)
    assert info.value.max_abs == pytest.approx(0.1)
    torch.testing.assert_close(layer.running_mean, torch.tensor([1.0, 0.4, 0.4]))  # the kernel's update, once


# --- issue 35, findings 7 and 10: what a kernel writes into its arguments; the numbers of a mismatch --------------


class _Writes(nn.Module):
    """Writes ``2 * x`` into ``out`` and returns None (the original); kernels below write other things."""

    kernel_layer_name = "Writes"

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(x, 2, out=out)


def _writes(kernel: Callable[[nn.Module, torch.Tensor, torch.Tensor], None]) -> nn.Module:
    layer = _Writes()
    layer.forward = types.MethodType(kernel, layer)  # type: ignore[method-assign]  # as kernels binds
    return kp.attach(layer)


def test_verify_compares_what_the_kernel_writes_into_its_arguments() -> None:
    def triples(self: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(x, 3, out=out)

    def scales_its_input(self: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(x, 2, out=out)
        x.mul_(2)

    def doubles(self: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(x, 2, out=out)

    x = torch.arange(4.0)
    for kernel, call, where in (
        (triples, lambda layer, x, out: layer(x, out), "args[1] as the call left it"),
        (triples, lambda layer, x, out: layer(x, out=out), "kwargs['out'] as the call left it"),
        (scales_its_input, lambda layer, x, out: layer(x, out), "args[0] as the call left it"),
    ):
        layer, out = _writes(kernel), torch.zeros(4)
        with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
            call(layer, x.clone(), out)
        assert info.value.where == where
        assert info.value.max_abs == pytest.approx(3.0)
    layer, out, y = _writes(triples), torch.zeros(4), x.clone()
    with kp.kernel_policy("verify", on_mismatch="warn"):
        assert layer(y, out=out) is None
    torch.testing.assert_close(out, 3 * x)  # the caller gets what the kernel wrote, as under prefer
    layer, out, y = _writes(doubles), torch.zeros(4), x.clone()
    with kp.kernel_policy("verify"):
        layer(y, out)
    torch.testing.assert_close(out, 2 * x)
    torch.testing.assert_close(y, x)


class _Returns(nn.Module):
    kernel_layer_name = "Returns"

    def forward(self, x: torch.Tensor) -> Any:
        return {"a": x, "b": x + 1}


def _returns(kernel: Callable[[nn.Module, torch.Tensor], Any]) -> nn.Module:
    layer = _Returns()
    layer.forward = types.MethodType(kernel, layer)  # type: ignore[method-assign]  # as kernels binds
    return kp.attach(layer)


def test_mismatch_numbers_for_nan_inf_integers_and_dicts_in_another_order() -> None:
    x = torch.arange(4.0)
    for bad in (float("nan"), float("inf")):

        def one_bad(self: nn.Module, x: torch.Tensor, bad: float = bad) -> Any:
            return {"a": torch.where(x == 2, bad, x), "b": x + 1}

        with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as info:
            _returns(one_bad)(x)
        assert info.value.max_abs == info.value.max_rel == float("inf"), bad  # was: max abs error 0
        assert info.value.index == (2,) and "1 of 4 elements differ" in info.value.detail
        assert "1 of them NaN or infinite where the other is not" in info.value.detail
        assert "max abs error inf" in str(info.value)
    with kp.kernel_policy("verify"):
        _returns(lambda self, x: {"b": x + 1, "a": x})(x)  # the same dict in another key order
    ints = torch.arange(4)
    with kp.kernel_policy("verify", atol=2):
        _returns(lambda self, x: {"a": x + 2, "b": x - 1})(ints)  # within atol=2 (was: 'beyond atol=2')
    with kp.kernel_policy("verify", atol=2), pytest.raises(kp.KernelMismatchError) as info:
        _returns(lambda self, x: {"a": x + 3, "b": x + 1})(ints)
    assert info.value.max_abs == 3.0 and info.value.detail == "4 of 4 elements differ beyond rtol=0.0, atol=2.0"
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError, match=r"atol=0\.0"):  # exact by default
        _returns(lambda self, x: {"a": x + 1, "b": x + 1})(ints)

"""Binding: kernelize, attach and the decorators, re-binding, copies and pickles, hooks, generated signatures."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import kernels
import pytest
import torch
from torch import nn

import kernelpolicy as kp
from kernelpolicy._attach._attach import _kernels_mode
from kernelpolicy._attach._aware import binding_of
from kernelpolicy.testing import DemoModel, RMSNorm, kernelize_locally

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))


def reference(model: DemoModel) -> torch.Tensor:
    with kp.kernels_disabled():
        return model(X)


def test_rekernelize_updates_kernel_and_keeps_policy(
    kernelized: Callable[..., DemoModel], mapping: Callable[[str], Any]
) -> None:
    model = kernelized("exact")
    norm = model.norm
    first = binding_of(norm)
    assert first is not None and first.kernel is not None
    with mapping("traceable"):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")  # plain kernels, not kernelpolicy
    second = binding_of(norm)
    assert second is not None and second.kernel is not first.kernel
    assert model(X).mean().item() > 50  # the new kernel runs
    with kp.kernels_disabled():
        assert model(X).mean().item() < 50  # and kernelpolicy still decides


def test_kernelize_fallback_means_no_kernel(mapping: Callable[[str], Any]) -> None:
    model = DemoModel(16)
    with mapping("untraceable"):
        kp.kernelize(model, mode="inference|torch_compile", device="cpu")  # kernels keeps the original
    binding = binding_of(model.norm)
    assert binding is not None and binding.kernel is None
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match="no kernel bound"):
        model(X)


def test_attach_after_plain_kernels_kernelize_is_idempotent_and_local(mapping: Callable[[str], Any]) -> None:
    aware, plain = DemoModel(16), DemoModel(16)
    with mapping("traceable"):
        kernels.kernelize(aware, mode=kernels.Mode.INFERENCE, device="cpu")
        kernels.kernelize(plain, mode=kernels.Mode.INFERENCE, device="cpu")
    kp.attach(aware)
    kp.attach(aware)
    with kp.kernels_disabled():
        assert aware(X).mean().item() < 50
        # an instance that was never attached keeps what kernels bound, untouched
        assert plain(X).mean().item() > 50
    assert type(plain.norm) is RMSNorm
    assert type(aware.norm).__name__ == "RMSNorm" and isinstance(aware.norm, RMSNorm)
    assert binding_of(plain.norm) is None


def test_unmarked_attach_targets_only_marked_modules() -> None:
    model = kp.attach(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert all(binding_of(m) is None for m in model.modules())
    assert len(kp.explain(model)) == 0


def test_decorated_class_is_aware_from_construction() -> None:
    @kp.use_kernel_forward_from_hub("Scale")
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    class SubScale(Scale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 3 * x

    layer, sub = Scale(), SubScale()
    assert binding_of(layer) is not None and binding_of(sub) is not None
    assert torch.equal(layer(torch.ones(1)), torch.tensor([2.0]))
    assert torch.equal(sub(torch.ones(1)), torch.tensor([3.0]))
    with kp.kernel_policy(Scale="require"), pytest.raises(kp.KernelUnavailableError, match="no kernel bound"):
        layer(torch.ones(1))


def test_function_kernels_via_use_kernelized_func() -> None:
    @kp.use_kernel_forward_from_hub("silu_and_mul")
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]

    @kernels.use_kernelized_func(silu_and_mul)
    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return silu_and_mul(x)

    model = kp.attach(nn.Sequential(Block()))
    rows = kp.explain(model).rows
    assert [(r.name, r.layer_name, r.path) for r in rows] == [("0.silu_and_mul", "silu_and_mul", "original")]
    with kp.kernel_policy(silu_and_mul="require"), pytest.raises(kp.KernelUnavailableError):
        model(torch.ones(1, 4))


def test_deepcopy_keeps_kernel_and_awareness(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    clone = copy.deepcopy(model)
    assert binding_of(clone.norm) is not None and binding_of(clone.norm).module is clone.norm  # type: ignore[union-attr]
    torch.testing.assert_close(clone(X), model(X))
    with torch.no_grad():
        clone.norm.weight.mul_(2)
    assert not torch.allclose(clone(X), model(X)), "the copy runs on its own parameters"
    with kp.kernels_disabled():
        assert clone(X).mean().item() < 50


def test_pickle_round_trip_drops_kernel_keeps_awareness(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    loaded = pickle.loads(pickle.dumps(model))
    binding = binding_of(loaded.norm)
    assert binding is not None and binding.kernel is None
    assert binding.module_name == "norm"
    torch.testing.assert_close(loaded(X), reference(model))


def test_kernelize_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="'inferense'") as info:
        kp.kernelize(DemoModel(16), mode="inferense", device="cpu")
    assert "'inference'" in str(info.value)


def test_hooks_still_run(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    seen: list[str] = []
    model.norm.register_forward_hook(lambda m, i, o: seen.append("hook"))
    model(X)
    with kp.kernels_disabled():
        model(X)
    assert seen == ["hook", "hook"]


class _Signatures(nn.Module):
    kernel_layer_name = "Signatures"

    def forward(self, a: torch.Tensor, /, b: torch.Tensor, *, c: torch.Tensor) -> torch.Tensor:
        return a + 2 * b + 3 * c


class _SignaturesKernel(nn.Module):
    can_torch_compile = True

    def forward(self, a: torch.Tensor, /, b: torch.Tensor, *, c: torch.Tensor) -> torch.Tensor:
        return 100 + a + 2 * b + 3 * c


class _Defaults(nn.Module):
    kernel_layer_name = "Defaults"

    def forward(self, x: torch.Tensor, scale: float = 2.0, **extra: Any) -> torch.Tensor:
        return x * scale + len(extra)


class _DefaultsKernel(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 5.0, **extra: Any) -> torch.Tensor:
        return 100 + x * scale + len(extra)


@pytest.mark.parametrize("compiled", [False, True])
def test_generated_forward_keeps_parameter_kinds(compiled: bool) -> None:
    layer = _Signatures()
    layer.forward = _SignaturesKernel.forward.__get__(layer)  # type: ignore[method-assign]  # as kernels binds
    kp.attach(layer)
    call = torch.compile(layer, backend="eager", fullgraph=True) if compiled else layer
    one = torch.ones(1)
    assert call(one, one, c=one).item() == 106
    assert call(one, b=one, c=one).item() == 106
    with kp.kernels_disabled():
        assert call(one, b=one, c=one).item() == 6
    with pytest.raises(TypeError):
        layer(one, one, one)  # c is keyword-only, as in the original


def test_defaults_and_variadics_fall_back_to_star_forwarding() -> None:
    layer = _Defaults()
    layer.forward = _DefaultsKernel.forward.__get__(layer)  # type: ignore[method-assign]
    kp.attach(layer)
    one = torch.ones(1)
    # each side keeps its own defaults, exactly as with kernels' direct binding
    assert layer(one).item() == 105
    assert layer(one, 1.0, k=1).item() == 102
    with kp.kernels_disabled():
        assert layer(one).item() == 2
        assert layer(one, scale=1.0, k=1, j=2).item() == 3


@pytest.mark.parametrize("how", ["attach", "class decorator"])
def test_classes_defined_at_run_time_are_collected(how: str) -> None:
    """Policy-aware subclasses keep neither their original classes nor themselves alive (300 of 300 collected)."""
    import gc
    import weakref

    refs = []
    for i in range(300):
        cls = type(f"RunTime{i}", (nn.Module,), {"forward": lambda self, x: x})
        if how == "attach":
            cls.kernel_layer_name = "RunTime"  # type: ignore[attr-defined]
            kp.attach(nn.Sequential(cls()))(torch.zeros(1))
        else:
            kp.use_kernel_forward_from_hub("RunTime")(cls)()(torch.zeros(1))
        refs.append(weakref.ref(cls))
        del cls
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0


def test_condition_is_kernels_own_argument(tmp_path: Any) -> None:
    """kernels >= 0.17 binds a kernel only where ``condition(module)`` holds; kernelpolicy passes it on."""
    import importlib.metadata

    from kernelpolicy.testing import rms_norm_kernel_source, write_kernel_repo

    if importlib.metadata.version("kernels").startswith("0.16"):
        with pytest.raises(TypeError, match=r"condition=...\) needs kernels >= 0.17 \(installed: 0\.16"):
            kp.use_kernel_forward_from_hub("CondNorm", condition=lambda module: True)
        return

    @kp.use_kernel_forward_from_hub("CondNorm", condition=lambda module: module.weight.numel() > 8)
    class CondNorm(torch.nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states * self.weight

    repo = write_kernel_repo(tmp_path / "repo", rms_norm_kernel_source(class_name="CondNorm", offset=100.0))
    model = torch.nn.Sequential(CondNorm(8), CondNorm(16))
    kernelize_locally(model, {"CondNorm": repo})
    assert [row.path for row in kp.explain(model)] == ["original", "kernel"]
    assert model[1](torch.ones(2, 16)).min() > 50 and model[0](torch.ones(2, 8)).max() < 50


@pytest.mark.parametrize(
    ("mode", "bad"),
    [("fast", "'fast'"), ("inference|fallback", "'fallback'"), ("", "''"), (4, "4"), (None, "None")],
)
def test_kernelize_names_a_bad_kernels_mode_and_the_valid_ones(mode: Any, bad: str) -> None:
    model = DemoModel()
    with pytest.raises(ValueError, match="unknown kernelize mode") as info:
        kp.kernelize(model, mode=mode, device="cpu")
    bad_part, valid = str(info.value).rsplit(";", 1)
    assert bad in bad_part
    assert valid.endswith(" 'training', 'inference', 'torch_compile'")  # not FALLBACK: kernelize sets it
    assert binding_of(model.norm) is None  # nothing was bound


@pytest.mark.parametrize(
    "mode",
    [kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE, "inference|torch_compile", " Torch_Compile | inference"],
)
def test_kernelize_takes_kernels_mode_flags_and_strings_alike(mode: Any) -> None:
    assert _kernels_mode(mode) == kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE
    model = DemoModel()
    assert kp.kernelize(model, mode=mode, device="cpu") is model
    assert binding_of(model.norm) is not None

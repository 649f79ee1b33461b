"""Policy-aware layers in eager mode, on real local kernel repositories loaded by kernels."""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Callable
from typing import Any

import kernels
import pytest
import torch
from torch import nn

import kernelpolicy as kp
from kernelpolicy._binding import _kernels_mode, binding_of
from kernelpolicy._dispatch import NO_BACKWARD, _logged
from kernelpolicy.testing import DemoModel, RMSNorm, kernel_calls, kernelize_locally

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


def test_explain_rows_and_table(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    table = kp.explain(model)
    assert [r.name for r in table] == ["blocks.0.1", "blocks.1.1", "norm"]
    row = table.rows[0]
    assert (row.layer_name, row.mode, row.path, row.reason) == ("RMSNorm", "prefer", "kernel", "kernel usable")
    assert row.kernel is not None and row.kernel.endswith(":RMSNorm")
    assert row.can_torch_compile and row.has_backward and row.policy_aware
    with kp.kernel_policy(RMSNorm="disable"):
        disabled = kp.explain(model)
    assert {(r.mode, r.path, r.reason) for r in disabled} == {("disable", "original", "disabled by policy")}
    text = str(table)
    assert text.splitlines()[0] == "policy: prefer   state: eager"
    assert "blocks.1.1" in text and "kernel usable" in text
    header, rule, first = text.splitlines()[1:4]
    assert header.index("layer") == first.index("RMSNorm") == rule.index(" -") + 1, "columns are aligned"


def test_explain_marks_modules_that_are_not_policy_aware(mapping: Callable[[str], Any]) -> None:
    model = DemoModel(16)
    with mapping("traceable"):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    rows = kp.explain(model).rows
    assert {r.policy_aware for r in rows} == {False}
    assert {r.path for r in rows} == {"kernel"}


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


def test_known_layers_and_unmatched_policy_entries(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    assert "RMSNorm" in kp.known_layers()
    with kp.kernel_policy(RMSnorm="disable", RMSNorm="require"):  # a typo beside the real name
        explanation = kp.explain(model)
    assert explanation.unmatched == ("RMSnorm=disable",)
    assert "RMSnorm" not in kp.known_layers()
    assert str(explanation).splitlines()[-1] == "policy entries naming no kernel layer of this model: RMSnorm=disable"
    assert kp.explain(model).unmatched == ()


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

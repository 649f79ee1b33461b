"""explain: one row per kernel-capable module, with the path and reason, and the policy entries that reach nothing."""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from typing import Any

import kernels
import pytest
import torch
from torch import nn

import kernelpolicy as kp
from kernelpolicy.testing import DemoModel

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))


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


def test_known_layers_and_unmatched_policy_entries(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    assert "RMSNorm" in kp.introspect.known_layers()
    with kp.kernel_policy(RMSnorm="disable", RMSNorm="require"):  # a typo beside the real name
        explanation = kp.explain(model)
    assert explanation.unmatched == ("RMSnorm=disable",)
    assert "RMSnorm" not in kp.introspect.known_layers()
    assert str(explanation).splitlines()[-1] == "policy entries naming no kernel layer of this model: RMSnorm=disable"
    assert kp.explain(model).unmatched == ()


class _Composed(nn.Module):
    """Two models attached separately (each names its modules from itself), composed: ``b(a(x))``."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x))
        return out


def test_calls_are_named_relative_to_the_module_asked_about(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    x = torch.randn(2, 16)
    with kp.record_calls() as calls:
        model(x)
    once = {"kernel": 1}
    assert {row.name: row.calls for row in kp.explain(model.blocks[0], calls=calls)} == {"1": once}
    wrapped = nn.Sequential(model)  # as wrappers nest a model
    assert {row.name: row.calls for row in kp.explain(wrapped, calls=calls)} == {
        "0.blocks.0.1": once,
        "0.blocks.1.1": once,
        "0.norm": once,
    }
    assert calls.by_module(model.blocks[1]) == {"1": once}
    assert calls.by_module(wrapped) == {"0.blocks.0.1": once, "0.blocks.1.1": once, "0.norm": once}


def test_two_models_attached_separately_then_composed(kernelized: Callable[..., DemoModel]) -> None:
    parent = _Composed(kernelized("exact"), kp.attach(DemoModel(16).eval()))  # b has no kernel bound
    x = torch.randn(2, 16)
    with kp.kernel_policy("require"):
        rows = {row.name: (row.path, row.reason) for row in kp.explain(parent, x)}
    assert rows["a.norm"] == ("kernel", "kernel usable")
    assert rows["b.blocks.0.1"] == ("error", "no kernel bound")  # the call that raised
    assert rows["b.norm"] == ("error", "not called by these inputs")
    with kp.record_calls() as calls:
        parent(x)
    assert calls.by_module(parent)["a.norm"] == {"kernel": 1}
    assert calls.by_module(parent)["b.norm"] == {"original": 1}
    assert calls.by_module()["norm"] == {"kernel": 1}  # as attached: each model named its own "norm"
    assert calls.by_module()["norm#2"] == {"original": 1}  # told apart, not merged
    explained = {row.name: row.calls for row in kp.explain(parent, calls=calls)}
    assert explained["a.norm"] == {"kernel": 1} and explained["b.norm"] == {"original": 1}


@pytest.mark.usefixtures("fresh_dynamo")
def test_explain_in_compiled_code_breaks_the_graph_with_kernelpolicys_message(
    kernelized: Callable[..., DemoModel],
) -> None:
    """Before: TorchDynamo's bare "Attempted to call function marked as skipped" (importlib.import_module, read
    through kernels' registries) under fullgraph=True. Now kernelpolicy's message, pointing to will_use_kernel;
    without fullgraph the call runs eagerly and says what eager code says."""
    from torch._dynamo.utils import counters

    model = kernelized("traceable")

    def step(x: torch.Tensor) -> tuple[torch.Tensor, kp.Explanation]:
        return model(x), kp.explain(model)

    # The scope is the caller's: TorchDynamo before 2.13 refuses any graph break inside a context manager it traces.
    with (
        kp.kernel_policy(RMSNorm="disable"),
        pytest.raises(torch._dynamo.exc.Unsupported, match=r"kernelpolicy\.explain\(\) is not traced") as raised,
    ):
        torch.compile(step, fullgraph=True, backend="eager")(X)
    assert "kernelpolicy.will_use_kernel(module)" in str(raised.value)
    torch._dynamo.reset()
    counters.clear()
    with kp.kernel_policy(RMSNorm="disable"):
        out, explained = torch.compile(step, backend="eager")(X)
        assert explained.rows == kp.explain(model).rows
        torch.testing.assert_close(out, model(X))
    assert {row.path for row in explained} == {"original"}
    first = next(iter(counters["graph_break"]))
    assert "kernelpolicy.explain() is not traced by torch.compile" in first, first


@kp.use_kernel_forward_from_hub("KpExplainTwice")
class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def instrumented(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return Twice.forward(self, x) + 100  # an instrumentation wrapper, bound the usual monkeypatching way


def test_explain_says_what_a_forward_assigned_by_hand_is() -> None:
    """Issue 41, item 8: a function bound as a method (``types.MethodType``) counts as the kernel, so it does not
    run under ``disable``; a plain function or a ``functools.partial`` wraps the policy's path and runs under
    every policy. explain says which, in the row's reason, also on a deep copy."""
    model = nn.Sequential(Twice(), Twice(), Twice())
    model[0].forward = types.MethodType(instrumented, model[0])
    model[1].forward = functools.partial(Twice.forward, model[1])
    x = torch.ones(1)
    assert [model[0](x).item(), model[1](x).item()] == [102.0, 2.0]
    with kp.kernels_disabled():
        assert [model[0](x).item(), model[1](x).item()] == [2.0, 2.0]
        disabled = kp.explain(model)
    by_hand = (
        "kernel bound by hand (module.forward = MethodType(f, module)): the kernel to the policy, not run under disable"
    )
    wrapper = "module.forward is Twice.forward: a wrapper around this path, run under every mode"
    assert [row.reason for row in disabled] == [
        f"disabled by policy; {by_hand}",
        f"disabled by policy; {wrapper}",
        "disabled by policy",
    ]
    rows = kp.explain(copy.deepcopy(model)).rows
    assert [(row.path, row.kernel, row.reason) for row in rows] == [
        ("kernel", "instrumented", f"kernel usable; {by_hand}"),
        ("original", None, f"no kernel bound; {wrapper}"),
        ("original", None, "no kernel bound"),
    ]
    assert by_hand in str(kp.explain(model))
    del model[0].forward  # the class's own forward again: no kernel, nothing to say
    assert kp.explain(model).rows[0].reason == "no kernel bound"


def test_errors_name_a_module_by_its_path_in_the_model_called(kernelized: Callable[..., DemoModel]) -> None:
    """Issue 41, item 13: both models name a ``blocks.0.1``; an error names it from the composite called
    (was: the name it was attached under, the same for both)."""
    parent = _Composed(kernelized("traceable"), kp.attach(DemoModel(16).eval()))  # b has no kernel bound
    x = torch.randn(2, 16)
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as raised:
        parent(x)
    assert raised.value.module_name == "b.blocks.0.1" and "module 'b.blocks.0.1'" in str(raised.value)
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as raised:
        parent.b(x)  # the model called is b: its own path
    assert raised.value.module_name == "blocks.0.1"
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as raised:
        parent.b.norm(x)  # a layer called alone keeps the name it was attached under
    assert raised.value.module_name == "norm"
    with kp.kernel_policy("verify"), pytest.raises(kp.KernelMismatchError) as mismatch:
        parent(x)  # a's kernel adds 100
    assert mismatch.value.module_name == "a.blocks.0.1" and "module 'a.blocks.0.1'" in str(mismatch.value)
    compiled = torch.compile(parent, backend="eager")  # raised at run time after the graph break
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as raised:
        compiled(x)
    assert raised.value.module_name == "b.blocks.0.1"  # not under the wrapper's _orig_mod

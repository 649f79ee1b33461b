"""explain: one row per kernel-capable module, with the path and reason, and the policy entries that reach nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kernels
import torch

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

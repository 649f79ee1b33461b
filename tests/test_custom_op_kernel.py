"""A kernel built as a ``torch.library.custom_op`` with a fake implementation, as hub kernels are.

Real ``kernels.kernelize`` on a real local repository whose layer calls the op. Under every tracer the op
stays in the traced program as that op when the policy runs the kernel, and is absent when it does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import graph_breaks

import kernelpolicy as kp
from kernelpolicy.testing import DemoModel, custom_op_rms_norm_kernel_source, kernelize_locally, write_kernel_repo

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OP = "kp_customop::rms_norm"
LAYERS = custom_op_rms_norm_kernel_source(OP)
X = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kernel_repo(tmp_path_factory.mktemp("custom-op") / "repo", LAYERS, name="custom-op-rmsnorm")


@pytest.fixture
def model(repo: Path) -> DemoModel:

    torch.manual_seed(0)
    return kernelize_locally(DemoModel(16).eval(), {"RMSNorm": repo})


def _ops(graph: torch.fx.Graph) -> list[str]:
    return [str(node.target) for node in graph.nodes if node.op == "call_function"]


def _has_op(graph: torch.fx.Graph) -> bool:
    return any("kp_customop.rms_norm" in target for target in _ops(graph))


def test_eager_runs_the_op_under_prefer_only(model: DemoModel) -> None:
    assert model(X).min() > 50  # the final norm is the kernel: +100
    with kp.kernels_disabled():
        assert model(X).abs().max() < 50


@pytest.mark.parametrize("strict", [True, False])
def test_export_keeps_the_op_and_disable_drops_it(model: DemoModel, strict: bool) -> None:
    with_kernel = torch.export.export(model, (X,), strict=strict)
    with kp.kernels_disabled():
        without = torch.export.export(model, (X,), strict=strict)
    assert _has_op(with_kernel.graph) and sum("kp_customop" in t for t in _ops(with_kernel.graph)) == 3
    assert not _has_op(without.graph)
    torch.testing.assert_close(with_kernel.module()(X), model(X))
    with kp.kernels_disabled():
        torch.testing.assert_close(without.module()(X), model(X))


def test_jit_trace_records_the_op(model: DemoModel) -> None:
    traced: Any = torch.jit.trace(model, (X,), check_trace=False)  # type: ignore[no-untyped-call]
    assert OP in str(traced.inlined_graph)
    with kp.kernels_disabled():
        plain: Any = torch.jit.trace(model, (X,), check_trace=False)  # type: ignore[no-untyped-call]
    assert OP not in str(plain.inlined_graph)
    torch.testing.assert_close(traced(X), model(X))


def test_fx_trace_records_the_op(model: DemoModel) -> None:
    assert _has_op(torch.fx.symbolic_trace(model).graph)
    with kp.kernels_disabled():
        assert not _has_op(torch.fx.symbolic_trace(model).graph)


def test_compile_keeps_the_op_in_the_graph_and_switches_on_the_policy(model: DemoModel) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(X), model(X))
    with kp.kernels_disabled():
        torch.testing.assert_close(compiled(X), model(X))
    assert [_has_op(gm.graph) for gm in graphs] == [True, False]
    assert graph_breaks() == 0

"""``kernelpolicy.will_use_kernel``: a parent asks which path its child takes, in eager code and under tracers.

Paths are observed through outputs (the kernel adds 1, the parent adds 100 on its kernel branch), compiles
through Dynamo's counters.
"""

from __future__ import annotations

import types

import pytest
import torch
from _helpers import graph_breaks
from torch import nn
from torch._dynamo.testing import CompileCounter

import kernelpolicy as kp

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Traceable(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _NoBackward(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _child(kernel: type[nn.Module] | None, name: str = "KpQuery") -> nn.Module:
    layer = type(name, (nn.Module,), {"kernel_layer_name": name, "forward": lambda self, x: x * 1.0})()
    if kernel is not None:
        layer.forward = types.MethodType(kernel.forward, layer)  # as kernels binds
    return layer


class Parent(nn.Module):
    """Reshapes for its child's kernel: the kernel branch adds 100 (stands for the other layout)."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kp.will_use_kernel(self.child, x):
            return self.child(x) + 100
        return self.child(x)


def _parent(kernel: type[nn.Module] | None) -> Parent:
    return kp.attach(Parent(_child(kernel))).eval()


X = torch.zeros(1)
KERNEL, ORIGINAL = 101.0, 0.0  # Parent's output on each path, from X


@pytest.mark.parametrize(
    ("kernel", "mode", "expected"),
    [
        (_Traceable, "prefer", True),
        (_Traceable, "require", True),
        (_Traceable, "verify", True),
        (_Traceable, "disable", False),
        (_Untraceable, "prefer", True),  # eager: any kernel runs
        (None, "prefer", False),
        (None, "disable", False),
    ],
)
def test_eager_answer_is_the_path_of_the_next_call(kernel: type[nn.Module] | None, mode: str, expected: bool) -> None:
    parent = _parent(kernel)
    with kp.kernel_policy(mode, atol=1.0) if mode == "verify" else kp.kernel_policy(mode):  # type: ignore[arg-type]
        assert kp.will_use_kernel(parent.child) is expected
        with kp.record_calls() as calls:
            assert parent(X).item() == (KERNEL if expected else ORIGINAL)
    assert calls.total(path="kernel") == int(expected)


def test_where_a_rule_decides_the_answer_needs_the_arguments() -> None:
    """Issue 33, finding 9 (was: True, then the call ran the original forward)."""
    parent = _parent(_Traceable)
    kp.kernel_accepts("KpQuery", dtypes=[torch.bfloat16])
    try:
        with pytest.raises(TypeError, match=r"depends on the call's arguments \(a kernel_accepts rule"):
            kp.will_use_kernel(parent.child)
        assert not kp.will_use_kernel(parent.child, X) and parent(X).item() == ORIGINAL
        bf16 = X.to(torch.bfloat16)
        assert kp.will_use_kernel(parent.child, bf16) and parent(bf16).item() == KERNEL
        with kp.kernels_disabled():  # no kernel whatever the arguments: answered without them
            assert not kp.will_use_kernel(parent.child)
    finally:
        kp.kernel_accepts("KpQuery")
    # a kernel without backward, grad enabled, no parameter requiring grad: the arguments decide too
    no_backward = _parent(_NoBackward)
    with pytest.raises(TypeError, match="its kernel has no backward"):
        kp.will_use_kernel(no_backward.child)
    with torch.no_grad():
        assert kp.will_use_kernel(no_backward.child)


@pytest.mark.parametrize("training", [True, False])
def test_a_kernel_without_backward_is_not_used_where_autograd_records(training: bool) -> None:
    parent = _parent(_NoBackward).train(training)
    x = torch.zeros(1, requires_grad=True)
    assert not kp.will_use_kernel(parent.child, x)
    out = parent(x)
    assert out.item() == ORIGINAL and out.grad_fn is not None
    assert kp.will_use_kernel(parent.child, x.detach()) and parent(x.detach()).item() == KERNEL
    with torch.no_grad():
        assert kp.will_use_kernel(parent.child, x) and parent(x).item() == KERNEL


def test_compiled_parent_branches_on_the_policy_without_graph_break() -> None:
    counter = CompileCounter()
    compiled = torch.compile(_parent(_Traceable), backend=counter, fullgraph=True)
    for scope, expected in [
        (kp.kernel_policy("prefer"), KERNEL),
        (kp.kernels_disabled(), ORIGINAL),
        (kp.kernel_policy("require"), KERNEL),  # the same program as prefer
        (kp.kernel_policy("verify"), KERNEL),
        (kp.kernels_disabled("KpQuery"), ORIGINAL),
        (kp.record_calls(), KERNEL),
    ]:
        with scope:
            assert compiled(X).item() == expected
    assert counter.frame_count == 2  # one program per path
    assert graph_breaks() == 0


def test_compiled_parent_of_an_untraceable_kernel_takes_the_original_branch() -> None:
    counter = CompileCounter()
    compiled = torch.compile(_parent(_Untraceable), backend=counter, fullgraph=True)
    with kp.kernel_policy("prefer"):
        assert compiled(X).item() == ORIGINAL
    assert graph_breaks() == 0


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(("mode", "expected"), [("prefer", KERNEL), ("disable", ORIGINAL)])
def test_export_follows_the_policy_at_export_time(strict: bool, mode: str, expected: float) -> None:
    with kp.kernel_policy(mode):  # type: ignore[arg-type]
        program = torch.export.export(_parent(_Traceable), (X,), strict=strict)
    assert program.module()(X).item() == expected  # the branch is baked into the program


def test_export_of_an_untraceable_kernel_exports_the_original_branch() -> None:
    with kp.kernel_policy("prefer"):
        for strict in (True, False):
            program = torch.export.export(_parent(_Untraceable), (X,), strict=strict)
            assert program.module()(X).item() == ORIGINAL


@pytest.mark.parametrize(("kernel", "expected"), [(_Traceable, KERNEL), (_Untraceable, ORIGINAL)])
def test_fx_and_jit_tracing_answer_for_the_traced_call(kernel: type[nn.Module], expected: float) -> None:
    traced = torch.fx.symbolic_trace(_parent(kernel))
    assert traced(X).item() == expected
    scripted = torch.jit.trace(_parent(kernel), (X,), check_trace=False)  # type: ignore[no-untyped-call]
    assert scripted(X).item() == expected
    with kp.kernels_disabled():
        assert torch.fx.symbolic_trace(_parent(kernel))(X).item() == ORIGINAL


def test_a_plain_module_is_a_type_error_naming_it() -> None:
    with pytest.raises(
        TypeError, match=r"will_use_kernel needs a policy-aware layer .* got torch\.nn\.modules\.linear\.Linear"
    ):
        kp.will_use_kernel(nn.Linear(1, 1))

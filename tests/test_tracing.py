"""The path in each execution state: eager, torch.compile, torch.export, jit.trace, fx.

Kernels under test add 100 to their output, so the path is read off the
traced program's output (Python counters do not run inside a compiled graph).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch._dynamo
from _helpers import CountingBackend, graph_breaks, kernel_ran

import kernelpolicy as kp
from kernelpolicy._forward._failures import LOGS_WHILE_TRACING
from kernelpolicy.testing import DemoModel

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# (policy scope, kernel kind) -> does the kernel run under tracing?
CASES = [
    ("prefer", "traceable", True),
    ("prefer", "untraceable", False),
    ("disable", "traceable", False),
    ("disable", "untraceable", False),
    ("require", "traceable", True),
]


def scope(mode: str) -> contextlib.AbstractContextManager[object]:
    return kp.kernel_policy(mode)  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "kind"), [(mode, kind) for mode, kind, _ in CASES])
def test_eager_runs_any_bound_kernel_unless_disabled(
    kernelized: Callable[..., DemoModel], mode: str, kind: str
) -> None:
    model = kernelized(kind)
    with scope(mode):
        assert kernel_ran(model(X)) is (mode != "disable")
    assert kp.introspect.execution_state() == "eager"


@pytest.mark.slow  # inductor's code generation takes about a minute on 2 cores
def test_compile_default_inductor_backend(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(X), model(X), rtol=1e-4, atol=1e-4)
    with kp.kernels_disabled():
        torch.testing.assert_close(compiled(X), model(X), rtol=1e-4, atol=1e-4)
        assert not kernel_ran(compiled(X))
    assert graph_breaks() == 0


def test_require_untraceable_under_fullgraph_fails_compilation_with_reason(
    kernelized: Callable[..., DemoModel],
) -> None:
    model = kernelized("untraceable")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with kp.kernel_policy("require"), pytest.raises(torch._dynamo.exc.Unsupported) as info:
        compiled(X)
    message = str(info.value)
    assert "kernel required but unavailable for module 'blocks.0.1'" in message
    assert "kernel cannot be traced under compile" in message
    # with the fix, and before Dynamo's hint to remove the call (which does not apply)
    assert "not a call to remove" in message and "'prefer'" in message
    if "Hint:" in message:
        assert message.index("kernel required but unavailable") < message.index("Hint:")


def test_require_untraceable_without_fullgraph_raises_kernel_unavailable(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("untraceable")
    compiled = torch.compile(model, backend="eager")
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as info:
        compiled(X)
    assert info.value.reason.startswith("kernel cannot be traced under compile")
    assert info.value.module_name == "blocks.0.1"


@pytest.mark.parametrize(("mode", "kind", "kernel_expected"), CASES)
def test_export_follows_policy_at_export_time(
    kernelized: Callable[..., DemoModel], mode: str, kind: str, kernel_expected: bool
) -> None:
    model = kernelized(kind)
    with scope(mode):
        exported = torch.export.export(model, (X,))
        expected = model(X) if kernel_expected else None
    out = exported.module()(X)  # run outside the scope: the program is fixed at export time
    assert kernel_ran(out) is kernel_expected
    if expected is not None:
        torch.testing.assert_close(out, expected)
    else:
        with kp.kernels_disabled():
            torch.testing.assert_close(out, model(X))


def test_export_strict_uses_dynamo_rules(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("untraceable")
    out = torch.export.export(model, (X,), strict=True).module()(X)
    assert not kernel_ran(out)
    traceable = kernelized("traceable")
    assert kernel_ran(torch.export.export(traceable, (X,), strict=True).module()(X))


@pytest.mark.parametrize("tracer", ["export", "jit", "fx"])
def test_require_untraceable_raises_under_python_tracers(kernelized: Callable[..., DemoModel], tracer: str) -> None:
    model = kernelized("untraceable")
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as info:
        if tracer == "export":
            torch.export.export(model, (X,))
        elif tracer == "jit":
            torch.jit.trace(model, (X,), check_trace=False)
        else:
            torch.fx.symbolic_trace(model)
    assert info.value.reason.startswith(f"kernel cannot be traced under {tracer}")


@pytest.mark.parametrize(("mode", "kind", "kernel_expected"), CASES)
def test_jit_trace(kernelized: Callable[..., DemoModel], mode: str, kind: str, kernel_expected: bool) -> None:
    model = kernelized(kind)
    with scope(mode):
        traced = torch.jit.trace(model, (X,), check_trace=False)
    assert kernel_ran(traced(X)) is kernel_expected


@pytest.mark.parametrize(("mode", "kind", "kernel_expected"), CASES)
def test_fx_symbolic_trace(kernelized: Callable[..., DemoModel], mode: str, kind: str, kernel_expected: bool) -> None:
    model = kernelized(kind)
    with scope(mode):
        traced = torch.fx.symbolic_trace(model)
    assert kernel_ran(traced(X)) is kernel_expected


def test_execution_state_inside_tracers() -> None:
    seen: list[str] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(kp.introspect.execution_state())
            return x + 1

    probe = Probe()
    torch.export.export(probe, (X,))
    torch.fx.symbolic_trace(probe)
    torch.jit.trace(probe, (X,), check_trace=False)
    probe(X)
    assert seen == ["export", "fx", "jit", "eager"]


TRACERS: dict[str, Callable[[torch.nn.Module], object]] = {
    "compile": lambda model: torch.compile(model, backend="eager")(X),
    "compile, fullgraph": lambda model: torch.compile(model, backend="eager", fullgraph=True)(X),
    "export, strict": lambda model: torch.export.export(model, (X,), strict=True),
    "export": lambda model: torch.export.export(model, (X,)),
    "jit": lambda model: torch.jit.trace(model, (X,), check_trace=False),
    "fx": lambda model: torch.fx.symbolic_trace(model),
}


def _fallback_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kernelpolicy"]


@pytest.mark.parametrize("tracer", TRACERS)
def test_prefer_logs_a_kernel_it_cannot_trace_once_under_every_tracer(
    kernelized: Callable[..., DemoModel], caplog: pytest.LogCaptureFixture, tracer: str
) -> None:
    """Issue 47, item 1 (was: logged under jit, FX and non-strict export, but not under ``torch.compile``, with
    ``fullgraph`` or without, nor strict export: a traced program runs no Python; now TorchDynamo logs it while
    it traces, through a function it calls at trace time, with no graph break)."""
    from kernelpolicy._forward._failures import _logged

    state = {"compile, fullgraph": "compile", "export, strict": "export"}.get(tracer, tracer)
    reason = f"kernel cannot be traced under {state} (it does not declare can_torch_compile = True)"
    _logged.discard(("RMSNorm", reason))
    model = kernelized("untraceable")
    with caplog.at_level(logging.WARNING, logger="kernelpolicy"):  # a default set-up shows WARNING
        TRACERS[tracer](model)
        TRACERS[tracer](kernelized("untraceable"))  # once per layer and reason: another model adds none
    assert _fallback_lines(caplog) == [
        (
            logging.WARNING,
            f"kernel layer 'RMSNorm' (kernelpolicy.testing.RMSNorm at 'blocks.0.1') falls back to its original "
            f"forward: {reason}",
        )
    ]
    assert graph_breaks() == 0


def test_a_compiled_program_of_a_kernel_it_cannot_trace_is_logged_whatever_policy_traced_it(
    kernelized: Callable[..., DemoModel], caplog: pytest.LogCaptureFixture
) -> None:
    """The program of a layer whose kernel cannot be traced is one program under every mode but ``require``:
    traced under ``disable``, it serves ``prefer`` too, with no trace left to log from; so it is logged then."""
    from kernelpolicy._forward._failures import _logged

    _logged.clear()
    compiled = torch.compile(kernelized("untraceable"), backend=(backend := CountingBackend()), fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="kernelpolicy"):
        with kp.kernels_disabled():
            assert not kernel_ran(compiled(X))
        assert not kernel_ran(compiled(X))  # prefer: the same program, no new trace
    assert backend.compiles == 1
    assert [message.rsplit(": ", 1)[1] for _, message in _fallback_lines(caplog)] == [
        "kernel cannot be traced under compile (it does not declare can_torch_compile = True)"
    ]


def test_the_fallback_under_compile_reaches_a_default_logging_set_up(kernel_repos: dict[str, Path]) -> None:
    """``logging.basicConfig()`` and nothing else: the line reaches stderr, once per layer and reason."""
    script = f"""
import logging, torch
import kernelpolicy as kp
from kernelpolicy.testing import DemoModel, local_mapping
logging.basicConfig()
def model():
    with local_mapping({{"RMSNorm": {str(kernel_repos["untraceable"])!r}}}):
        return kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
x = torch.randn(2, 16)
torch.compile(model(), backend="eager", fullgraph=True)(x)
torch.compile(model(), backend="eager")(x)
torch.export.export(model(), (x,), strict=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("WARNING:kernelpolicy:")]
    assert [line.rsplit(": ", 1)[1] for line in lines] == [
        "kernel cannot be traced under compile (it does not declare can_torch_compile = True)",
        "kernel cannot be traced under export (it does not declare can_torch_compile = True)",
    ]


@pytest.mark.skipif(not LOGS_WHILE_TRACING, reason="TorchDynamo before torch 2.13 folds no call with a binding")
def test_a_fallback_decided_in_the_traced_slow_path_is_logged_too(
    kernelized: Callable[..., DemoModel], caplog: pytest.LogCaptureFixture
) -> None:
    """A traceable kernel without backward on a call autograd records: the traced slow path decides, and logs."""
    from kernelpolicy._forward._dispatch import NO_BACKWARD
    from kernelpolicy._forward._failures import _logged

    _logged.discard(("RMSNorm", NO_BACKWARD))
    compiled = torch.compile(kernelized("no_backward").train(), backend="eager", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="kernelpolicy"):
        assert not kernel_ran(compiled(X))
    assert [(level, message.endswith(NO_BACKWARD)) for level, message in _fallback_lines(caplog)] == [
        (logging.WARNING, True)
    ]
    assert graph_breaks() == 0


@pytest.mark.parametrize(("mode", "kind", "kernel_expected"), CASES)
def test_fx_symbolic_trace_of_a_kernel_layer_itself(
    kernelized: Callable[..., DemoModel], mode: str, kind: str, kernel_expected: bool
) -> None:
    """Issue 47, item 4 (was: ``symbolic_trace(layer)`` traced ``type(layer).forward``, the class's original,
    whatever the policy; a model containing the layer was right). The aware class has a forward of its own
    that calls what ``layer(x)`` calls."""
    layer = kernelized(kind).norm
    with scope(mode):
        traced = torch.fx.symbolic_trace(layer)
    assert kernel_ran(traced(X)) is kernel_expected
    with scope(mode):  # called so in eager code: the original, as before (how a wrapper reaches it)
        torch.testing.assert_close(type(layer).forward(layer, X), type(layer).__mro__[1].forward(layer, X))


def test_fx_symbolic_trace_of_a_kernel_layer_itself_raises_under_require(kernelized: Callable[..., DemoModel]) -> None:
    layer = kernelized("untraceable").norm
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as info:
        torch.fx.symbolic_trace(layer)
    assert info.value.reason.startswith("kernel cannot be traced under fx")


def test_the_class_forward_of_a_kernel_layer_looks_like_the_original_and_sees_patches(
    kernelized: Callable[..., DemoModel],
) -> None:
    import inspect
    from unittest import mock

    from kernelpolicy.testing import RMSNorm

    layer = kernelized("traceable").norm
    assert inspect.signature(type(layer).forward) == inspect.signature(RMSNorm.forward)
    assert inspect.getsource(type(layer).forward) == inspect.getsource(RMSNorm.forward)
    assert type(layer).forward.__qualname__ == "RMSNorm.forward"
    with mock.patch.object(RMSNorm, "forward", lambda self, hidden_states: hidden_states - 7):
        with kp.kernels_disabled():
            torch.testing.assert_close(torch.fx.symbolic_trace(layer)(X), X - 7)  # the patched original
        assert kernel_ran(torch.fx.symbolic_trace(layer)(X))
    with kp.kernels_disabled():
        assert not kernel_ran(torch.fx.symbolic_trace(layer)(X))
        torch.testing.assert_close(torch.fx.symbolic_trace(layer)(X), RMSNorm.forward(layer, X))


def test_fx_symbolic_trace_of_a_class_made_aware_in_place(mapping: Callable[[str], object]) -> None:
    """Classes marked with kernelpolicy's decorator (aware in place): one that inherits its forward, and a
    subclass with a forward of its own calling ``super().forward`` (the original path, no recursion)."""
    from kernelpolicy.testing import RMSNorm

    @kp.use_kernel_forward_from_hub("RMSNorm")
    class Inherits(RMSNorm):
        pass

    class Own(Inherits):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states) * 2

    torch.manual_seed(0)
    for layer, original in ((Inherits(16), RMSNorm.forward), (Own(16), lambda m, x: 2 * RMSNorm.forward(m, x))):
        with mapping("traceable"):  # type: ignore[attr-defined]
            kp.kernelize(layer, mode="inference", device="cpu")
        assert kernel_ran(layer(X)) and kernel_ran(torch.fx.symbolic_trace(layer)(X))
        with kp.kernels_disabled():
            torch.testing.assert_close(layer(X), original(layer, X))
            torch.testing.assert_close(torch.fx.symbolic_trace(layer)(X), original(layer, X))
        with kp.kernel_policy("require"):
            assert kernel_ran(torch.fx.symbolic_trace(layer)(X))
    assert type(Own(16)) is Own and "forward" in vars(Inherits)  # the classes themselves, made aware in place


@kp.use_kernel_forward_from_hub("KpFxTwice")
class _Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class _Instrumented(torch.nn.Module):
    can_torch_compile = True  # traceable: FX records it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Twice.forward(self, x) + 100  # the class's forward: the original, reached from the kernel


def test_fx_trace_of_a_module_whose_kernel_or_wrapper_calls_its_class_forward() -> None:
    """The class forward dispatches only for FX's call of the module itself: a kernel or a wrapper of the module
    that calls ``Class.forward(self, x)`` reaches the original there too, as in eager code (no recursion)."""
    import functools
    import types

    x = torch.ones(2)
    kernel = _Twice()
    kernel.forward = types.MethodType(_Instrumented.forward, kernel)  # type: ignore[method-assign]
    wrapped = _Twice()
    wrapped.forward = functools.partial(lambda m, x: type(m).forward(m, x) * 5, wrapped)  # type: ignore[method-assign]
    for policy, expected in (("prefer", 102.0), ("disable", 2.0)):
        with kp.kernel_policy(policy):  # type: ignore[arg-type]
            assert kernel(x).tolist() == [expected] * 2
            assert torch.fx.symbolic_trace(kernel)(x).tolist() == [expected] * 2
            assert wrapped(x).tolist() == [10.0] * 2
            assert torch.fx.symbolic_trace(wrapped)(x).tolist() == [10.0] * 2
    # compiled, the class forward is traced as the original it stands for: no graph break
    compiled = torch.compile(kernel, backend="eager", fullgraph=True)
    with kp.kernels_disabled():
        assert compiled(x).tolist() == [2.0] * 2
    assert compiled(x).tolist() == [102.0] * 2
    assert graph_breaks() == 0

"""torch.compile: zero graph breaks, guarded policy switches, per thread and per task.

Kernels under test add 100 to their output: the path is read off outputs and
off the FX graphs a counting backend receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from _helpers import NAMES, CountingBackend, graph_breaks, kernel_ran, three_kernel_layers
from torch import nn

import kernelpolicy as kp
from kernelpolicy._values._policy import MODES
from kernelpolicy.testing import DemoModel

X = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def offset_nodes(gm: torch.fx.GraphModule) -> int:
    """Nodes that add the test kernels' 100.0 offset: the kernel is in the graph."""
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and 100.0 in node.args)


def ops(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    return [(node.op, str(node.target)) for node in gm.graph.nodes]


SCOPES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "prefer": lambda: kp.kernel_policy("prefer"),
    "disable": kp.kernels_disabled,
    "require": lambda: kp.kernel_policy("require"),
    "override": lambda: kp.kernel_policy("require", RMSNorm="disable"),
}


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks-allowed"])
@pytest.mark.parametrize("kind", ["traceable", "untraceable"])
@pytest.mark.parametrize("policy", list(SCOPES))
def test_compile_matrix(
    kernelized: Callable[..., DemoModel], policy: str, kind: str, fullgraph: bool, training: bool
) -> None:
    model = kernelized(kind)
    model.train(training)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    kernel_expected = policy in ("prefer", "require") and kind == "traceable"
    x = X.clone().requires_grad_(training)
    if policy == "require" and kind == "untraceable":
        # No path: compilation fails (fullgraph) or the call raises after a graph break.
        expected_error = torch._dynamo.exc.Unsupported if fullgraph else kp.KernelUnavailableError
        with SCOPES[policy](), pytest.raises(expected_error, match="kernel cannot be traced under compile"):
            compiled(x)
        return
    with SCOPES[policy]():
        out = compiled(x)
        again = compiled(x)
    with contextlib.nullcontext() if kernel_expected else kp.kernels_disabled():
        eager = model(x)  # the same path, eagerly
    assert kernel_ran(out) is kernel_expected
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(again, out)
    assert backend.compiles == 1
    assert graph_breaks() == 0
    assert offset_nodes(backend.graphs[0]) == (3 if kernel_expected else 0)
    if training:
        out.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_kernel_without_backward_follows_autograd_when_compiled(
    kernelized: Callable[..., DemoModel], fullgraph: bool, training: bool
) -> None:
    model = kernelized("no_backward").train(training)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    out = compiled(X)
    assert not kernel_ran(out) and out.grad_fn is not None  # grad enabled, parameters require grad: original
    with torch.no_grad():
        assert kernel_ran(compiled(X))  # no grad: the kernel is usable, a second graph
    assert backend.compiles == 2
    assert graph_breaks() == 0


def _dynamo_guards_parameter_requires_grad() -> bool:
    """Whether TorchDynamo recompiles when a parameter's requires_grad changes (torch 2.9.1's does not)."""

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1 if any(p.requires_grad for p in self.lin._parameters.values()) else x

    probe = Probe()
    compiled = torch.compile(probe, backend="eager", fullgraph=True)
    compiled(torch.zeros(1))
    probe.requires_grad_(False)
    return bool(compiled(torch.zeros(1)).item() == 0)


def test_compiled_kernel_without_backward_after_freezing(kernelized: Callable[..., DemoModel]) -> None:
    if not _dynamo_guards_parameter_requires_grad():
        pytest.skip(f"TorchDynamo on torch {torch.__version__} does not guard a parameter's requires_grad")
    model = kernelized("no_backward")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert not kernel_ran(compiled(X))
    model.requires_grad_(False)  # frozen: autograd records a call only when its input requires grad
    assert kernel_ran(compiled(X))
    assert not kernel_ran(compiled(X.clone().requires_grad_()))
    with torch.no_grad():
        assert kernel_ran(compiled(X))
    assert graph_breaks() == 0


def test_policy_switches_compile_once_per_distinct_policy(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    nullscope = contextlib.nullcontext
    steps: list[tuple[str, Callable[[], contextlib.AbstractContextManager[object]], bool, int]] = [
        # (what, scope, kernel expected, compiles so far)
        ("no scope", nullscope, True, 1),
        ("kernels_disabled", kp.kernels_disabled, False, 2),
        ("no scope again", nullscope, True, 2),
        # The first compile, made with no scope active, is guarded on the identity of the
        # process default's reader; the first scope with that program, even one equal to the
        # default, compiles once more, with per-layer guards that then serve every such policy
        # and unscoped calls too.
        ("scope equal to the default", lambda: kp.kernel_policy("prefer"), True, 3),
        ("disabled again", kp.kernels_disabled, False, 3),
        ("an unrelated layer disabled", lambda: kp.kernel_policy(SiLU="disable"), True, 3),
        ("another unrelated layer", lambda: kp.kernel_policy(GELU="require"), True, 3),
        ("several unrelated layers", lambda: kp.kernel_policy(A="disable", B="require"), True, 3),
        ("no scope", nullscope, True, 3),
        # Only the resolved mode of the model's layers matters, not how it was reached.
        ("the model's layer disabled by name", lambda: kp.kernel_policy(RMSNorm="disable"), False, 3),
        ("disable all but the model's layer", lambda: kp.kernel_policy("disable", RMSNorm="prefer"), True, 3),
        # One program, however it is spelled: a traceable kernel under prefer, require or verify,
        # with or without call recording.
        ("require", lambda: kp.kernel_policy("require"), True, 3),
        ("verify", lambda: kp.kernel_policy("verify"), True, 3),
        ("recording", kp.record_calls, True, 3),
        ("disabled, recording", lambda: _recording(kp.kernels_disabled()), False, 3),
    ]
    for what, scope, kernel_expected, compiles in steps:
        with scope():
            out = compiled(X)
        assert kernel_ran(out) is kernel_expected, what
        assert backend.compiles == compiles, what
    assert graph_breaks() == 0


@contextlib.contextmanager
def _recording(scope: contextlib.AbstractContextManager[object]) -> Iterator[None]:
    with scope, kp.record_calls():
        yield


def test_unrelated_layers_never_recompile_when_first_compile_is_scoped(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for scope in (
        kp.kernel_policy(SiLU="disable"),
        kp.kernel_policy("prefer"),
        kp.kernel_policy(Foo="require", Bar="disable"),
        contextlib.nullcontext(),
    ):
        with scope:
            assert kernel_ran(compiled(X))
    assert backend.compiles == 1


def test_set_default_policy_is_guarded(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert kernel_ran(compiled(X))
    previous = kp.set_default_policy("disable")
    try:
        assert not kernel_ran(compiled(X))
    finally:
        kp.set_default_policy(previous)
    assert kernel_ran(compiled(X))


def test_compiled_graph_equals_compiling_the_chosen_forward(
    kernelized: Callable[..., DemoModel], mapping: Callable[[str], Any]
) -> None:
    import kernels

    aware = kernelized("traceable")
    plain = DemoModel(16).eval()  # kernels' direct binding, never attached
    with mapping("traceable"):
        kernels.kernelize(plain, mode=kernels.Mode.INFERENCE, device="cpu")
    unkernelized = DemoModel(16).eval()

    graphs: dict[str, torch.fx.GraphModule] = {}
    for name, model, scope in [
        ("aware-prefer", aware, contextlib.nullcontext()),
        ("aware-disable", aware, kp.kernels_disabled()),
        ("plain-kernel", plain, contextlib.nullcontext()),
        ("original", unkernelized, contextlib.nullcontext()),
    ]:
        backend = CountingBackend()
        torch._dynamo.reset()
        with scope:
            torch.compile(model, backend=backend, fullgraph=True)(X)
        graphs[name] = backend.graphs[0]
    assert ops(graphs["aware-prefer"]) == ops(graphs["plain-kernel"])
    assert ops(graphs["aware-disable"]) == ops(graphs["original"])
    assert offset_nodes(graphs["aware-prefer"]) == 3
    assert offset_nodes(graphs["aware-disable"]) == 0


def test_threads_see_their_own_policy_on_one_compiled_model(
    kernelized: Callable[..., DemoModel], record_property: Callable[[str, object], None]
) -> None:
    model = kernelized("traceable")
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    # Warm up once per policy, as a server does before taking traffic: TorchDynamo
    # in torch 2.13 races when several threads compile one frame cold (a plain
    # model with two input shapes hits the recompile limit the same way).
    with kp.kernel_policy("prefer"):
        compiled(X)
    with kp.kernels_disabled():
        compiled(X)
    warm = backend.compiles
    wrong: list[tuple[int, int]] = []
    calls = [0]
    barrier = threading.Barrier(8)

    def worker(index: int) -> None:
        barrier.wait(timeout=30)
        for step in range(12):
            disabled = (index + step) % 2 == 0
            with kp.kernels_disabled() if disabled else kp.kernel_policy("prefer"):
                if kernel_ran(compiled(X)) == disabled:
                    wrong.append((index, step))
            calls[0] += 1

    with torch._dynamo.config.patch(recompile_limit=64):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert calls[0] == 8 * 12
    assert wrong == []
    assert warm == 2
    # Extra compiles from TorchDynamo's cross-thread race are reported, not hidden.
    record_property("extra_compiles_from_threads", backend.compiles - warm)
    print(f"compiles after warm-up: {warm}; extra from 8 threads: {backend.compiles - warm}")
    assert graph_breaks() == 0


def test_asyncio_tasks_see_their_own_policy_on_one_compiled_model(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    async def task(index: int) -> list[bool]:
        wrong = []
        for step in range(5):
            disabled = (index + step) % 2 == 0
            with kp.kernels_disabled() if disabled else kp.kernel_policy("prefer"):
                await asyncio.sleep(0)  # interleave with the other tasks inside the scope
                wrong.append(kernel_ran(compiled(X)) == disabled)
            await asyncio.sleep(0)
        return wrong

    async def main() -> list[list[bool]]:
        return await asyncio.gather(*(task(i) for i in range(24)))

    results = asyncio.run(main())
    assert sum(map(sum, results)) == 0
    assert sum(map(len, results)) == 24 * 5
    assert backend.compiles == 2
    assert graph_breaks() == 0


# --- compiles count programs, not policies --------------------------------------------------


def test_64_policies_compile_8_programs_and_recording_adds_none() -> None:
    """Every combination, the process default's own first (``prefer`` everywhere), in itertools order."""
    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()), fullgraph=True)
    x = torch.zeros(1)
    combos = list(itertools.product(MODES, repeat=3))
    assert combos[0] == ("prefer",) * 3 and kp.Policy(**dict(zip(NAMES, combos[0], strict=True))) == kp.Policy()
    assert len(combos) == 64
    for recording in (False, True):
        for modes in combos:
            scope = kp.kernel_policy(**dict(zip(NAMES, modes, strict=True)))
            with scope, kp.record_calls() if recording else contextlib.nullcontext():
                out = compiled(x)
            expected = sum(10.0**i for i, mode in enumerate(modes) if mode != "disable")
            assert out.item() == expected, (modes, recording)
        assert backend.compiles == 8, recording  # 2**3 paths; the default recompile limit holds them
    assert graph_breaks() == 0


def test_a_scope_equal_to_the_default_and_unscoped_calls_share_graphs() -> None:
    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()), fullgraph=True)
    x = torch.zeros(1)
    with kp.kernel_policy("prefer"):  # equal to the process default
        assert compiled(x).item() == 111
    assert compiled(x).item() == 111  # no scope: the same program, no compile
    with kp.kernel_policy("require", KpA="verify"):  # the same program under another spelling
        assert compiled(x).item() == 111
    assert backend.compiles == 1


def test_a_program_first_compiled_with_no_scope_compiles_once_more_under_a_scope() -> None:
    """The one extra compile that remains (README, "torch.compile and export"): pinned, so a change shows."""
    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()), fullgraph=True)
    x = torch.zeros(1)
    assert compiled(x).item() == 111  # no scope: guarded on DEFAULTS.active is DEFAULTS.active._current
    with kp.kernel_policy("prefer"):
        assert compiled(x).item() == 111
    assert backend.compiles == 2
    for scope in (kp.kernel_policy("require"), kp.kernel_policy("verify"), contextlib.nullcontext()):
        with scope:
            assert compiled(x).item() == 111
    assert backend.compiles == 2


def test_the_extra_compile_comes_once_per_path_first_compiled_with_no_scope() -> None:
    """Issue 47: once per path, not once, and docs/compile.md says so. Each path (which kernels run: a program)
    whose first call had no scope compiles once more under its first scope; one first compiled under a scope
    serves unscoped calls as they are."""
    from pathlib import Path

    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()), fullgraph=True)
    x, counts = torch.zeros(1), []

    def call(scope: contextlib.AbstractContextManager[object], expected: float) -> None:
        before = backend.compiles
        with scope:
            assert compiled(x).item() == expected
        counts.append(backend.compiles - before)

    call(contextlib.nullcontext(), 111)  # the kernels' path, unscoped (the process default, prefer)
    kp.set_default_policy("disable")
    call(contextlib.nullcontext(), 0)  # the originals' path, unscoped
    call(kp.kernel_policy("disable"), 0)  # its first scope: once more
    call(kp.kernel_policy("prefer"), 111)  # the kernels' path under its first scope: once more too
    call(kp.kernel_policy("prefer", KpA="disable"), 110)  # a path first compiled under a scope ...
    kp.set_default_policy(kp.Policy("prefer", KpA="disable"))
    call(contextlib.nullcontext(), 110)  # ... serves unscoped calls
    call(contextlib.nullcontext(), 110)
    call(kp.kernel_policy("disable"), 0)
    call(kp.kernel_policy("prefer"), 111)
    assert counts == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    text = " ".join((Path(__file__).parent.parent / "docs" / "compile.md").read_text().split())
    assert "One extra compile remains, once per path" in text


def test_a_layer_without_kernel_is_one_program_under_prefer_and_disable() -> None:
    layer = kp.attach(
        nn.Sequential(type("KpNone", (nn.Module,), {"kernel_layer_name": "KpNone", "forward": lambda self, x: x + 1})())
    )
    compiled = torch.compile(layer, backend=(backend := CountingBackend()), fullgraph=True)
    for mode in ("disable", "prefer", "verify", "prefer"):
        with kp.kernel_policy(mode):  # type: ignore[arg-type]
            assert compiled(torch.zeros(1)).item() == 1
    assert backend.compiles == 1
    with kp.kernel_policy("require"), pytest.raises(torch._dynamo.exc.Unsupported, match="no kernel bound"):
        compiled(torch.zeros(1))


def test_an_untraceable_kernel_is_one_program_except_require(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("untraceable")
    compiled = torch.compile(model, backend=(backend := CountingBackend()), fullgraph=True)
    for scope in (kp.kernels_disabled(), kp.kernel_policy("prefer"), kp.kernel_policy("verify"), kp.record_calls()):
        with scope:
            assert not kernel_ran(compiled(X))
    assert backend.compiles == 1
    assert graph_breaks() == 0

"""``module(...)`` on policy-aware layers: the one-frame ``__call__`` and everything ``nn.Module.__call__`` does.

Policy-aware classes override ``__call__`` (``_call_fold._aware_call``): with
no hook, tracer, compiled call or patched ``nn.Module.__call__`` it calls
``forward`` directly; otherwise it calls ``nn.Module.__call__``. These tests
pin that each of those cases behaves as with torch's own ``__call__``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from _helpers import graph_breaks, kernel_ran
from torch import nn

import kernelpolicy as kp
from kernelpolicy._attach._aware import binding_of
from kernelpolicy._forward import _call_fold
from kernelpolicy._forward._call_fold import _aware_call
from kernelpolicy._tell._doctor import _fast_call
from kernelpolicy.testing import DemoModel, kernel_calls

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))

POLICIES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "prefer": lambda: kp.kernel_policy("prefer"),
    "require": lambda: kp.kernel_policy("require"),
    # the "traceable" test kernel adds 100 on purpose: verify compares it with a wide tolerance
    "verify": lambda: kp.kernel_policy("verify", atol=1e3),
    "disable": kp.kernels_disabled,
    "layer-disabled": lambda: kp.kernel_policy("require", RMSNorm="disable"),
}
KERNEL_RUNS = {"prefer": True, "require": True, "verify": True, "disable": False, "layer-disabled": False}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def calls_of(model: nn.Module, fn: Callable[[], Any]) -> tuple[int, Any]:
    before = kernel_calls(model)
    out = fn()
    return kernel_calls(model) - before, out


# --- which classes get the one-frame __call__ ---------------------------------------------------


def test_aware_classes_call_in_one_frame(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    assert type(model.norm).__call__ is _aware_call
    assert type(model).__call__ is nn.Module.__call__  # only policy-aware classes change
    assert type(model.norm)._call_impl is nn.Module._call_impl  # model.compile() compiles torch's own


def test_class_decorator_gets_it_too() -> None:
    @kp.use_kernel_forward_from_hub("Decorated")
    class Decorated(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    assert Decorated.__call__ is _aware_call
    layer = Decorated()
    assert layer(torch.zeros(1)).item() == 1


@pytest.mark.parametrize("name", ["__call__", "_call_impl", "_wrapped_call_impl"])
def test_a_class_with_its_own_call_keeps_it(name: str) -> None:
    seen: list[str] = []

    def own(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append(name)
        return getattr(nn.Module, name)(self, *args, **kwargs)

    cls = type("Own", (nn.Module,), {"kernel_layer_name": "Own", "forward": lambda self, x: x + 1, name: own})
    plain = cls()
    assert plain(torch.zeros(1)).item() == 1
    # nn.Module.__call__ is _wrapped_call_impl by value: overriding that name alone changes nothing
    expected = [] if name == "_wrapped_call_impl" else [name]
    assert seen == expected
    seen.clear()
    layer = kp.attach(nn.Sequential(cls()))[0]
    assert binding_of(layer) is not None
    assert getattr(type(layer), name) is own
    assert type(layer).__call__ is not _aware_call
    with kp.kernels_disabled():
        assert layer(torch.zeros(1)).item() == 1
    assert seen == expected


def test_torch_call_path_is_the_one_checked() -> None:
    """Canary: a torch whose nn.Module call path reads other names turns the fast path off (see doctor)."""
    assert _call_fold.torch_call_names() in _call_fold._CHECKED_CALL_NAMES
    assert _call_fold.FAST_CALL
    assert _fast_call().startswith("on ")


def test_without_the_fast_path_classes_keep_torchs_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a torch with another call path gets: nn.Module.__call__, same behaviour.
    monkeypatch.setattr(_call_fold, "FAST_CALL", False)
    hooked: list[str] = []

    @kp.use_kernel_forward_from_hub("Unchecked")
    class Unchecked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    assert Unchecked.__call__ is nn.Module.__call__
    layer = Unchecked()
    layer.register_forward_hook(lambda module, args, out: hooked.append("hook"))
    with kp.kernel_policy("require", Unchecked="disable"):
        assert layer(torch.zeros(1)).item() == 1
    assert hooked == ["hook"]


def test_stack_depth_to_the_kernel_equals_kernels_direct_binding() -> None:
    """The point of the override: module(x) reaches the kernel no deeper than kernels' own binding does."""
    depths: list[int] = []

    class Layer(nn.Module):
        kernel_layer_name = "Depth"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    def kernel_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        frame, depth = sys._getframe(), 0
        while frame.f_code is not probe.__code__:
            frame, depth = frame.f_back, depth + 1  # type: ignore[assignment]
        depths.append(depth)
        return x

    def probe(layer: nn.Module) -> None:
        layer(X)

    direct = Layer()
    direct.forward = types.MethodType(kernel_forward, direct)  # type: ignore[method-assign]  # as kernels binds
    aware = Layer()
    aware.forward = types.MethodType(kernel_forward, aware)  # type: ignore[method-assign]
    kp.attach(nn.Sequential(aware))
    probe(direct)
    probe(aware)
    assert depths[1] <= depths[0], depths


# --- forward() called directly -------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_forward_called_directly_follows_the_policy(kernelized: Callable[..., DemoModel], policy: str) -> None:
    model = kernelized("exact")
    with POLICIES[policy]():
        calls, out = calls_of(model, lambda: model.norm.forward(X))
        via_call = model.norm(X)
    assert calls == (1 if KERNEL_RUNS[policy] else 0)
    torch.testing.assert_close(out, via_call, rtol=0, atol=0)


# --- hooks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_module_hooks_fire_and_the_policy_still_chooses(kernelized: Callable[..., DemoModel], policy: str) -> None:
    model = kernelized("traceable")  # adds 100: the path shows in the output the hooks see
    seen: list[tuple[str, bool]] = []
    norm = model.norm
    handles = [
        norm.register_forward_pre_hook(lambda m, args: seen.append(("pre", True))),
        norm.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("pre-kw", True)), with_kwargs=True),
        norm.register_forward_hook(lambda m, args, out: seen.append(("post", kernel_ran(out)))),
        norm.register_forward_hook(
            lambda m, args, kwargs, out: seen.append(("post-kw", kernel_ran(out))), with_kwargs=True
        ),
        norm.register_full_backward_pre_hook(lambda m, grad: seen.append(("bw-pre", True))),
        norm.register_full_backward_hook(lambda m, gin, gout: seen.append(("bw", True))),
    ]
    x = X.clone().requires_grad_(True)
    kernel = KERNEL_RUNS[policy]
    with POLICIES[policy]():
        out = model(x)
    out.sum().backward()
    assert kernel_ran(out) is kernel
    assert seen == [
        ("pre", True),
        ("pre-kw", True),
        ("post", kernel),
        ("post-kw", kernel),
        ("bw-pre", True),
        ("bw", True),
    ]
    for handle in handles:
        handle.remove()
    seen.clear()
    with POLICIES[policy]():
        assert kernel_ran(model(X)) is kernel
    assert seen == []


def _register(kind: str, module: nn.Module, seen: list[str]) -> Any:
    """Register one hook of ``kind`` that appends ``kind`` to ``seen`` when it fires on ``module``."""
    glob = nn.modules.module

    def note(hooked: nn.Module, *_: Any) -> None:
        if hooked is module:
            seen.append(kind)

    registrations: dict[str, Callable[[], Any]] = {
        "pre": lambda: module.register_forward_pre_hook(note),
        "pre-kw": lambda: module.register_forward_pre_hook(note, with_kwargs=True),
        "post": lambda: module.register_forward_hook(note),
        "post-kw": lambda: module.register_forward_hook(note, with_kwargs=True),
        "backward-pre": lambda: module.register_full_backward_pre_hook(note),
        "backward": lambda: module.register_full_backward_hook(note),
        "global-pre": lambda: glob.register_module_forward_pre_hook(note),
        "global-post": lambda: glob.register_module_forward_hook(note),
        "global-backward-pre": lambda: glob.register_module_full_backward_pre_hook(note),
        "global-backward": lambda: glob.register_module_full_backward_hook(note),
    }
    return registrations[kind]()


HOOK_KINDS = [
    "pre",
    "pre-kw",
    "post",
    "post-kw",
    "backward-pre",
    "backward",
    "global-pre",
    "global-post",
    "global-backward-pre",
    "global-backward",
]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_each_kind_of_hook_alone_fires_once(kernelized: Callable[..., DemoModel], kind: str, policy: str) -> None:
    model = kernelized("exact")
    seen: list[str] = []
    handle = _register(kind, model.norm, seen)
    try:
        x = X.clone().requires_grad_(True)
        with POLICIES[policy]():
            calls, out = calls_of(model, lambda: model(x))
        out.sum().backward()
    finally:
        handle.remove()
    assert seen == [kind]
    assert calls == (3 if KERNEL_RUNS[policy] else 0)


def test_pre_hook_can_replace_the_arguments(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    zeros = torch.zeros(3, 16)
    model.norm.register_forward_pre_hook(lambda m, args, kwargs: ((), {"hidden_states": zeros}), with_kwargs=True)
    out = model.norm()  # the hook supplies the argument forward needs
    torch.testing.assert_close(out, zeros + 100)
    with kp.kernels_disabled():
        torch.testing.assert_close(model.norm(X), zeros)


def test_always_called_hook_runs_when_require_raises() -> None:
    model = kp.attach(DemoModel(16))  # never kernelized: require raises
    seen: list[str] = []
    model.norm.register_forward_hook(lambda m, args, out: seen.append("always"), always_call=True)
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError):
        model.norm(X)
    assert seen == ["always"]


def test_patched_module_call_is_honoured(kernelized: Callable[..., DemoModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch.fx and torch.ao do: patch nn.Module.__call__; policy-aware layers go through the patch."""
    model = kernelized("exact")
    seen: list[str] = []
    original = nn.Module.__call__

    def patched(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "__call__", patched)
    calls, _ = calls_of(model, lambda: model(X))
    assert calls == 3
    assert seen.count("RMSNorm") == 3


def test_fx_leaf_policy_aware_layer_is_a_call_module() -> None:
    model = kp.attach(DemoModel(16))

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return binding_of(m) is not None or super().is_leaf_module(m, qualname)

    graph = LeafTracer().trace(model)
    targets = [node.target for node in graph.nodes if node.op == "call_module"]
    assert "norm" in targets and "blocks.0.1" in targets


# --- compiled, with hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_compiled_model_with_hooks_on_a_policy_aware_layer(kernelized: Callable[..., DemoModel], policy: str) -> None:
    model = kernelized("traceable")
    seen: list[str] = []
    model.norm.register_forward_pre_hook(lambda m, args: seen.append("pre"))

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        seen.append("post")
        return out * 2  # a hook that replaces the output, inside the graph

    model.norm.register_forward_hook(post)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with POLICIES[policy]():
        eager = model(X)
        out = compiled(X)
    assert kernel_ran(out) is KERNEL_RUNS[policy]
    torch.testing.assert_close(out, eager)
    assert seen == ["pre", "post", "pre", "post"]  # eager once, compiled once
    assert graph_breaks() == 0


def test_hooks_added_and_removed_after_compiling(kernelized: Callable[..., DemoModel]) -> None:
    """With hook guards on (torch's default skips them), a compiled model sees hooks come and go."""
    model = kernelized("traceable")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        plain = compiled(X)
        handle = model.norm.register_forward_hook(lambda m, args, out: out * 2)
        doubled = compiled(X)
        handle.remove()
        with kp.kernels_disabled():
            handle = model.norm.register_forward_hook(lambda m, args, out: out * 2)
            disabled = compiled(X)
            handle.remove()
        again = compiled(X)
    torch.testing.assert_close(doubled, plain * 2)
    torch.testing.assert_close(again, plain)
    assert kernel_ran(plain) and not kernel_ran(disabled)
    assert graph_breaks() == 0


@pytest.mark.parametrize("hooked", [False, True], ids=["no-hooks", "hooked"])
@pytest.mark.parametrize("policy", ["prefer", "disable"])
def test_module_compile_on_a_policy_aware_layer(
    kernelized: Callable[..., DemoModel], policy: str, hooked: bool
) -> None:
    """``module.compile()`` sets ``_compiled_call_impl``: the layer's calls go through it, hooks included."""
    model = kernelized("traceable")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    seen: list[str] = []
    if hooked:
        model.norm.register_forward_hook(lambda m, args, out: seen.append("post"))
    model.norm.compile(backend=backend, fullgraph=True)
    with POLICIES[policy](), torch.no_grad():  # inside the model, inputs would require grad: another graph
        out = model.norm(X)
        again = model.norm(X)
        whole = model(X)  # the compiled layer inside an eager model
    assert kernel_ran(out) is KERNEL_RUNS[policy]
    assert kernel_ran(whole) is KERNEL_RUNS[policy]
    torch.testing.assert_close(again, out)
    assert len(graphs) == 1
    assert seen == (["post"] * 3 if hooked else [])
    assert graph_breaks() == 0


def test_compiled_call_reads_torchs_own_globals(kernelized: Callable[..., DemoModel]) -> None:
    """``_aware_call`` reads hook dicts from torch's module globals: no aliasing guards on kernelpolicy's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = kernelized("traceable")
    model.norm.register_forward_hook(lambda m, args, out: out)  # a hooked layer and unhooked ones
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert kernel_ran(compiled(X))
    (entry,) = _debug_get_cache_entry_list(type(model).forward.__code__)
    guards = str(entry.guard_manager)
    assert "_aware_call" in guards  # traced through it
    assert "kernelpolicy_dot__binding" not in guards
    assert graph_breaks() == 0

"""kernels' own layer and function contract, kept through kernelpolicy.

Every test runs three ways (the parameter ``way``):

- ``plain``: ``kernels.use_kernel_forward_from_hub`` / ``kernels.use_kernelized_func`` / ``kernels.kernelize``,
  nothing of kernelpolicy: the reference;
- ``dropin``: ``kernelpolicy.use_kernel_forward_from_hub`` marks layers and functions and
  ``kernelpolicy.kernelize`` binds (functions are attached with kernels' ``use_kernelized_func``: kernelpolicy
  has no drop-in for it);
- ``attach``: kernels' marking and ``kernels.kernelize``, then ``kernelpolicy.attach(model)``.

Under the default policy (``prefer``) a policy-aware module must behave as plain kernels does, so each test
states what kernels promises (its tests ``tests/test_layer.py`` and ``tests/test_func.py`` and the ``layer``
code) and checks it on outputs: every kernel here adds a known offset to what the original computes. A
difference kernelpolicy documents is a strict xfail for that way only (see :func:`ways`). Kernels come from
small local repositories written under each test's ``tmp_path``; nothing reaches the Hub.
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kernels
import pytest
import torch
from torch import nn

import kernelpolicy
from kernelpolicy._attach._attach import kernel_modules
from kernelpolicy._attach._aware import binding_of
from kernelpolicy.testing import local_mapping, rms_norm_kernel_source, write_kernel_repo

Mode = kernels.Mode
T = TypeVar("T")

WAYS = ("plain", "dropin", "attach")
HIDDEN = 8
EPS = 1e-6
LAYER = "RMSNorm"  # the kernel layer name of the norm layers, and the class name in rms_norm_kernel_source
FUNC = "Scale"  # the kernel layer name of the function kernel


def ways(**xfail: str) -> pytest.MarkDecorator:
    """Parametrize ``way``; ``dropin=reason`` / ``attach=reason`` mark a difference kernelpolicy documents.

    Such a way is a strict xfail on a failed assertion (a wrong output), not on any other error.
    """
    return pytest.mark.parametrize(
        "way",
        [
            pytest.param(
                way,
                id=way,
                marks=[pytest.mark.xfail(strict=True, raises=AssertionError, reason=xfail[way])]
                if way in xfail
                else [],
            )
            for way in WAYS
        ],
    )


# --- what the installed kernels offers (by attribute, never by version string) ---------------------


def _has_parameter(function: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(function).parameters


#: ``use_kernel_forward_from_hub(name, condition)``: kernels >= 0.17.
HAS_CONDITION = _has_parameter(kernels.use_kernel_forward_from_hub, "condition")
#: ``get_kernelized_layers``: kernels >= 0.19.
HAS_KERNELIZED_LAYERS = hasattr(kernels, "get_kernelized_layers")
#: ``KernelizeFallback`` flags for ``kernelize(use_fallback=...)``.
HAS_FALLBACK_FLAGS = hasattr(kernels, "KernelizeFallback")


def _function_modules() -> tuple[bool, bool]:
    """Whether ``use_kernelized_func`` gives each instance its own function module, and whether function modules
    pickle (``Func.__reduce__``): both kernels >= 0.19."""

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x

    function = kernels.use_kernel_forward_from_hub("_contract_probe")(probe)

    @kernels.use_kernelized_func(function)
    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    per_model = all(wrapper is not function for wrapper in Probe()._kernel_funcs.values())
    return per_model, "__reduce__" in vars(type(function))


PER_MODEL_FUNCTIONS, FUNCTIONS_PICKLE = _function_modules()

needs_condition = pytest.mark.skipif(not HAS_CONDITION, reason="kernels < 0.17 has no kernel condition")
needs_kernelized_layers = pytest.mark.skipif(
    not HAS_KERNELIZED_LAYERS, reason="kernels < 0.19 has no get_kernelized_layers"
)
needs_fallback_flags = pytest.mark.skipif(not HAS_FALLBACK_FLAGS, reason="this kernels has no KernelizeFallback")
needs_per_model_functions = pytest.mark.skipif(
    not PER_MODEL_FUNCTIONS, reason="kernels < 0.19 shares one function module between all models"
)


# --- the layers, functions and kernels --------------------------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """What the norm layers compute (Llama's RMSNorm), as ``rms_norm_kernel_source`` does before its offset."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def func_kernel_source(*, offset: float, can_torch_compile: bool = True, class_name: str = "ScaleKernel") -> str:
    """``layers.py`` of a kernel for the ``Scale`` function (``x * 2``): ``x * 2 + offset``."""
    return f"""
        import torch
        from torch import nn


        class {class_name}(nn.Module):
            can_torch_compile = {can_torch_compile!r}
            has_backward = True

            def forward(self, x):
                return x * 2.0 + {offset!r}
    """


def layer_repo(path: Path, layer_name: str = LAYER) -> Any:
    return kernels.LocalLayerRepository(repo_path=path, layer_name=layer_name)


def use_mapping(entries: dict[str, Any], *, inherit: bool = True) -> Any:
    """``kernels.use_kernel_mapping`` with each entry on the CPU (a repository, or a dict by ``Mode``)."""
    return kernels.use_kernel_mapping({name: {"cpu": repo} for name, repo in entries.items()}, inherit_mapping=inherit)


class Kit:
    """One way of using kernels: how layers and functions are marked and how models are kernelized."""

    def __init__(self, way: str, root: Path) -> None:
        self.way = way
        self.root = root
        self.published: list[str] = []

    # marking and binding

    def mark(self, layer_name: str, condition: Callable[[nn.Module], bool] | None = None) -> Callable[[T], T]:
        module: Any = kernelpolicy if self.way == "dropin" else kernels
        args = () if condition is None else (condition,)
        return module.use_kernel_forward_from_hub(layer_name, *args)  # type: ignore[no-any-return]

    def replace_forward(self, cls: type[nn.Module], layer_name: str) -> None:
        module: Any = kernelpolicy if self.way == "dropin" else kernels
        module.replace_kernel_forward_from_hub(cls, layer_name)

    def kernelize(
        self,
        model: nn.Module,
        *,
        mode: Any = Mode.INFERENCE,
        device: str | torch.device | None = "cpu",
        use_fallback: Any = True,
    ) -> nn.Module:
        if self.way == "dropin":
            result: nn.Module = kernelpolicy.kernelize(model, mode=mode, device=device, use_fallback=use_fallback)
        else:
            result = kernels.kernelize(model, mode=mode, device=device, use_fallback=use_fallback)
            if self.way == "attach":
                result = kernelpolicy.attach(result)
        for name, module in kernel_modules(result):  # the way is what it says: policy-aware modules or none
            assert (binding_of(module) is not None) == (self.way != "plain"), (self.way, name)
        return result

    # repositories

    def repo(self, source: str, *, exports: tuple[str, ...] = ()) -> Path:
        return write_kernel_repo(self.root / f"repo-{uuid.uuid4().hex[:8]}", source, exports=exports)

    def norm_repo(self, offset: float, **spec: Any) -> Any:
        """A ``RMSNorm`` kernel repository: the original norm plus ``offset``."""
        return layer_repo(self.repo(rms_norm_kernel_source(offset=offset, **spec)))

    def func_repo(self, offset: float, **spec: Any) -> Any:
        return layer_repo(self.repo(func_kernel_source(offset=offset, **spec)), "ScaleKernel")

    # classes and functions, published at module level so that pickle finds them

    def publish(self, obj: T, stem: str) -> T:
        name = f"_{stem}_{self.way}_{uuid.uuid4().hex[:8]}"
        for attribute, value in (("__module__", __name__), ("__qualname__", name), ("__name__", name)):
            setattr(obj, attribute, value)
        globals()[name] = obj
        self.published.append(name)
        return obj

    def norm_class(
        self, layer_name: str = LAYER, condition: Callable[[nn.Module], bool] | None = None
    ) -> type[nn.Module]:
        """A Llama-style RMSNorm marked for ``layer_name`` (``weight``, ``variance_epsilon``)."""

        @self.mark(layer_name, condition)
        class Norm(nn.Module):
            def __init__(self, hidden: int = HIDDEN) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
                self.variance_epsilon = EPS

            def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
                return rms(hidden_states, self.weight, self.variance_epsilon)

        return self.publish(Norm, "Norm")

    def function(self, layer_name: str = FUNC) -> nn.Module:
        """A function ``x * 2`` marked for ``layer_name``: kernels makes it a ``Func`` module."""

        def scale(x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

        raw = self.publish(scale, "scale")
        marked = self.mark(layer_name)(raw)
        globals()[raw.__name__] = marked  # the name the Func module pickles by
        return marked  # type: ignore[return-value]

    def func_model_class(self, function: nn.Module | None = None) -> type[nn.Module]:
        """``linear -> norm -> function``, the function attached with ``kernels.use_kernelized_func``."""
        fn = self.function() if function is None else function
        norm_class = self.norm_class()

        @kernels.use_kernelized_func(fn)
        class FuncNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(HIDDEN, HIDDEN)
                self.norm = norm_class()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return fn(self.norm(self.linear(x)))  # type: ignore[no-any-return]

        return self.publish(FuncNet, "FuncNet")


@pytest.fixture
def kit(way: str, tmp_path: Path) -> Iterator[Kit]:
    made = Kit(way, tmp_path)
    yield made
    for name in made.published:
        globals().pop(name, None)


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach(), expected, rtol=1e-5, atol=1e-5)


def norm_out(norm: Any, x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """The original norm's output on ``x``, plus ``offset`` (the kernel's path)."""
    with torch.no_grad():
        return rms(x, norm.weight.detach(), EPS) + offset


def func_net_out(model: Any, x: torch.Tensor, *, norm_offset: float = 0.0, func_offset: float = 0.0) -> Any:
    """``FuncNet``'s output with these kernel offsets (0: the original forward)."""
    with torch.no_grad():
        return (norm_out(model.norm, model.linear(x), norm_offset)) * 2.0 + func_offset


# --- layers: binding ---------------------------------------------------------------------------------


@ways()
def test_kernelize_binds_the_mapped_kernel(kit: Kit, x: torch.Tensor) -> None:
    """kernelize replaces the forward of each marked layer with the mapped kernel (also when ``forward`` is called
    directly), returns the model, and the kernel stays bound after the mapping's context; the kernel reads the
    module's own, current parameters."""
    norm_class = kit.norm_class()
    norm = norm_class()
    close(norm(x), norm_out(norm, x))
    with use_mapping({LAYER: kit.norm_repo(1.0)}):
        assert kit.kernelize(norm) is norm
    close(norm(x), norm_out(norm, x, 1.0))
    close(norm.forward(x), norm_out(norm, x, 1.0))
    assert isinstance(norm, norm_class)
    with torch.no_grad():
        norm.weight.mul_(3.0)
    close(norm(x), norm_out(norm, x, 1.0))


@ways()
def test_kernelize_binds_every_instance_of_a_model(kit: Kit, x: torch.Tensor) -> None:
    """Every marked module of a model is kernelized, and the model's structure, state_dict keys, hooks and
    dtype conversions are those of the unkernelized model (a kernel layer is stateless)."""
    norm_class = kit.norm_class()
    model = nn.Sequential(norm_class(), nn.Linear(HIDDEN, HIDDEN), norm_class())
    names, keys, text = [name for name, _ in model.named_modules()], list(model.state_dict()), repr(model)
    with kernels.use_kernel_mapping({LAYER: {kernels.Device(type="cpu"): kit.norm_repo(1.0)}}):
        kit.kernelize(model)
    assert [name for name, _ in model.named_modules()] == names
    assert list(model.state_dict()) == keys
    assert repr(model) == text
    with torch.no_grad():
        expected = norm_out(model[2], model[1](norm_out(model[0], x, 1.0)), 1.0)
    close(model(x), expected)

    state = {key: value * 2 for key, value in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        expected = norm_out(model[2], model[1](norm_out(model[0], x, 1.0)), 1.0)
    close(model(x), expected)

    pre = model[0].register_forward_pre_hook(lambda _module, args: (args[0] + 1.0,))
    post = model[0].register_forward_hook(lambda _module, _args, out: out * 3.0)
    close(model[0](x), norm_out(model[0], x + 1.0, 1.0) * 3.0)
    pre.remove()
    post.remove()
    close(model[0](x), norm_out(model[0], x, 1.0))

    model.double()
    out = model[0](x.double())
    assert out.dtype == torch.float64
    close(out, norm_out(model[0], x.double(), 1.0))


@ways()
def test_kernelize_infers_the_device_from_parameters(kit: Kit, x: torch.Tensor) -> None:
    """Without ``device``, kernelize takes the device type from the model's parameters (a ``torch.device`` works
    as its type); a model without parameters needs ``device`` (ValueError)."""
    norm_class = kit.norm_class()
    by_parameters, by_torch_device = norm_class(), norm_class()
    with use_mapping({LAYER: kit.norm_repo(1.0)}):
        kit.kernelize(by_parameters, device=None)
        kit.kernelize(by_torch_device, device=torch.device("cpu"))
    close(by_parameters(x), norm_out(by_parameters, x, 1.0))
    close(by_torch_device(x), norm_out(by_torch_device, x, 1.0))

    @kit.mark("NoParameters")
    class NoParameters(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match="Cannot determine model device"):
        kit.kernelize(NoParameters(), device=None)


@ways()
def test_kernel_keeps_the_original_signature_and_its_defaults(kit: Kit) -> None:
    """A marked layer keeps its forward's argument kinds (positional, keyword-only, defaults); the bound kernel
    is called with what the caller passed, so a default the caller leaves out is the kernel's own."""

    @kit.mark("ArgKinds")
    class ArgKinds(nn.Module):
        def forward(self, a: Any, b: Any, *, c: Any, d: Any = 42) -> Any:
            return ("original", a, b, c, d)

    layer = ArgKinds()
    assert layer("a", "b", c="c") == ("original", "a", "b", "c", 42)
    assert layer("a", "b", c="c", d=5) == ("original", "a", "b", "c", 5)
    repo = kit.repo(
        """
        from torch import nn


        class ArgKinds(nn.Module):
            def forward(self, a, b, *, c, d=7):
                return ("kernel", a, b, c, d)
        """
    )
    with use_mapping({"ArgKinds": layer_repo(repo, "ArgKinds")}):
        kit.kernelize(layer)
    assert layer("a", b="b", c="c") == ("kernel", "a", "b", "c", 7)
    assert layer("a", "b", c="c", d=5) == ("kernel", "a", "b", "c", 5)


@ways()
def test_replace_kernel_forward_from_hub_marks_a_third_party_class(kit: Kit, x: torch.Tensor) -> None:
    """``replace_kernel_forward_from_hub(cls, name)`` makes an existing class kernelizable, as the decorator."""

    class ThirdPartyNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))
            self.variance_epsilon = EPS

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return rms(hidden_states, self.weight, self.variance_epsilon)

    kit.replace_forward(ThirdPartyNorm, LAYER)
    assert ThirdPartyNorm.kernel_layer_name == LAYER  # type: ignore[attr-defined]
    norm = ThirdPartyNorm()
    close(norm(x), norm_out(norm, x))
    with use_mapping({LAYER: kit.norm_repo(2.0)}):
        kit.kernelize(norm)
    close(norm(x), norm_out(norm, x, 2.0))


# --- layers: kernelizing again, mappings ----------------------------------------------------------------


@ways()
def test_kernelize_again_replaces_the_kernel(kit: Kit, x: torch.Tensor) -> None:
    """Kernelizing again binds the kernel of the mapping now in effect (never stacked on the previous one), and
    a mapping without the layer puts the original forward back."""
    norm = kit.norm_class()()
    first, second = kit.norm_repo(1.0), kit.norm_repo(2.0)
    with use_mapping({LAYER: first}):
        kit.kernelize(norm)
        kit.kernelize(norm)
    close(norm(x), norm_out(norm, x, 1.0))
    with use_mapping({LAYER: second}):
        kit.kernelize(norm)
    close(norm(x), norm_out(norm, x, 2.0))
    with use_mapping({}, inherit=False):
        kit.kernelize(norm)
    close(norm(x), norm_out(norm, x))
    with use_mapping({LAYER: first}):
        kit.kernelize(norm)
    close(norm(x), norm_out(norm, x, 1.0))
    with kernels.use_kernel_mapping({LAYER: {}}):  # the layer, but no device: back to the original
        kit.kernelize(norm)
    close(norm(x), norm_out(norm, x))


@ways()
def test_use_kernel_mapping_nests_and_inherits(kit: Kit, x: torch.Tensor) -> None:
    """``use_kernel_mapping`` extends the mapping in effect (an inner entry wins), ``inherit_mapping=False``
    hides the outer ones, each context restores the mapping on exit, and ``register_kernel_mapping`` inside a
    context is undone with it."""
    norm = kit.norm_class()()
    outer, inner, registered = kit.norm_repo(1.0), kit.norm_repo(2.0), kit.norm_repo(3.0)

    def bound_offset() -> float:
        kit.kernelize(norm)
        with torch.no_grad():
            return float((norm(x) - norm_out(norm, x)).mean())

    with use_mapping({LAYER: outer}):
        assert bound_offset() == pytest.approx(1.0)
        with use_mapping({LAYER: inner}):
            assert bound_offset() == pytest.approx(2.0)
        assert bound_offset() == pytest.approx(1.0)
        with use_mapping({"OtherLayer": inner}):
            assert bound_offset() == pytest.approx(1.0)
        with use_mapping({"OtherLayer": inner}, inherit=False):
            assert bound_offset() == pytest.approx(0.0)
        with local_mapping({}, inherit=False):
            kernels.register_kernel_mapping({LAYER: {"cpu": registered}})
            assert bound_offset() == pytest.approx(3.0)
        assert bound_offset() == pytest.approx(1.0)
    assert bound_offset() == pytest.approx(0.0)


_DISABLED_SCRIPT = """
import sys
from pathlib import Path

import kernels
import torch
from torch import nn

import kernelpolicy
from kernelpolicy.testing import rms_norm_kernel_source, write_kernel_repo

torch.set_grad_enabled(False)
way, root = sys.argv[1], Path(sys.argv[2])
mark = (kernelpolicy if way == "dropin" else kernels).use_kernel_forward_from_hub


@mark("RMSNorm")
class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def kernelize(model):
    if way == "dropin":
        kernelpolicy.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    else:
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
        if way == "attach":
            kernelpolicy.attach(model)


repo = write_kernel_repo(root, rms_norm_kernel_source(offset=1.0))
model, x = Norm(), torch.randn(2, 4)
original = model(x)
with kernels.use_kernel_mapping({"RMSNorm": {"cpu": kernels.LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}):
    kernelize(model)
    disabled = float((model(x) - original).mean())
    # control: the same call binds once the flag kernels read at import is off
    kernels.kernelize.__globals__["kernelize_layer"].__globals__["_DISABLE_KERNEL_MAPPING"] = False
    kernelize(model)
    enabled = float((model(x) - original).mean())
print(f"{disabled:.3f} {enabled:.3f}")
"""


@ways()
def test_disable_kernel_mapping_environment(kit: Kit) -> None:
    """With ``DISABLE_KERNEL_MAPPING=1`` (read when kernels is imported) kernelize keeps the original forward
    of every layer, whatever the mapping (a fresh process)."""
    env = {**os.environ, "DISABLE_KERNEL_MAPPING": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _DISABLED_SCRIPT, kit.way, str(kit.root / "repo")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.000", "1.000"]


# --- layers: modes and fallbacks -------------------------------------------------------------------------

INFERENCE, TRAINING, COMPILE = Mode.INFERENCE, Mode.TRAINING, Mode.TORCH_COMPILE
FALLBACK = Mode.FALLBACK

# Registered modes -> offset of each registered kernel; requested mode -> the offset bound (0: the original).
# kernels' priority for a requested mode: itself, then INFERENCE -> INFERENCE|COMPILE -> TRAINING ->
# TRAINING|COMPILE -> FALLBACK; TRAINING never takes an inference kernel; a COMPILE mode never a non-COMPILE one.
MODE_CASES = {
    "inference+training": (
        {INFERENCE: 1.0, TRAINING: 2.0},
        [(INFERENCE, 1.0), (TRAINING, 2.0), (INFERENCE | COMPILE, 0.0), (TRAINING | COMPILE, 0.0)],
    ),
    "training-compile-only": (
        {TRAINING | COMPILE: 3.0},
        [(INFERENCE, 3.0), (TRAINING, 3.0), (INFERENCE | COMPILE, 3.0), (TRAINING | COMPILE, 3.0)],
    ),
    "fallback+training": (
        {FALLBACK: 4.0, TRAINING: 2.0},
        [(INFERENCE, 2.0), (TRAINING, 2.0), (TRAINING | COMPILE, 4.0), (INFERENCE | COMPILE, 4.0)],
    ),
    "inference-only": (
        {INFERENCE: 1.0, INFERENCE | COMPILE: 5.0},
        [(INFERENCE, 1.0), (INFERENCE | COMPILE, 5.0), (TRAINING, 0.0), (TRAINING | COMPILE, 0.0)],
    ),
    "inference-compile-only": (
        {INFERENCE | COMPILE: 5.0},
        [(INFERENCE | COMPILE, 5.0), (INFERENCE, 5.0), (TRAINING, 0.0)],
    ),
}


@ways()
@pytest.mark.parametrize("case", list(MODE_CASES))
def test_mode_selects_the_registered_kernel(kit: Kit, x: torch.Tensor, case: str) -> None:
    """kernelize(mode=...) binds the kernel registered for that mode or the next one in kernels' fallback
    order, and the original forward when none fits; each kernelize re-decides."""
    registered, requests = MODE_CASES[case]
    norm = kit.norm_class()()
    repos = {mode: kit.norm_repo(offset, can_torch_compile=True) for mode, offset in registered.items()}
    with use_mapping({LAYER: repos}):
        for mode, offset in requests:
            kit.kernelize(norm, mode=mode)
            close(norm(x), norm_out(norm, x, offset))


@ways()
def test_invalid_kernelize_modes_are_refused(kit: Kit) -> None:
    """``Mode.FALLBACK`` only registers mappings, and a kernelize mode must contain INFERENCE or TRAINING."""
    norm = kit.norm_class()()
    with pytest.raises(ValueError, match="can only be used to register kernel mappings"):
        kit.kernelize(norm, mode=Mode.FALLBACK)
    with pytest.raises(ValueError, match="mode must contain"):
        kit.kernelize(norm, mode=Mode.TORCH_COMPILE)


@ways()
def test_torch_compile_mode_needs_can_torch_compile(kit: Kit, x: torch.Tensor) -> None:
    """A kernel without ``can_torch_compile`` is not bound for a TORCH_COMPILE mode: the original forward is
    (fallback), or kernelize raises with ``use_fallback=False`` and leaves the module as it was."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0, can_torch_compile=False)}):
        kit.kernelize(norm, mode=INFERENCE | COMPILE)
        close(norm(x), norm_out(norm, x))
        kit.kernelize(norm, mode=INFERENCE)
        close(norm(x), norm_out(norm, x, 1.0))
        with pytest.raises(ValueError, match="does not support"):
            kit.kernelize(norm, mode=INFERENCE | COMPILE, use_fallback=False)
    close(norm(x), norm_out(norm, x, 1.0))


@ways()
def test_training_mode_needs_has_backward(kit: Kit, x: torch.Tensor) -> None:
    """A kernel with ``has_backward = False`` is not bound for TRAINING: the original forward is (fallback), or
    kernelize raises with ``use_fallback=False``; INFERENCE binds it."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0, has_backward=False)}):
        kit.kernelize(norm, mode=TRAINING)
        close(norm(x), norm_out(norm, x))
        with pytest.raises(ValueError, match="does not support"):
            kit.kernelize(norm, mode=TRAINING, use_fallback=False)
        kit.kernelize(norm, mode=INFERENCE)
    with torch.no_grad():  # a call autograd records is another contract (below)
        close(norm(x), norm_out(norm, x, 1.0))
    with torch.inference_mode():
        close(norm(x), norm_out(norm, x, 1.0))


@ways()
def test_training_mode_kernel_runs_forward_and_backward(kit: Kit, x: torch.Tensor) -> None:
    """A kernel bound for TRAINING runs in train and eval mode and under autograd; gradients are the kernel's
    (this kernel computes twice the norm, so every gradient doubles)."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(0.0, scale=2.0)}):
        kit.kernelize(norm, mode=TRAINING)
    weight = norm.weight.detach().clone().requires_grad_()
    inputs = x.clone().requires_grad_()
    (rms(inputs, weight) * 2.0).pow(2).sum().backward()
    for training in (True, False):
        norm.train(training)
        norm.zero_grad()
        leaf = x.clone().requires_grad_()
        out = norm(leaf)
        close(out, norm_out(norm, x) * 2.0)
        out.pow(2).sum().backward()
        assert norm.weight.grad is not None and leaf.grad is not None
        close(norm.weight.grad, weight.grad)  # type: ignore[arg-type]
        close(leaf.grad, inputs.grad)  # type: ignore[arg-type]


@ways(
    dropin="by design (README, Execution states): under prefer a kernel with has_backward = False gives way "
    "to the original forward on a call autograd records",
    attach="by design (README, Execution states): under prefer a kernel with has_backward = False gives way "
    "to the original forward on a call autograd records",
)
def test_inference_kernel_without_backward_runs_under_autograd(kit: Kit, x: torch.Tensor) -> None:
    """kernels checks ``has_backward`` only when kernelizing for TRAINING: a kernel bound for INFERENCE runs on
    every call, also one whose inputs require grad."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0, has_backward=False)}):
        kit.kernelize(norm, mode=INFERENCE)
    close(norm(x.clone().requires_grad_()), norm_out(norm, x, 1.0))


@ways()
def test_no_mapping_for_the_layer_falls_back(kit: Kit, x: torch.Tensor) -> None:
    """A layer the mapping does not name keeps its original forward; ``use_fallback=False`` raises instead."""
    norm = kit.norm_class()()
    with use_mapping({"SomethingElse": kit.norm_repo(1.0)}, inherit=False):
        kit.kernelize(norm)
        close(norm(x), norm_out(norm, x))
        with pytest.raises(ValueError, match="No layer mapping"):
            kit.kernelize(norm, use_fallback=False)
    close(norm(x), norm_out(norm, x))


@ways()
def test_no_mapping_for_the_device_falls_back(kit: Kit, x: torch.Tensor) -> None:
    """A layer mapped for another device type keeps its original forward on this one; ``use_fallback=False``
    raises instead."""
    norm = kit.norm_class()()
    with kernels.use_kernel_mapping({LAYER: {"cuda": kit.norm_repo(1.0)}}, inherit_mapping=False):
        kit.kernelize(norm, device="cpu")
        close(norm(x), norm_out(norm, x))
        with pytest.raises(ValueError, match="device type"):
            kit.kernelize(norm, device="cpu", use_fallback=False)
    close(norm(x), norm_out(norm, x))


FALLBACK_CASES = ("no-layer", "no-device", "no-mode", "cannot-load")


@ways()
@needs_fallback_flags
@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_kernelize_fallback_flags(kit: Kit, x: torch.Tensor, case: str) -> None:
    """``use_fallback=KernelizeFallback.<flag>`` falls back (original forward) exactly in the flag's case and
    raises in the others; DEFAULT covers all but CANNOT_LOAD, ALL covers that too (a repository without a
    build for this system)."""
    flags = kernels.KernelizeFallback
    norm = kit.norm_class()()
    if case == "no-layer":
        mapping, flag, error = {"Other": {"cpu": kit.norm_repo(1.0)}}, flags.NO_LAYER, "No layer mapping"
    elif case == "no-device":
        mapping, flag, error = {LAYER: {"cuda": kit.norm_repo(1.0)}}, flags.NO_DEVICE, "device type"
    elif case == "no-mode":
        mapping, flag, error = {LAYER: {"cpu": {INFERENCE: kit.norm_repo(1.0)}}}, flags.NO_COMPATIBLE_MODE, "mode"
    else:
        (kit.root / "unbuilt" / "build").mkdir(parents=True)
        mapping, flag, error = {LAYER: {"cpu": layer_repo(kit.root / "unbuilt")}}, flags.CANNOT_LOAD, "build variant"
    mode = TRAINING if case == "no-mode" else INFERENCE
    others = flags.ALL & ~flag
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        with pytest.raises((ValueError, FileNotFoundError), match=error):
            kit.kernelize(norm, mode=mode, use_fallback=others)
        kit.kernelize(norm, mode=mode, use_fallback=flag)
        close(norm(x), norm_out(norm, x))
        kit.kernelize(norm, mode=mode, use_fallback=flags.ALL)
        close(norm(x), norm_out(norm, x))
        if case == "cannot-load":
            with pytest.raises(FileNotFoundError):
                kit.kernelize(norm, mode=mode, use_fallback=flags.DEFAULT)
        else:
            kit.kernelize(norm, mode=mode, use_fallback=flags.DEFAULT)
        close(norm(x), norm_out(norm, x))


@ways()
@needs_condition
def test_kernel_condition_selects_instances(kit: Kit, x: torch.Tensor) -> None:
    """``use_kernel_forward_from_hub(name, condition)``: kernelize binds only instances for which the condition
    holds when it runs; an instance it skips is left as it was (a kernel bound before stays)."""
    norm_class = kit.norm_class(condition=lambda module: bool(getattr(module, "wants_kernel", True)))
    chosen, skipped = norm_class(), norm_class()
    skipped.wants_kernel = False
    model = nn.ModuleDict({"chosen": chosen, "skipped": skipped})
    with use_mapping({LAYER: kit.norm_repo(1.0)}):
        kit.kernelize(model)
    close(chosen(x), norm_out(chosen, x, 1.0))
    close(skipped(x), norm_out(skipped, x))

    chosen.wants_kernel = False
    with use_mapping({LAYER: kit.norm_repo(2.0)}):
        kit.kernelize(model)
    close(chosen(x), norm_out(chosen, x, 1.0))
    close(skipped(x), norm_out(skipped, x))


VALIDATION_CASES = {
    "constructor": (
        """
        def __init__(self):
            super().__init__()

        def forward(self, hidden_states):
            return hidden_states
        """,
        "must not override nn.Module constructor",
    ),
    "extra-member": (
        """
        extra = 42

        def forward(self, hidden_states):
            return hidden_states
        """,
        "must not contain additional members",
    ),
    "argument-count": (
        """
        def forward(self, hidden_states, scale):
            return hidden_states
        """,
        "different number of arguments",
    ),
    "argument-kind": (
        """
        def forward(self, *, hidden_states):
            return hidden_states
        """,
        "different kind of arguments",
    ),
}


@ways()
@pytest.mark.parametrize("case", list(VALIDATION_CASES))
def test_invalid_kernel_layer_is_refused(kit: Kit, x: torch.Tensor, case: str) -> None:
    """kernels validates a kernel layer before binding it (no ``__init__``, no members beyond ``forward``,
    ``can_torch_compile`` and ``has_backward``, the original forward's argument count and kinds): TypeError,
    even with every fallback allowed, and the module keeps its forward."""
    body, message = VALIDATION_CASES[case]
    source = "import torch\nfrom torch import nn\n\n\nclass RMSNorm(nn.Module):\n" + textwrap.indent(
        textwrap.dedent(body), "    "
    )
    norm = kit.norm_class()()
    fallback = kernels.KernelizeFallback.ALL if HAS_FALLBACK_FLAGS else True
    with use_mapping({LAYER: layer_repo(kit.repo(source))}), pytest.raises(TypeError, match=message):
        kit.kernelize(norm, use_fallback=fallback)
    close(norm(x), norm_out(norm, x))


# --- layers: copies, pickles, compile ------------------------------------------------------------------


@ways()
def test_shallow_copy_keeps_the_kernel(kit: Kit, x: torch.Tensor) -> None:
    """``copy.copy`` of a kernelized layer copies its instance attributes, the bound kernel among them: the copy
    computes what the original computes, and kernelizing the copy again leaves the original's kernel."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0)}):
        kit.kernelize(norm)
    copied = copy.copy(norm)
    close(copied(x), norm_out(norm, x, 1.0))
    close(norm(x), norm_out(norm, x, 1.0))
    with use_mapping({LAYER: kit.norm_repo(2.0)}):  # the copy's forward is its own
        kit.kernelize(copied)
    close(copied(x), norm_out(norm, x, 2.0))
    close(norm(x), norm_out(norm, x, 1.0))


@ways()
def test_deep_copy_keeps_the_kernel_with_its_own_weights(kit: Kit, x: torch.Tensor) -> None:
    """``copy.deepcopy`` of a kernelized model keeps each kernel, bound to the copy: the copy computes with its
    own weights, and changing them leaves the original alone."""
    norm_class = kit.norm_class()
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), norm_class())
    with use_mapping({LAYER: kit.norm_repo(1.0)}):
        kit.kernelize(model)
    before = model(x).detach()
    copied = copy.deepcopy(model)
    close(copied(x), before)
    with torch.no_grad():
        copied[1].weight.mul_(3.0)
        expected = norm_out(copied[1], copied[0](x), 1.0)
    close(copied(x), expected)
    close(model(x), before)
    with use_mapping({LAYER: kit.norm_repo(2.0)}):
        kit.kernelize(copied)
    with torch.no_grad():
        close(copied(x), norm_out(copied[1], copied[0](x), 2.0))
    close(model(x), before)


@ways()
def test_pickle_round_trip_of_kernelized_layers(kit: Kit, x: torch.Tensor) -> None:
    """A pickled kernelized layer loads with the original forward (kernels' bound method pickles as
    ``getattr(module, "forward")``, the class's); kernelizing the loaded module binds the kernel again."""
    norm = kit.norm_class()()
    repo = kit.norm_repo(1.0)
    with use_mapping({LAYER: repo}):
        kit.kernelize(norm)
    loaded = pickle.loads(pickle.dumps(norm))
    close(loaded(x), norm_out(loaded, x))
    close(norm(x), norm_out(norm, x, 1.0))
    with use_mapping({LAYER: repo}):
        kit.kernelize(loaded)
    close(loaded(x), norm_out(loaded, x, 1.0))


@ways()
@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_fullgraph_runs_a_traceable_layer_kernel(kit: Kit, x: torch.Tensor) -> None:
    """A kernel with ``can_torch_compile = True`` bound for INFERENCE | TORCH_COMPILE is traced into the
    compiled graph (fullgraph)."""
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), kit.norm_class()())
    with use_mapping({LAYER: kit.norm_repo(1.0, can_torch_compile=True)}):
        kit.kernelize(model, mode=INFERENCE | COMPILE)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        expected = norm_out(model[1], model[0](x), 1.0)
        close(compiled(x), expected)
        model.compile(fullgraph=True, backend="eager")  # in place: nn.Module.compile
        close(model(x), expected)


@ways()
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_training_differentiates_the_kernel(kit: Kit, x: torch.Tensor) -> None:
    """A kernel with backward bound for TRAINING | TORCH_COMPILE is what the compiled forward and backward run
    (this kernel computes twice the norm, so every gradient doubles)."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(0.0, scale=2.0, can_torch_compile=True)}):
        kit.kernelize(norm, mode=TRAINING | COMPILE)
    weight = norm.weight.detach().clone().requires_grad_()
    (rms(x, weight) * 2.0).pow(2).sum().backward()
    compiled = torch.compile(norm.train(), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    close(out, norm_out(norm, x) * 2.0)
    out.pow(2).sum().backward()
    assert norm.weight.grad is not None
    close(norm.weight.grad, weight.grad)  # type: ignore[arg-type]


@ways(
    dropin="by design (README, Execution states): under torch.compile a kernel runs only if it declares "
    "can_torch_compile = True",
    attach="by design (README, Execution states): under torch.compile a kernel runs only if it declares "
    "can_torch_compile = True",
)
@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_traces_whatever_kernel_is_bound(kit: Kit, x: torch.Tensor) -> None:
    """kernels checks ``can_torch_compile`` only when kernelizing for TORCH_COMPILE: a kernel bound for
    INFERENCE is what ``torch.compile`` traces, whatever it declares."""
    norm = kit.norm_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0, can_torch_compile=False)}):
        kit.kernelize(norm, mode=INFERENCE)
    compiled = torch.compile(norm, fullgraph=True, backend="eager")
    with torch.no_grad():
        close(compiled(x), norm_out(norm, x, 1.0))


# --- layers and functions: what kernels reports ---------------------------------------------------------


@ways()
@needs_kernelized_layers
def test_get_kernelized_layers_reports_layers_functions_and_repositories(kit: Kit, x: torch.Tensor) -> None:
    """``get_kernelized_layers(model)`` lists each kernelized layer by module name and each kernelized function
    by (owner name, function name), with the module and the repository its kernel came from; layers and
    functions that fell back are not listed."""
    model = kit.func_model_class()()
    outer = nn.ModuleDict({"block": model})
    norm_repo, func_repo = kit.norm_repo(1.0), kit.func_repo(10.0)
    with use_mapping({LAYER: norm_repo, FUNC: func_repo}):
        kit.kernelize(outer)
    close(model(x), func_net_out(model, x, norm_offset=1.0, func_offset=10.0))
    found = kernels.get_kernelized_layers(outer)
    assert list(found.layers) == ["block.norm"]
    assert found.layers["block.norm"].module is model.norm
    assert found.layers["block.norm"].repo == norm_repo
    [(key, func)] = found.funcs.items()
    assert key == ("block", next(iter(model._kernel_funcs)))
    assert func.module is next(iter(model._kernel_funcs.values()))
    assert func.repo == func_repo

    with use_mapping({FUNC: func_repo}, inherit=False):
        kit.kernelize(outer)
    close(model(x), func_net_out(model, x, func_offset=10.0))
    found = kernels.get_kernelized_layers(outer)
    assert (list(found.layers), list(found.funcs)) == ([], [key])
    with use_mapping({}, inherit=False):
        kit.kernelize(outer)
    close(model(x), func_net_out(model, x))
    found = kernels.get_kernelized_layers(outer)
    assert (found.layers, found.funcs) == ({}, {})


# --- functions ---------------------------------------------------------------------------------------------


@ways()
def test_marked_function_is_a_module_calling_the_function(kit: Kit, x: torch.Tensor) -> None:
    """``use_kernel_forward_from_hub(name)`` on a function returns an ``nn.Module`` instance whose class has the
    kernel layer name and whose call runs the function."""
    function = kit.function()
    assert isinstance(function, nn.Module)
    assert type(function).kernel_layer_name == FUNC  # type: ignore[attr-defined]
    close(function(x), x * 2.0)


@ways()
def test_function_kernel_is_bound_and_reverts(kit: Kit, x: torch.Tensor) -> None:
    """A function attached with ``use_kernelized_func`` is kernelized with its model: the model computes with
    the function's kernel; an empty entry for the function puts the function back."""
    model = kit.func_model_class()()
    close(model(x), func_net_out(model, x))
    with use_mapping({FUNC: kit.func_repo(10.0)}):
        kit.kernelize(model)
    close(model(x), func_net_out(model, x, func_offset=10.0))
    with kernels.use_kernel_mapping({FUNC: {}}):
        kit.kernelize(model)
    close(model(x), func_net_out(model, x))


@ways()
def test_function_not_attached_is_not_kernelized(kit: Kit, x: torch.Tensor) -> None:
    """A marked function is only visible to kernelize when attached with ``use_kernelized_func``: a model that
    merely calls it keeps the function."""
    fn = kit.function()

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(self.linear(x))  # type: ignore[no-any-return]

    model = Caller()
    with use_mapping({FUNC: kit.func_repo(10.0)}):
        kit.kernelize(model)
    with torch.no_grad():
        close(model(x), model.linear(x) * 2.0)


@ways()
def test_function_module_held_as_a_submodule_is_kernelized_like_a_layer(kit: Kit, x: torch.Tensor) -> None:
    """A marked function assigned as a submodule (``self.fn = fn``, kernels' ``use_kernel_func_from_hub``
    example) is a module with a kernel layer name: kernelize binds its kernel like a layer's."""
    fn = kit.function()

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(HIDDEN, HIDDEN)
            self.fn = fn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fn(self.linear(x))  # type: ignore[no-any-return]

    model = Holder()
    with use_mapping({FUNC: kit.func_repo(10.0)}):
        kit.kernelize(model)
    with torch.no_grad():
        close(model(x), model.linear(x) * 2.0 + 10.0)


@ways()
def test_function_kernel_modes_follow_its_flags(kit: Kit, x: torch.Tensor) -> None:
    """A function kernel is selected like a layer kernel: one without ``can_torch_compile`` is not bound for a
    TORCH_COMPILE mode (the function runs, or kernelize raises with ``use_fallback=False``)."""
    model = kit.func_model_class()()
    with use_mapping({FUNC: kit.func_repo(10.0, can_torch_compile=False)}):
        kit.kernelize(model, mode=INFERENCE | COMPILE)
        close(model(x), func_net_out(model, x))
        kit.kernelize(model, mode=INFERENCE)
        close(model(x), func_net_out(model, x, func_offset=10.0))
        with pytest.raises(ValueError, match="does not support"):
            kit.kernelize(model, mode=INFERENCE | COMPILE, use_fallback=False)
    close(model(x), func_net_out(model, x, func_offset=10.0))


@ways()
def test_identity_function_returns_its_input_object(kit: Kit, x: torch.Tensor) -> None:
    """An unkernelized (or reverted) function module returns exactly what the function returns (kernels' tests
    check ``model(x) is x`` for an identity function)."""

    def identity(x: torch.Tensor) -> torch.Tensor:
        return x

    function = kit.mark("Identity")(identity)

    @kernels.use_kernelized_func(function)
    class Identity(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return function(x)

    model = Identity()
    assert model(x) is x
    repo = kit.repo(
        """
        from torch import nn


        class Shift(nn.Module):
            def forward(self, x):
                return x + 1.0
        """
    )
    with use_mapping({"Identity": layer_repo(repo, "Shift")}):
        kit.kernelize(model)
    close(model(x), x + 1.0)
    with kernels.use_kernel_mapping({"Identity": {}}):
        kit.kernelize(model)
    assert model(x) is x


@ways()
def test_function_kernel_from_a_function_repository(kit: Kit, x: torch.Tensor) -> None:
    """A function can also be mapped to a function a kernel package exports (``LocalFuncRepository``)."""
    model = kit.func_model_class()()
    repo = kit.repo(
        """
        def scale_kernel(x):
            return x * 2.0 + 20.0
        """,
        exports=("scale_kernel",),
    )
    func_repository = kernels.LocalFuncRepository(repo_path=repo, func_name="scale_kernel")
    with use_mapping({FUNC: func_repository}):
        kit.kernelize(model)
    close(model(x), func_net_out(model, x, func_offset=20.0))


@ways()
@needs_per_model_functions
def test_function_kernels_are_per_model(kit: Kit, x: torch.Tensor) -> None:
    """Each model instance has its own function module (``type(fn)()``): kernelizing one model, or another with
    another mapping, leaves the others' functions and the global function as they were; a call of the function
    runs the module of the innermost model whose forward is running."""
    fn = kit.function()
    model_class = kit.func_model_class(fn)
    first, second, untouched = model_class(), model_class(), model_class()
    assert all(wrapper is not fn for wrapper in first._kernel_funcs.values())
    with use_mapping({FUNC: kit.func_repo(10.0)}):
        kit.kernelize(first)
    with use_mapping({FUNC: kit.func_repo(20.0)}):
        kit.kernelize(second)
    close(first(x), func_net_out(first, x, func_offset=10.0))
    close(second(x), func_net_out(second, x, func_offset=20.0))
    close(untouched(x), func_net_out(untouched, x))
    close(fn(x), x * 2.0)

    @kernels.use_kernelized_func(fn)
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model_class()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(self.inner(x))  # type: ignore[no-any-return]

    outer = Outer()
    with use_mapping({FUNC: kit.func_repo(30.0)}):
        kit.kernelize(outer.inner)
    close(outer(x), func_net_out(outer.inner, x, func_offset=30.0) * 2.0)
    with use_mapping({FUNC: kit.func_repo(40.0)}):
        kit.kernelize(outer)
    close(outer(x), func_net_out(outer.inner, x, func_offset=40.0) * 2.0 + 40.0)


@ways()
def test_copies_of_a_model_with_function_kernels(kit: Kit, x: torch.Tensor) -> None:
    """``copy.copy`` of a model and of its function module keep the kernels; ``copy.deepcopy`` keeps them too,
    and the deep copy computes with its own weights."""
    model = kit.func_model_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0), FUNC: kit.func_repo(10.0)}):
        kit.kernelize(model)
    expected = func_net_out(model, x, norm_offset=1.0, func_offset=10.0)
    close(model(x), expected)

    close(copy.copy(model)(x), expected)
    wrapper = next(iter(model._kernel_funcs.values()))
    close(copy.copy(wrapper)(x), x * 2.0 + 10.0)
    close(copy.deepcopy(wrapper)(x), x * 2.0 + 10.0)

    deep = copy.deepcopy(model)
    close(deep(x), expected)
    with torch.no_grad():
        deep.linear.weight.mul_(-1.0)
        deep.norm.weight.mul_(3.0)
    close(deep(x), func_net_out(deep, x, norm_offset=1.0, func_offset=10.0))
    close(model(x), expected)


@ways()
def test_pickle_round_trip_of_a_model_with_function_kernels(kit: Kit, x: torch.Tensor) -> None:
    """kernels >= 0.19 pickles a model's function modules with their bound kernel (``Func.__reduce__``; the
    global function by its name) while a layer's kernel is dropped as in
    :func:`test_pickle_round_trip_of_kernelized_layers`; the loaded model kernelizes again. kernels < 0.19's
    function modules are local classes that do not pickle."""
    fn = kit.function()
    model = kit.func_model_class(fn)()
    with use_mapping({LAYER: kit.norm_repo(1.0), FUNC: kit.func_repo(10.0)}):
        kit.kernelize(model)
    if not FUNCTIONS_PICKLE:
        for unpicklable in (model, fn):
            with pytest.raises((AttributeError, pickle.PicklingError), match="local"):
                pickle.dumps(unpicklable)
        return
    assert pickle.loads(pickle.dumps(fn)) is fn
    loaded = pickle.loads(pickle.dumps(model))
    close(loaded(x), func_net_out(loaded, x, func_offset=10.0))
    close(model(x), func_net_out(model, x, norm_offset=1.0, func_offset=10.0))
    with use_mapping({LAYER: kit.norm_repo(2.0), FUNC: kit.func_repo(20.0)}):
        kit.kernelize(loaded)
    close(loaded(x), func_net_out(loaded, x, norm_offset=2.0, func_offset=20.0))
    close(model(x), func_net_out(model, x, norm_offset=1.0, func_offset=10.0))


class HandKernel(nn.Module):
    """A kernel for the ``Scale`` function bound by hand, as kernels' tests do: ``x * 2 + 5``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + 5.0


@ways()
@needs_per_model_functions
@pytest.mark.parametrize("how", ["copy", "deepcopy", "deepcopy model", "pickle model"])
def test_a_forward_bound_by_hand_on_a_function_wrapper_is_kept_by_copies_and_pickles(
    kit: Kit, x: torch.Tensor, how: str
) -> None:
    """kernels' ``test_kernel_func_copy_is_independent`` and ``test_kernel_func_serialization_is_independent``:
    a forward bound on a model's function wrapper as a method (``wrapper.forward = MethodType(f, wrapper)``, how
    kernels binds) is kept, bound to the copy, by ``copy.copy`` and ``copy.deepcopy`` of the wrapper and by
    ``copy.deepcopy`` and pickle of the model; kernelizing the copy with no kernel mapped leaves the original's.
    With the drop-in names (no kernelize: the wrapper is not bound by kernelpolicy) the copy ran the function
    itself, silently (issue 41, item 7)."""
    model = kit.func_model_class()()
    wrapper = next(iter(model._kernel_funcs.values()))
    wrapper.forward = types.MethodType(HandKernel.forward, wrapper)
    if kit.way == "attach":
        kernelpolicy.attach(model)
    expected = func_net_out(model, x, func_offset=5.0)
    close(wrapper(x), x * 2.0 + 5.0)
    close(model(x), expected)
    if how in ("copy", "deepcopy"):
        copied = (copy.copy if how == "copy" else copy.deepcopy)(wrapper)
        assert copied is not wrapper
        assert copied.__dict__["forward"].__self__ is copied
        close(copied(x), x * 2.0 + 5.0)
        close(wrapper(x), x * 2.0 + 5.0)
        return
    restored = copy.deepcopy(model) if how == "deepcopy model" else pickle.loads(pickle.dumps(model))
    restored_wrapper = next(iter(restored._kernel_funcs.values()))
    assert restored_wrapper is not wrapper
    assert restored_wrapper.__dict__["forward"].__self__ is restored_wrapper
    close(restored(x), func_net_out(restored, x, func_offset=5.0))
    with kernels.use_kernel_mapping({FUNC: {}}, inherit_mapping=False):
        kit.kernelize(restored)
    close(restored(x), func_net_out(restored, x))
    close(model(x), expected)


@ways()
@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_fullgraph_runs_a_traceable_function_kernel(kit: Kit, x: torch.Tensor) -> None:
    """A model whose function kernel declares ``can_torch_compile = True``, kernelized for
    INFERENCE | TORCH_COMPILE, compiles with fullgraph=True and computes with the kernel."""
    model = kit.func_model_class()()
    with use_mapping({LAYER: kit.norm_repo(1.0, can_torch_compile=True), FUNC: kit.func_repo(10.0)}):
        kit.kernelize(model, mode=INFERENCE | COMPILE)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        close(compiled(x), func_net_out(model, x, norm_offset=1.0, func_offset=10.0))
        close(model(x), func_net_out(model, x, norm_offset=1.0, func_offset=10.0))


def test_a_local_repository_records_the_digest_kernels_checks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """write_kernel_repo's metadata holds the digest of its files as kernels computes it, still true with the
    bytecode a load writes (left out of it); kernels from 0.18, which checks it at every load, loads it
    without its warning that the metadata records none (the demo's first screen showed that warning)."""
    from kernelpolicy.testing import VARIANT, DemoModel, kernelize_locally

    repo = write_kernel_repo(tmp_path / "repo", rms_norm_kernel_source(offset=1.0), exports=("RMSNorm",))
    with caplog.at_level("WARNING"):
        model = kernelize_locally(DemoModel(HIDDEN).eval(), {LAYER: repo})
        model(torch.ones(1, HIDDEN))
    assert not [record.message for record in caplog.records if "digest" in record.getMessage()]
    variant = repo / "build" / VARIANT
    (variant / "__pycache__").mkdir(exist_ok=True)  # the bytecode a load writes (where writing it is not off)
    (variant / "__pycache__" / "layers.cpython-311.pyc").write_bytes(b"bytecode")
    digest = kernels.Metadata.read_from_file(variant / "metadata.json").digest
    assert digest is not None and sorted(digest.files) == ["__init__.py", "layers.py"]
    digest.validate(type(digest).hash_variant(digest.algorithm, variant))  # raises on any difference

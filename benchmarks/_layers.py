"""Real parts for the benchmarks: local kernel repositories, marked layers, comparison layers.

Kernel repositories are written with :func:`kernelpolicy.testing.write_kernel_repo`
and loaded by ``kernels`` itself (``LocalLayerRepository`` inside
``use_kernel_mapping``), exactly as the tests and the demo do.
"""

from __future__ import annotations

import contextlib
import logging
import types
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import kernels
import torch
from torch import nn

import kernelpolicy
from kernelpolicy._attach._aware import binding_of
from kernelpolicy.testing import local_mapping, rms_norm_kernel_source, write_kernel_repo

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

__all__ = [
    "SEED_CONFIG",
    "CustomOpNoop",
    "KernelRepos",
    "NoopLayer",
    "dispatch_variant",
    "kernel_function",
    "nested_scopes",
    "noop_modules",
    "own_code",
    "rms_norm_modules",
    "seed_bind",
]


def noop_kernel_source(*, can_torch_compile: bool, has_backward: bool = True) -> str:
    """``layers.py`` of a kernel repository with a ``Noop`` layer whose forward returns its input."""
    return f"""
        from torch import nn


        class Noop(nn.Module):
            can_torch_compile = {can_torch_compile!r}
            has_backward = {has_backward!r}

            def forward(self, x):
                return x
    """


@kernels.use_kernel_forward_from_hub("Noop")
class NoopLayer(nn.Module):
    """A layer marked for the ``Noop`` hub kernel; its own forward also returns its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class CustomOpNoop(nn.Module):
    """vLLM ``CustomOp``-style dispatch: ``forward`` calls ``self._forward_method``, chosen once."""

    def __init__(self, kernel_forward: Callable[..., Any]) -> None:
        super().__init__()
        self._forward_method = types.MethodType(kernel_forward, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._forward_method(x)
        return out


#: The "seed" approach's process-wide switch (a module-level config object).
SEED_CONFIG = SimpleNamespace(disabled=False)


def seed_bind(module: nn.Module, kernel_forward: Callable[..., Any]) -> nn.Module:
    """Bind, as ``kernels`` does (a method on the instance), a forward that checks a global flag per call."""
    original = type(module).forward

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or SEED_CONFIG.disabled:
            out: torch.Tensor = original(self, x)
            return out
        out = kernel_forward(self, x)
        return out

    module.forward = types.MethodType(forward, module)
    return module


class KernelRepos:
    """Local kernel repositories under one root, and kernelize helpers that use them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._repos: dict[str, Path] = {}

    def repo(self, key: str, layers_source: str) -> Path:
        found = self._repos.get(key)
        if found is None:
            found = write_kernel_repo(self.root / key, layers_source, name=f"bench-{key}")
            self._repos[key] = found
        return found

    def noop(self, *, can_torch_compile: bool, has_backward: bool = True) -> Path:
        source = noop_kernel_source(can_torch_compile=can_torch_compile, has_backward=has_backward)
        return self.repo(f"noop-ctc{int(can_torch_compile)}-bwd{int(has_backward)}", source)

    def rms_norm(self, *, can_torch_compile: bool) -> Path:
        source = rms_norm_kernel_source(can_torch_compile=can_torch_compile)
        return self.repo(f"rmsnorm-ctc{int(can_torch_compile)}", source)

    @staticmethod
    @contextlib.contextmanager
    def mapping(layer_name: str, repo: Path) -> Iterator[None]:
        """``kernels.use_kernel_mapping`` for one layer; kernels' warnings about unmapped layers are muted."""
        logger = logging.getLogger("kernels")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            with local_mapping({layer_name: repo}):
                yield
        finally:
            logger.setLevel(level)

    def kernels_kernelize(self, model: nn.Module, layer_name: str, repo: Path, mode: Any = None) -> nn.Module:
        """Plain ``kernels.kernelize`` (direct binding, never made policy-aware)."""
        with self.mapping(layer_name, repo):
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE if mode is None else mode, device="cpu")
        if binding_of(model) is not None:
            raise RuntimeError("baseline model unexpectedly policy-aware")
        return model

    def policy_kernelize(self, model: nn.Module, layer_name: str, repo: Path, mode: str = "inference") -> nn.Module:
        """``kernelpolicy.kernelize`` (``kernels.kernelize`` + ``attach``)."""
        with self.mapping(layer_name, repo):
            kernelpolicy.kernelize(model, mode=mode, device="cpu")
        return model


def kernel_function(module: nn.Module) -> Callable[..., Any]:
    """The kernel layer's forward function bound on ``module`` by ``kernels.kernelize``."""
    bound = module.__dict__.get("forward")
    if not isinstance(bound, types.MethodType) or bound.__func__ is type(module).forward:
        raise RuntimeError(f"{type(module).__name__} has no kernel bound by kernels.kernelize")
    function: Callable[..., Any] = bound.__func__
    return function


def dispatch_variant(module: nn.Module) -> str:
    """Which generated kernelpolicy forward a policy-aware module uses (``always_usable``, ``general``, ...)."""
    binding = binding_of(module)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} is not policy-aware")
    if binding.kernel is None:
        raise RuntimeError(f"{type(module).__name__}: kernelpolicy bound no kernel")
    forward = module.__dict__["forward"]
    return str(forward.__qualname__).split(".")[1]


def own_code(cls: type[nn.Module], name: str) -> type[nn.Module]:
    """A subclass of ``cls`` whose ``forward`` is a copy with its own code object.

    TorchDynamo keeps its compiled-code cache on the code object of the frame
    it compiles; two models sharing ``DemoModel.forward`` would share one
    cache, and each would first evaluate the other's guards.
    """
    forward = cls.forward
    code = forward.__code__.replace()
    if code is forward.__code__:  # pragma: no cover - CPython returns a new object
        raise RuntimeError("could not copy the code object")
    copied = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    copied.__qualname__ = forward.__qualname__
    return type(name, (cls,), {"forward": copied, "__module__": cls.__module__})


@contextlib.contextmanager
def nested_scopes() -> Iterator[None]:
    """Three nested scopes, none naming the measured layer: ``prefer`` > ``A="disable"`` > ``B="require"``."""
    scopes = kernelpolicy.kernel_policy("prefer"), kernelpolicy.kernel_policy(A="disable")
    with scopes[0], scopes[1], kernelpolicy.kernel_policy(B="require"):
        yield


def noop_modules(repos: KernelRepos) -> dict[str, nn.Module]:
    """The no-op layers the ``eager_noop`` variants call, by role (see ``benchmarks/README.md``)."""
    repo_ctc = repos.noop(can_torch_compile=True)
    direct = repos.kernels_kernelize(NoopLayer(), "Noop", repo_ctc)
    kernel_forward = kernel_function(direct)
    return {
        "direct": direct,
        "direct_again": repos.kernels_kernelize(NoopLayer(), "Noop", repo_ctc),
        "policy_ctc": repos.policy_kernelize(NoopLayer(), "Noop", repo_ctc),
        "policy_plain": repos.policy_kernelize(NoopLayer(), "Noop", repos.noop(can_torch_compile=False)),
        "policy_no_backward": repos.policy_kernelize(
            NoopLayer(), "Noop", repos.noop(can_torch_compile=True, has_backward=False)
        ),
        "custom_op": CustomOpNoop(kernel_forward),
        "seed": seed_bind(NoopLayer(), kernel_forward),
        "plain": NoopLayer(),
    }


def rms_norm_modules(repos: KernelRepos, hidden: int) -> dict[str, nn.Module]:
    """``RMSNorm(hidden)`` layers the ``eager_rmsnorm`` variants call, by role, and a never-kernelized original."""
    from kernelpolicy.testing import RMSNorm

    repo_plain = repos.rms_norm(can_torch_compile=False)
    return {
        "direct": repos.kernels_kernelize(RMSNorm(hidden), "RMSNorm", repo_plain),
        "direct_again": repos.kernels_kernelize(RMSNorm(hidden), "RMSNorm", repo_plain),
        "policy_ctc": repos.policy_kernelize(RMSNorm(hidden), "RMSNorm", repos.rms_norm(can_torch_compile=True)),
        "policy_plain": repos.policy_kernelize(RMSNorm(hidden), "RMSNorm", repo_plain),
        "original": RMSNorm(hidden),
    }

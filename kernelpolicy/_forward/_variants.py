"""Kernel variants: a variant bound to a module, and which of a variant entry's candidates runs a call.

This module owns :class:`Kernel` (a variant, ``kernelize(..., variant=name)``, with its declarations),
:func:`kernel_named` (a binding's variant by name, ``default`` its kernel bound without one) and
:func:`choose` (under a policy entry ``kernel:a|b|...``, the first variant that can run a call, else the
original with why each cannot). Running the chosen variant is the binding's slow path
(``_binding.Binding``, which this module reads as :class:`Choosing`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .._values._policy import DEFAULT_VARIANT, variant_names
from .._values._rules import RULES, VARIANT_RULES, KernelRule
from ._dispatch import Path, autograd_records, decide

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from .._context._state import ExecutionState

__all__ = ["Choosing", "Kernel", "choose", "kernel_named", "kernel_of"]


class Kernel(NamedTuple):
    """A kernel variant bound to a module (``kernelize(..., variant=name)``): called as ``function(module, ...)``."""

    function: Callable[..., Any]
    kernel_class: type | None
    repository: str | None
    can_torch_compile: bool
    has_backward: bool


def kernel_of(function: Callable[..., Any], kernel_class: type | None, repository: str | None) -> Kernel:
    """A :class:`Kernel` with the declarations its kernel layer class makes."""
    return Kernel(
        function,
        kernel_class,
        repository,
        getattr(kernel_class, "can_torch_compile", False) is True,
        getattr(kernel_class, "has_backward", True) is not False,
    )


class Choosing(Protocol):
    """What this module reads of a binding (``_binding.Binding``, a layer above, satisfies it)."""

    module: nn.Module
    layer_name: str
    kernel: Callable[..., Any] | None
    kernel_class: type | None
    repository: str | None
    can_torch_compile: bool
    has_backward: bool
    stopped: str | None
    variants: dict[str, Kernel]

    def _asked(self, rule: KernelRule | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None: ...


def kernel_named(binding: Choosing, name: str) -> Kernel | None:
    """The variant ``name`` (``default``: the kernel bound without a name), or None if not bound."""
    if name == DEFAULT_VARIANT:
        if binding.kernel is None:
            return None
        return Kernel(
            binding.kernel, binding.kernel_class, binding.repository, binding.can_torch_compile, binding.has_backward
        )
    return binding.variants.get(name)


def choose(
    binding: Choosing,
    entry: str,
    state: ExecutionState,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> tuple[Path, str, Callable[..., Any] | None, str | None]:
    """Under a variant entry: the first variant that can run this call (path, reason, its function, its name).

    Else the original: (``"original"``, why each variant cannot, None, None).
    """
    refusals = []
    for name in variant_names(entry):
        kernel = kernel_named(binding, name)
        if kernel is None:
            refusals.append(f"{name!r} not bound")
            continue
        path, reason = decide(
            "prefer",
            has_kernel=True,
            can_torch_compile=kernel.can_torch_compile,
            has_backward=kernel.has_backward,
            state=state,
            needs_backward=not kernel.has_backward and autograd_records(binding.module, args, kwargs),
        )
        if path == "kernel" and name == DEFAULT_VARIANT and binding.stopped is not None:
            path, reason = "original", binding.stopped  # the failures counted are the default kernel's
        elif path == "kernel" and (args or kwargs):
            layer_rule, own_rule = RULES.get(binding.layer_name), VARIANT_RULES.get((binding.layer_name, name))
            refused = binding._asked(layer_rule, args, kwargs or {}) or binding._asked(own_rule, args, kwargs or {})
            if refused is not None:
                path, reason = "original", refused
        if path == "kernel":
            where = f" ({kernel.repository})" if kernel.repository else ""
            return "kernel", f"variant {name!r}{where}", kernel.function, name
        refusals.append(f"{name!r}: {reason}")
    return "original", f"no variant can run ({'; '.join(refusals)})", None, None

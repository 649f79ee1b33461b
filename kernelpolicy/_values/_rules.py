"""What a kernel accepts, per call: the rules declared with ``kernel_accepts`` (see ``_binding``).

This module owns :class:`KernelRule` (dtypes, device types and a predicate on the call) and
:data:`RULES`, the rule of each kernel layer name. ``_dispatch`` asks a rule whether a call is
eligible before it runs the kernel (:meth:`KernelRule.reject`); ``explain`` shows what a rule
accepts (:meth:`KernelRule.describe`).

A rule reads what a call's tensors are, never what they hold: dtypes, device types, shapes, strides.
TorchDynamo then evaluates it at trace time and guards on what it read, so a compiled call of each
outcome is its own program, without a graph break. A predicate that reads tensor values would break the
graph (or, under export, bake in the example's outcome).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import torch

from ._tensors import tensors_in

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

__all__ = ["RULES", "VARIANT_RULES", "KernelRule"]


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """The calls the kernels of one kernel layer name accept.

    ``dtypes``: the dtypes its floating-point tensor arguments may have; ``devices``: the device types
    (``"cuda"``, ``"cpu"``, ...) of its tensor arguments; ``check(module, *args, **kwargs)``: True (or None)
    to accept, False or a string saying why not to refuse. None: no constraint of that kind.
    """

    layer_name: str
    dtypes: frozenset[torch.dtype] | None = None
    devices: frozenset[str] | None = None
    check: Callable[..., bool | str | None] | None = None

    def reject(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...] = ()
    ) -> str | None:
        """Why this call is not for the kernel, naming the argument and the rule; None if it is.

        ``names`` are the forward's parameter names (after ``self``), to name positional arguments.
        """
        if self.dtypes is not None or self.devices is not None:
            for index, value in enumerate(args):
                why = self._tensors(value)
                if why is not None:
                    return f"argument {_positional(index, names)} {why}"
            for key, value in kwargs.items():
                why = self._tensors(value)
                if why is not None:
                    return f"argument {key!r} {why}"
        if self.check is not None:
            verdict = self.check(module, *args, **kwargs)
            if verdict is False:
                return f"{_name(self.check)} refused the call"
            if isinstance(verdict, str):
                return f"{_name(self.check)}: {verdict}"
        return None

    def _tensors(self, value: Any) -> str | None:
        """Why the tensors of one argument (at any depth of tuples, lists and dicts) break the rule, or None."""
        for tensor in (value,) if isinstance(value, torch.Tensor) else tensors_in(value):
            if self.devices is not None and tensor.device.type not in self.devices:
                return f"is on {tensor.device.type}; the kernel accepts {_listed(self.devices)}"
            if self.dtypes is not None and tensor.dtype not in self.dtypes and tensor.is_floating_point():
                return f"has dtype {tensor.dtype}; the kernel accepts {_listed(self.dtypes)}"
        return None

    def describe(self) -> str:
        """The rule in words, for ``explain``."""
        parts = []
        if self.dtypes is not None:
            parts.append(f"dtypes {_listed(self.dtypes)}")
        if self.devices is not None:
            parts.append(f"devices {_listed(self.devices)}")
        if self.check is not None:
            parts.append(f"calls {_name(self.check)} accepts")
        return "; ".join(parts)


#: Kernel layer name -> its rule, for every kernel of the layer. Written by ``kernel_accepts`` (``_binding``),
#: read by ``_dispatch``.
RULES: dict[str, KernelRule] = {}
#: (kernel layer name, variant name) -> the rule of that kernel variant alone (on top of the layer's).
VARIANT_RULES: dict[tuple[str, str], KernelRule] = {}


def _positional(index: int, names: tuple[str, ...]) -> str:
    return f"{index} ({names[index]})" if index < len(names) else str(index)


def _listed(values: frozenset[Any]) -> str:
    return ", ".join(sorted(map(str, values)))


def _name(check: Callable[..., Any]) -> str:
    name = getattr(check, "__qualname__", None) or repr(check)
    return "its check" if name == "<lambda>" else f"check {name}"


def parameter_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The parameter names of ``forward`` after ``self``, for naming positional arguments."""
    try:
        return tuple(inspect.signature(forward).parameters)[1:]
    except (TypeError, ValueError):
        return ()

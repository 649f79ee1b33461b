"""The path of a module in the model being called: how an error raised in a forward names its module.

A policy-aware module keeps the name it was first attached under (``Binding.module_name``). Two models
attached separately, then composed in one parent, both have a ``blocks.0.norm``: where the composite is
called, that name does not say which one failed. So an error raised in a call (``KernelUnavailableError``,
``KernelMismatchError``) names the module by its path in the model called: the outermost module whose
method is running on this thread's stack (``self`` of a frame) and that has the module among its
``named_modules``; torch.compile's wrapper of a model is looked through (its path prefix is torch's). Found
when the error is made, never on a call that does not raise. The attached name stays where no module on the
stack holds it, or where it is itself the model called (a layer called alone).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._compat import COMPILED_MODULE, first_present, lookup

if TYPE_CHECKING:
    import types
    from collections.abc import Callable

__all__ = ["called_name"]


def called_name(module: nn.Module, attached: str | None) -> str | None:
    """``module``'s path in the model being called (see the module docstring), else ``attached``.

    Where TorchDynamo is loaded, the frames are walked with it off (``torch.compiler.disable``): an error
    made at run time after a graph break would otherwise have this frame compiled, and Dynamo cannot trace
    the walk.
    """
    if "torch._dynamo" not in sys.modules:
        return _walk(module, attached)
    if not _DISABLED:
        compiler: Any = torch.compiler  # disable: untyped in some torch releases (mypy strict on each)
        _DISABLED.append(compiler.disable(_walk))
    return _DISABLED[0](module, attached)


#: ``_walk`` under ``torch.compiler.disable``, made on first use (it imports TorchDynamo, over a second).
_DISABLED: list[Callable[[nn.Module, str | None], str | None]] = []


def _walk(module: nn.Module, attached: str | None) -> str | None:
    for root in _calling_modules(sys._getframe(1)):
        for name, found in root.named_modules():
            if found is module:
                return name or attached
    return attached


def _calling_modules(frame: types.FrameType | None) -> list[nn.Module]:
    """The modules whose methods run on the stack from ``frame`` out, outermost first, each once, unwrapped."""
    wrapper = _compiled_wrapper()
    modules: list[nn.Module] = []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            self = frame.f_locals.get("self")
            wrapped = wrapper is not None and isinstance(self, wrapper)
            if isinstance(self, nn.Module) and not wrapped and all(self is not seen for seen in modules):
                modules.append(self)
        frame = frame.f_back
    return modules[::-1]


def _compiled_wrapper() -> type | None:
    """torch.compile's module wrapper class, if TorchDynamo is loaded (no wrapper exists before it is)."""
    if "torch._dynamo" not in sys.modules:
        return None
    name = first_present(COMPILED_MODULE)
    found = None if name is None else lookup(name)
    return found if isinstance(found, type) else None

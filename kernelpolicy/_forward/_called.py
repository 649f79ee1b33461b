"""The path of a module in the model being called: how an error raised in a forward names its module.

A policy-aware module keeps the name it was first attached under (``Binding.module_name``). Two models
attached separately, then composed in one parent, both have a ``blocks.0.norm``: where the composite is
called, that name does not say which one failed. So an error raised in a call (``KernelUnavailableError``,
``KernelMismatchError``) names the module by its path in the model called: the outermost module whose
method is running on this thread's stack (``self`` of a frame) and that has the module among its
``named_modules``; torch's wrappers of a model (torch.compile, non-strict export) are looked through. Found
when the error is made, never on a call that does not raise. The attached name stays where no module on the
stack holds it, or where it is itself the model called (a layer called alone).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._compat._compat import DYNAMO_CONFIG

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
    if DYNAMO_CONFIG.names[0] not in sys.modules:  # TorchDynamo not loaded (its config is, whenever it is)
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
    """The modules whose methods run on the stack from ``frame`` out, outermost first, each once.

    A wrapper is left out: a module whose one child, registered under a private name, runs on the stack too
    (torch.compile's ``_orig_mod``, non-strict ``torch.export``'s ``_export_root``): its path prefix is torch's.
    """
    modules: list[nn.Module] = []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            self = frame.f_locals.get("self")
            if isinstance(self, nn.Module) and all(self is not seen for seen in modules):
                modules.append(self)
        frame = frame.f_back
    return [module for module in modules[::-1] if not _wraps(module, modules)]


def _wraps(module: nn.Module, running: list[nn.Module]) -> bool:
    children = list(module.named_children())
    return len(children) == 1 and children[0][0].startswith("_") and any(children[0][1] is m for m in running)

"""Watching ``kernels`` bind: the one wrapper around the function every kernelize path binds a forward with.

Every kernels release kernelpolicy supports binds a layer (and a kernel function's module) through one
function, ``_replace_forward(module, layer, ...)`` (``_compat.KERNELS_BIND`` has where it lives in each
release), looked up in its module when it is called: by ``kernels.kernelize`` however it was imported, by
transformers' ``from_pretrained`` and its re-kernelize on ``train()``/``eval()``. A binding by assignment
(``module.forward = ...``) already reaches a policy-aware module's ``__setattr__``; but kernels >= 0.19 falls
back by popping the forward out of ``module.__dict__``, which no hook of the module sees, and the modules
kernels binds outside kernelpolicy are seen nowhere else.

This module owns the wrapper: :func:`watch` installs it once, and after each binding it calls every function
in :data:`ON_BIND` as ``callback(module)``. ``_binding`` registers the resync of policy-aware modules;
the ``_autoattach`` feature registers its own. Where the installed kernels has no such function, the user
is told once (``_compat.resolve``) and each caller falls back as ``KERNELS_BIND.fallback`` says.

Cost: nothing on the forward path; one Python call per binding.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from .._compat import _compat

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from torch import nn

__all__ = ["ON_BIND", "binding_a_kernel", "kernels_binding", "watch", "watching"]

#: ``callback(module)``, called after kernels binds ``module`` (a kernel or its fallback).
ON_BIND: list[Callable[[nn.Module], None]] = []

_MARK = "_kernelpolicy_hook"
# True while kernels' binding function runs (in this thread and task): what it assigns is a kernel.
_BINDING: ContextVar[bool] = ContextVar("kernelpolicy.kernels_binding", default=False)
_LOCK = threading.Lock()
_WATCHING: bool | None = None  # None: not tried yet (kernels not imported)


def watch() -> bool:
    """Wrap kernels' binding function (once, if kernels is imported); whether it is wrapped.

    Called at every binding kernelpolicy makes and before every look at kernels' modules: after the first
    answer it costs one global read. Where kernels has no binding function, the user is told once.
    """
    global _WATCHING
    if _WATCHING is not None:
        return _WATCHING
    if "kernels" not in sys.modules:
        return False  # kernels has bound nothing yet: asked again at the next binding
    with _LOCK:
        if _WATCHING is None:
            _WATCHING = _install()
    return _WATCHING


def kernels_binding() -> bool:
    """Whether kernels' binding function is running here: a ``module.forward = ...`` now is kernels' binding."""
    return _BINDING.get()


@contextlib.contextmanager
def binding_a_kernel() -> Iterator[None]:
    """kernelpolicy binds a kernel itself (a hub attention kernel): what it assigns counts as kernels' binding."""
    token = _BINDING.set(True)
    try:
        yield
    finally:
        _BINDING.reset(token)


def watching() -> bool:
    """Whether kernels' binding function is wrapped (without trying to wrap it)."""
    return _WATCHING is True


def _install() -> bool:
    found = _compat.first_present(_compat.KERNELS_BIND)
    if found is None:
        _compat.resolve(_compat.KERNELS_BIND)  # tells the user once
        return False
    module_name, _, attribute = found.rpartition(".")
    owner = sys.modules.get(module_name) or _compat.lookup(module_name)
    bind = getattr(owner, attribute)
    if not getattr(bind, _MARK, False):
        setattr(owner, attribute, _hooked(bind))
    return True


def _hooked(bind: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(bind)
    def _replace_forward(module: nn.Module, layer: type, *args: Any, **kwargs: Any) -> None:
        token = _BINDING.set(True)
        try:
            bind(module, layer, *args, **kwargs)
        finally:
            _BINDING.reset(token)
        for callback in ON_BIND:
            callback(module)

    setattr(_replace_forward, _MARK, True)
    return _replace_forward

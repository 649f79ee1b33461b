"""Modules ``kernels`` binds outside kernelpolicy: :func:`auto_attach`, and a warning when a policy misses them.

kernelpolicy governs a module once it is policy-aware (``attach``, ``kernelize``, the marking decorators).
A model kernelized by ``kernels.kernelize`` alone, or by transformers' ``use_kernels=True``, is not: every
policy passes it by. ``_watch`` sees every binding kernels makes (the watch on its binding function) and
calls this module's callback; this module owns:

- :func:`auto_attach`: from then on, the callback makes every module kernels binds policy-aware as it is
  bound. It reads the model ``kernels.kernelize`` works on off that call's frame and attaches it as
  :func:`kernelpolicy.attach` does, so modules get their names in the model and the model gets attach's
  features (hub attention, activation checkpointing); modules kernels bound before become policy-aware
  too (without names).
- otherwise, a weak registry of the modules kernels bound that are not policy-aware, and one warning per
  process when a policy that asks something of them (a mode other than ``prefer`` for a layer that runs
  a kernel, ``require`` for one that does not) is entered (a scope, ``set_default_policy``) or is in
  effect while kernels binds one. It names the modules' classes and layers and the fix.

The watch is installed by ``auto_attach``, by the first such policy entered once ``kernels`` is imported,
and by kernelpolicy's first binding. Modules kernels bound a kernel to before that are found then, once, by a
walk over the garbage collector's objects (only if kernels has loaded a kernel layer by then). Where the
installed kernels cannot be watched (``_compat.KERNELS_BIND`` missing), the user is told once, and the walk
is what there is: ``auto_attach`` attaches what it finds when called, and the warning is given for what the
walk finds when the first policy that asks something is entered.

Cost: nothing on the forward path; the hook runs when kernels binds. A scope entry runs :func:`_check`
(in ``_active.POLICY_CHECKS``) only while it is listed: from import until the first policy that asks
something meets an imported kernels and no unattached module, and again from when the hook records one
until the warning is given. Importing this module imports neither torch nor kernels.
"""

from __future__ import annotations

import collections
import functools
import gc
import inspect
import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING

from .._compat import _kernel_objects, _versions
from .._context._active import POLICY_CHECKS, current_policy
from .._forward import _watch
from .._values._errors import warn_at_caller

if TYPE_CHECKING:
    from torch import nn

    from .._values._policy import Policy

__all__ = ["auto_attach"]

_LOCK = threading.RLock()
_AUTO = False  # auto_attach() in effect
_WARNED = False  # the warning was given (once per process)
_LOOKED = False  # the modules kernels bound before the watch (or without one) were looked for
_UNATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # bound by kernels, not policy-aware when found


def auto_attach(enabled: bool = True) -> bool:
    """Make every module ``kernels`` binds policy-aware from now on, as ``attach`` does; return the previous setting.

    The one line for models kernelized outside kernelpolicy: ``kernels.kernelize``, transformers'
    ``from_pretrained(..., use_kernels=True)`` and its re-kernelize on ``train()`` and ``eval()``. Each
    model kernels works on is attached as :func:`kernelpolicy.attach` attaches it (names, hub attention,
    activation checkpointing); modules kernels bound before this call become policy-aware too, without
    names. It holds for the whole process, every thread; it is not a policy, so a worker process that
    builds its own model calls it there too. ``auto_attach(False)`` stops it; modules already
    policy-aware stay so. If the installed kernels binds layers in a way kernelpolicy cannot watch
    (``python -m kernelpolicy doctor`` says so), it says so once and makes policy-aware the modules kernels
    bound up to this call only: attach later models with :func:`kernelpolicy.attach`.

    >>> import torch, kernels, kernelpolicy
    >>> previous = kernelpolicy.auto_attach()
    >>> @kernels.use_kernel_forward_from_hub("Quadruple")
    ... class Quadruple(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 4 * x
    >>> model = kernels.kernelize(torch.nn.Sequential(Quadruple()), mode=kernels.Mode.INFERENCE, device="cpu")
    >>> with kernelpolicy.kernel_policy("require"):
    ...     model(torch.ones(1))
    Traceback (most recent call last):
    ...
    kernelpolicy.KernelUnavailableError: kernel required but unavailable for module '0' (...Quadruple, kernel layer 'Quadruple'): no kernel bound
    >>> kernelpolicy.auto_attach(previous)
    True
    """
    global _AUTO
    if not isinstance(enabled, bool):
        raise TypeError(f"auto_attach(enabled) takes True or False, got {enabled!r}")
    _versions.kernels()
    with _LOCK:
        previous, _AUTO = _AUTO, enabled
        if enabled:
            _look()
            for module in [*_still_unattached(), *_bound_before()]:
                _make_aware(module, None)
            _UNATTACHED.clear()
    return previous


# --- what kernels binds, seen through _watch --------------------------------------------------------


def _look() -> bool:
    """Watch kernels bind (once) and record what it bound before; whether it is watched."""
    global _LOOKED
    with _LOCK:
        watched = _watch.watch()
        if not _LOOKED:
            _LOOKED = True
            for module in _bound_before():
                _found(module, None)
        return watched


def _on_bind(module: nn.Module) -> None:
    """After kernels bound ``module`` (``_watch.ON_BIND``)."""
    from ._aware import KERNELIZING, binding_of

    # A policy-aware module took the binding through its own __setattr__; kernelpolicy.kernelize
    # attaches the model itself once kernels is done.
    if binding_of(module) is None and not KERNELIZING.get():
        _found(module, _kernelized_model() if _AUTO else None)


def _found(module: nn.Module, model: nn.Module | None) -> None:
    """A module kernels bound that is not policy-aware: attach it (``auto_attach``) or record it."""
    from ._attach import attach
    from ._aware import binding_of

    if _AUTO:
        if model is not None:
            attach(model)
        if binding_of(module) is None:  # not under that model, or the model was not found
            _make_aware(module, None)
        return
    with _LOCK:
        _UNATTACHED.add(module)
        _arm()
    policy = current_policy()  # a process default (KERNELPOLICY, set_default_policy) or the binding's scope
    if _missed(policy, module):
        _warn_once(policy)


def _kernelized_model() -> nn.Module | None:
    """The ``model`` argument of the ``kernels.kernelize`` call running in this thread, if any."""
    code = _kernelize_code()
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            from torch import nn

            model = frame.f_locals.get("model")
            return model if isinstance(model, nn.Module) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


@functools.cache
def _kernelize_code() -> types.CodeType | None:
    """The code of kernels' public ``kernelize`` (whose frame holds ``model``), or None if it has no ``model``."""
    kernelize = inspect.unwrap(_versions.kernels().kernelize)
    code = getattr(kernelize, "__code__", None)
    return code if isinstance(code, types.CodeType) and "model" in code.co_varnames else None


def _bound_before() -> list[nn.Module]:
    """Modules that run a kernel kernels loaded and are not policy-aware (one walk over gc's objects)."""
    if not _kernel_objects.kernels_loaded_a_layer():
        return []  # kernels has loaded no kernel layer: it has bound none
    from torch import nn

    # type(), not isinstance(): isinstance falls back to obj.__class__, which some objects answer with a
    # warning (torch.distributed.reduce_op's deprecation)
    return [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), nn.Module) and hasattr(type(obj), "kernel_layer_name") and _runs_unattached_kernel(obj)
    ]


def _make_aware(module: nn.Module, module_name: str | None) -> None:
    from ._aware import _make_aware as make_aware

    make_aware(module, module_name)


# --- the warning ---------------------------------------------------------------------------------


def _arm() -> None:
    if not _WARNED and _check not in POLICY_CHECKS:
        POLICY_CHECKS.append(_check)


def _disarm() -> None:
    with _LOCK:
        if _check in POLICY_CHECKS:
            POLICY_CHECKS.remove(_check)


def _check(policy: Policy) -> None:
    """Before ``policy`` takes effect: warn once if it asks something of modules kernels bound unattached."""
    if "kernels" not in sys.modules:
        return  # kernels is not imported: it has bound nothing
    if policy.default == "prefer" and not policy.layers:
        return  # asks nothing a module outside kernelpolicy does not already do
    _look()
    modules = _still_unattached()
    if not modules:
        # Watched, the watch arms the check again when kernels binds an unattached module; unwatched, the
        # one walk (in _look) was all there is, and the user was told so.
        _disarm()
    elif any(_missed(policy, module) for module in modules):
        _warn_once(policy)


def _still_unattached() -> list[nn.Module]:
    """The recorded modules that are not policy-aware yet (those attached since are dropped)."""
    from ._aware import binding_of

    with _LOCK:
        found = list(_UNATTACHED)
        for module in found:
            if binding_of(module) is not None:
                _UNATTACHED.discard(module)
        return [module for module in found if binding_of(module) is None]


def _runs_kernel(module: nn.Module) -> bool:
    """Whether kernels bound ``module`` a kernel (its instance forward is not its class's)."""
    from ._aware import bound_forward

    return bound_forward(module) is not None


def _runs_unattached_kernel(module: nn.Module) -> bool:
    from ._aware import binding_of

    return binding_of(module) is None and _runs_kernel(module)


def _missed(policy: Policy, module: nn.Module) -> bool:
    """Whether ``policy`` would make ``module`` take another path than it takes outside kernelpolicy."""
    mode = policy.entry_for(str(getattr(type(module), "kernel_layer_name", "")))  # a variant entry asks too
    return mode != "prefer" if _runs_kernel(module) else mode == "require"


def _warn_once(policy: Policy) -> None:
    global _WARNED
    with _LOCK:
        if _WARNED:
            return
        _WARNED = True
        _disarm()
        modules = [module for module in _still_unattached() if _missed(policy, module)]
    kinds = collections.Counter(
        (type(module).__name__, str(getattr(type(module), "kernel_layer_name", "")), _runs_kernel(module))
        for module in modules
    )
    listed = ", ".join(
        f"{count} {cls} (kernel layer {name!r}, {'runs its kernel' if kernel else 'no kernel'})"
        for (cls, name, kernel), count in sorted(kinds.items(), key=lambda item: (not item[0][2], item[0][:2]))
    )
    warn_at_caller(
        f"the kernel policy {str(policy)!r} does not reach {len(modules)} module{'s' * (len(modules) != 1)} "
        f"that kernels bound outside kernelpolicy: {listed}. They take the path kernels bound whatever the "
        "policy says. Make them policy-aware: kernelpolicy.attach(model) once the model is kernelized, or "
        "kernelpolicy.auto_attach() once, before models are kernelized (kernels.kernelize, transformers' "
        "use_kernels=True). This warning is given once per process.",
        also_skip=("kernels", "transformers", "torch"),  # when kernels binds: the line that kernelized
    )


POLICY_CHECKS.append(_check)
_watch.ON_BIND.append(_on_bind)

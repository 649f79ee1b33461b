"""Keeping modules policy-aware through copies and pickles.

This module owns the copy and pickle members of an aware class (:func:`copy_members`, which it adds to
``_aware.CLASS_MEMBERS`` when imported: ``kernelpolicy._attach`` imports it), and what unpickling calls:
:func:`_restore` (a module pickled as its original class, its kernel dropped, as ``kernels`` itself
does; re-kernelize after loading) and :func:`_restore_reduced` (one pickled by its class's own
``__reduce__``, kernels >= 0.19's function wrappers). A copy keeps its kernel, variants and another
library's forward wrapper. Pickles made before issue 42 name ``kernelpolicy._aware._restore``: that old name
means this module (``kernelpolicy._MOVED_MODULES``).
"""

from __future__ import annotations

import copy
import copyreg
import types
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from .._forward._binding import redirect
from ._aware import (
    _BY_HAND,
    _OURS,
    CLASS_MEMBERS,
    CLASS_TYPES,
    _aware_class,
    _make_aware,
    _stored_binding,
    binding_of,
    bound_by_hand,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["copy_members"]


def copy_members(cls: type[nn.Module]) -> dict[str, Any]:
    """``__reduce_ex__``, ``__copy__`` and ``__deepcopy__`` of an aware class (its own, if it has them)."""

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        if _foreign(self):  # a subclass another library made (torch's parametrizations): pickled as it says
            return object.__reduce_ex__(self, protocol)
        getstate = getattr(_original_class(self), "__getstate__", None)
        if getstate is not None and getstate is not nn.Module.__getstate__:
            getstate(self)  # a class that refuses pickling (parametrized modules) refuses it here too
        binding = binding_of(self)
        dropped = binding.kernel_name() if binding is not None else None
        return (_restore, (_original_class(self), _own_state(self), None, _module_name(self), dropped))

    def __copy__(self: nn.Module) -> nn.Module:
        return _copied(self, _own_state(self))  # shallow, as copy.copy: parameters and buffers are shared

    def __deepcopy__(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
        return _copied(self, _own_state(self), memo)

    members: dict[str, Any] = {"__reduce_ex__": __reduce_ex__, "__copy__": __copy__, "__deepcopy__": __deepcopy__}
    members.update(_own_copy_members(cls))
    return members


CLASS_MEMBERS.append(copy_members)


def _reduce_class(cls: type) -> Any:
    """How pickle saves a class whose metaclass is an aware class's (``copyreg``, see ``_aware.AwareType``).

    An aware class: as :func:`_restore_class` of its original class, which pickles by name (so it pickles
    wherever the original does: torch's graph pickler, ``torch.save``; ``copy`` keeps classes as they are).
    A subclass another library made of one (torch's parametrizations): by name, as pickle saves any class.
    """
    original = cls.__dict__.get("_kernelpolicy_original")
    if original is None:
        return cls.__qualname__
    return (_restore_class, (original,))


def _restore_class(original: type[nn.Module]) -> type[nn.Module]:
    """Unpickling an aware class: the aware class of ``original`` in this process (made if need be)."""
    return _aware_class(original)


CLASS_TYPES.append(lambda metaclass: copyreg.pickle(metaclass, _reduce_class))


def _own_copy_members(cls: type[nn.Module]) -> dict[str, Any]:
    """Copy and pickle support for a class that has its own (kernels >= 0.19's function wrappers).

    Such a class copies and pickles itself with its kernel (a wrapper is rebuilt by name and gets its
    kernel's forward back). Its own ``__copy__`` and ``__reduce__`` run here on a plain view of the module, as
    kernels left it (:func:`_as_kernels_bound`), and the result is made policy-aware again.

    An instance kernelpolicy has not bound (a per-model wrapper kernels builds, ``type(function)()``, of a
    function marked with kernelpolicy's ``use_kernel_forward_from_hub``, not attached yet) is a plain module
    to kernelpolicy: its class's own code copies and pickles it as it is, with a forward bound on it by hand
    (``wrapper.forward = MethodType(f, wrapper)``), and the copy is not bound either.
    """
    members: dict[str, Any] = {}
    parent_copy = _defined_below_module(cls, "__copy__")
    parent_deepcopy = _defined_below_module(cls, "__deepcopy__")
    parent_reduce = _defined_below_module(cls, "__reduce__")
    parent_setstate: Callable[..., Any] = cls.__setstate__

    if parent_copy is not None:

        def __copy__(self: nn.Module) -> nn.Module:
            if binding_of(self) is None:
                return cast("nn.Module", parent_copy(self))
            new: nn.Module = parent_copy(_as_kernels_bound(self))
            _make_copy_aware(new, self)
            return new

        members["__copy__"] = __copy__
    if parent_deepcopy is not None:

        def __deepcopy__(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
            if binding_of(self) is None:
                return cast("nn.Module", parent_deepcopy(self, memo))
            return _copied(self, _own_state(self), memo)

        members["__deepcopy__"] = __deepcopy__
    if parent_reduce is not None:

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            by_name = parent_reduce(self)
            if isinstance(by_name, str) or binding_of(self) is None:
                return by_name  # the function's global module, pickled by its name; or a module not bound
            rebuild, arguments, *state = parent_reduce(_as_kernels_bound(self))
            return (_restore_reduced, (rebuild, arguments, _module_name(self)), *state)

        def __setstate__(self: nn.Module, state: Any) -> None:
            pending = self.__dict__.pop(_PENDING, None)
            parent_setstate(self, state)
            if pending is not None:
                _make_aware(self, pending[0])

        members["__reduce_ex__"] = __reduce_ex__
        members["__setstate__"] = __setstate__
    return members


def _defined_below_module(cls: type, name: str) -> Callable[..., Any] | None:
    """``cls``'s own ``name`` (itself or a base below ``nn.Module``), or None if it only has nn.Module's or object's."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            return None
        if name in vars(klass) and not getattr(klass, "_kernelpolicy_aware", False):
            return cast("Callable[..., Any]", vars(klass)[name])
    return None


_PENDING = "_kernelpolicy_pending"


def _as_kernels_bound(module: nn.Module) -> nn.Module:
    """A plain instance of ``module``'s original class with its own state and its kernel bound as kernels binds it."""
    cls = _original_class(module)
    view = cls.__new__(cls)
    view.__dict__.update(_own_state(module))
    binding = binding_of(module)
    if binding is not None and binding.kernel is not None:
        view.__dict__["forward"] = types.MethodType(binding.kernel, view)
    return view


def _make_copy_aware(new: nn.Module, source: nn.Module) -> None:
    """Make ``new``, a copy of ``source`` made by its class's own code, policy-aware with ``source``'s variants."""
    if not getattr(type(new), "_kernelpolicy_aware", False):
        new.__class__ = _aware_class(type(new))
    _make_aware(new, _module_name(source))
    _copy_variants(source, new)


def _restore_reduced(
    rebuild: Callable[..., nn.Module], arguments: tuple[Any, ...], module_name: str | None
) -> nn.Module:
    """Unpickling a module pickled by its class's own ``__reduce__``: rebuild it, policy-aware once its state is set."""
    module = rebuild(*arguments)
    if not getattr(type(module), "_kernelpolicy_aware", False):
        module.__class__ = _aware_class(type(module))
    module.__dict__[_PENDING] = (module_name,)
    return module


def _copied(module: nn.Module, state: dict[str, Any], memo: dict[int, Any] | None = None) -> nn.Module:
    """A copy of ``module`` with ``state`` (deep-copied with ``memo`` if given), its kernel, variants and wrapper.

    Of the module's class, or of the subclass another library made of the policy-aware one (torch's
    parametrizations: the copy keeps them). Another library's forward wrapper is copied as the rest of the
    state is (deep-copied, it refers to the copy), and what in the copy referred to the module's dispatch
    (accelerate's ``_old_forward``) refers to the copy's.
    """
    binding = binding_of(module)
    cls = type(module) if _foreign(module) else _original_class(module)
    new = cls.__new__(cls)
    wrapper = binding.wrapper if binding is not None else None
    if memo is not None:
        memo[id(module)] = new
        state = copy.deepcopy(state, memo)
        wrapper = copy.deepcopy(wrapper, memo)
    new.__dict__.update(state)
    _rebind(new, binding.kernel if binding is not None else None, _module_name(module))
    if bound_by_hand(module) and binding is not None and binding.kernel is not None:
        _BY_HAND[new] = binding.kernel  # the copy's binding has the same kernel function
    _copy_variants(module, new)
    copied = _stored_binding(new)
    if copied is not None and binding is not None and binding.dispatcher is not None:
        redirect(new.__dict__, binding.dispatcher, copied.dispatcher)
        if wrapper is not None:
            copied.wrapper = wrapper
            new.__dict__["forward"] = wrapper
    return new


def _foreign(module: nn.Module) -> bool:
    """Whether ``module``'s class is a subclass another library made of a policy-aware class (parametrizations)."""
    cls = type(module)
    return "_kernelpolicy_original" not in cls.__dict__ and "_kernelpolicy_original" in dir(cls)


def _copy_variants(source: nn.Module, new: nn.Module) -> None:
    binding, copied = binding_of(source), binding_of(new)
    if binding is not None and binding.variants and copied is not None:
        copied.variants = dict(binding.variants)
        copied.install()


def _original_class(module: nn.Module) -> type[nn.Module]:
    return cast("type[nn.Module]", getattr(type(module), "_kernelpolicy_original", type(module)))


def _own_state(module: nn.Module) -> dict[str, Any]:
    return {key: value for key, value in module.__dict__.items() if key not in _OURS}


def _module_name(module: nn.Module) -> str | None:
    binding = binding_of(module)
    return binding.module_name if binding is not None else None


def _rebind(module: nn.Module, kernel: Callable[..., Any] | None, module_name: str | None) -> None:
    """Make a copied or unpickled ``module`` policy-aware again, with ``kernel`` bound as kernels binds it."""
    if kernel is not None:
        module.__dict__["forward"] = types.MethodType(kernel, module)
    _make_aware(module, module_name)


def _restore(
    cls: type[nn.Module],
    state: dict[str, Any],
    kernel: Callable[..., Any] | None,
    module_name: str | None,
    dropped: str | None = None,
) -> nn.Module:
    module = cls.__new__(cls)
    module.__setstate__(state)  # type: ignore[no-untyped-call]
    _rebind(module, kernel, module_name)
    binding = binding_of(module)
    if binding is not None and binding.kernel is None:
        binding.dropped = dropped
    return module

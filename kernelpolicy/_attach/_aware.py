"""Making modules and classes policy-aware, and keeping them so through kernels (copies and pickles: ``_copies``).

This module owns :func:`binding_of` (a module's :class:`~kernelpolicy._forward._binding.Binding`) and how a module
becomes policy-aware (``_make_aware``, ``_bind``), called by ``attach`` and ``kernelize`` (``_attach``) and
by classes marked with ``use_kernel_forward_from_hub``. How it stays so through copies and pickles is ``_copies``'.


How a module becomes policy-aware. ``kernels.kernelize`` binds a kernel with
``module.forward = MethodType(kernel_layer.forward, module)`` and rebinds on
every call (transformers calls it again on ``model.train()`` / ``.eval()``).
kernelpolicy gives the *instance* (never its class, never other instances) a
cached subclass of its class, the way ``torch.nn.utils.parametrize`` does,
with the same name and module. That subclass:

- intercepts ``module.forward = ...`` in ``__setattr__``: the assigned forward
  becomes the bound kernel (or "no kernel" when it is the class's own
  forward) and the instance keeps the policy-aware dispatcher, so a later
  ``kernels.kernelize`` updates the kernel and never removes kernelpolicy;
- overrides ``_slow_forward``, which ``nn.Module`` calls instead of
  ``forward`` while ``torch.jit.trace`` runs, so jit tracing is detected at
  no cost in eager mode;
- overrides ``__call__`` with :func:`_aware_call`, ``nn.Module.__call__`` and
  ``_call_impl`` folded into one frame (see there), unless the class defines
  its own ``__call__``, ``_wrapped_call_impl`` or ``_call_impl``, or torch's
  call path reads other names than the one it was checked against
  (:data:`FAST_CALL`);
- deep-copies with its kernel and pickles as the original class (the kernel,
  which lives in a dynamically loaded module, is dropped, as ``kernels``
  itself does; re-kernelize after loading): ``_copies``' members;
- has a metaclass of its own (:class:`AwareType`, a subclass of the original's
  metaclass that adds nothing), so that the class itself pickles: pickle asks
  ``copyreg`` by the metaclass, and ``_copies`` registers there the original by
  name, made aware again where it is loaded.

The dispatcher itself is an instance attribute (``module.__dict__["forward"]``,
a plain closure built by ``_dispatch.make_forward``), so ``module(x)`` pays no
descriptor call.

Features plug in here through hook lists they append to when imported (the
package imports them before its first binding): this module imports none of
them. (``_attach.ATTACH_HOOKS`` is one more.)

- :data:`CLASS_MEMBERS`: called for each class made aware, as ``members(cls)``;
  the members returned join the class's (copies and pickles: ``_copies``, which
  ``kernelpolicy._attach`` imports, so before any class is made aware).

- :data:`NO_ORIGINAL`: called for each class forward a module is bound with,
  as ``check(forward)``; a string says why there is no original forward
  (transformers' fused layouts), and a call that would run it raises.
- :data:`ORIGINALS`: called likewise as ``replace(forward, layer_name)``; a
  function returned is the module's original forward instead (transformers'
  functions with a package fallback: the torch path under ``disable``).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, TypeGuard, cast

import torch
from torch import nn

from .._compat import _attributes, _kernel_objects, _versions
from .._context._active import in_effect, register_variant
from .._forward import _call_fold, _watch
from .._forward._binding import BINDING, ON_CLASS_PATCH, Binding
from .._forward._call_fold import _aware_call, _plain_call, _skip_as_dynamo_frame
from .._forward._variants import kernel_of
from ._class_dispatch import IN_PLACE, OVER, class_forward, hold, inside, kind_of, original_forward

if TYPE_CHECKING:
    from collections.abc import Callable


__all__ = [
    "CLASS_TYPES",
    "KERNELIZING",
    "NO_ORIGINAL",
    "ORIGINALS",
    "AwareType",
    "aware_modules",
    "binding_of",
    "bound_by_hand",
    "bound_forward",
]

_versions.check_torch()

_OURS = ("forward", BINDING)
# Original class -> its policy-aware subclass, both held weakly: a class defined at run time
# (a notebook cell, a test, remote code) is collected with its instances, as without kernelpolicy.
_AWARE_CLASSES: weakref.WeakKeyDictionary[type[nn.Module], weakref.ref[type[nn.Module]]] = weakref.WeakKeyDictionary()


#: ``members(cls) -> dict``: members each class made aware gets besides this module's (see the module docstring).
CLASS_MEMBERS: list[Callable[[type[nn.Module]], dict[str, Any]]] = []
#: ``check(class_forward) -> why or None``: no original forward (see the module docstring).
NO_ORIGINAL: list[Callable[[Callable[..., Any]], str | None]] = []
#: ``replace(class_forward, layer_name) -> original or None``: another original forward (see the module docstring).
ORIGINALS: list[Callable[[Callable[..., Any], str], Callable[..., Any] | None]] = []
#: True while :func:`kernelize` runs ``kernels.kernelize``: it attaches the model itself, with its options.
KERNELIZING: ContextVar[bool] = ContextVar("kernelpolicy.kernelizing", default=False)
# The variant name :func:`kernelize` binds kernels under while kernels.kernelize runs (None: the default kernel).
_VARIANT: ContextVar[str | None] = ContextVar("kernelpolicy.variant", default=None)
# Kernel layer name -> its policy-aware modules alive, so that a new rule rebuilds their forwards.
_AWARE_MODULES: dict[str, weakref.WeakSet[nn.Module]] = {}


def aware_modules() -> list[nn.Module]:
    """Every policy-aware module alive (transformers' hub attention too, which no model holds)."""
    return [module for modules in list(_AWARE_MODULES.values()) for module in list(modules)]


def binding_of(module: nn.Module) -> Binding | None:
    """The binding of a policy-aware module, or None.

    Takes in first a forward kernels removed behind the module's back (see :func:`_resync`).
    """
    if "forward" not in module.__dict__:
        _resync(module)
    return _stored_binding(module)


def _stored_binding(module: nn.Module) -> Binding | None:
    found = module.__dict__.get(BINDING)
    return found if isinstance(found, Binding) else None


def _resync(module: nn.Module) -> None:
    """After kernels bound ``module``: take in what it did around ``module.forward = ...``.

    kernels >= 0.19 falls back by popping the instance forward out of ``module.__dict__`` (no
    ``__delattr__``): for a policy-aware module that removes the dispatcher, so the module would run its
    original forward under every policy while its binding still named the old kernel. Here that becomes
    what kernels meant, "no kernel" (or, while :func:`kernelize` binds a variant, "no such variant"). Called
    by the watch on kernels' binding function (``_watch``), by :func:`kernelize` after kernels bound a variant,
    and by :func:`binding_of` (so by :func:`attach`), so that ``explain``, ``require`` and copies are right even
    where kernels' binding function cannot be watched.
    """
    binding = _stored_binding(module)
    if binding is not None and "forward" not in module.__dict__:
        _bind(module, None, binding.module_name)


_watch.ON_BIND.append(_resync)

# --- making modules and classes aware ---------------------------------------------------------


def _make_aware(module: nn.Module, module_name: str | None) -> None:
    existing = binding_of(module)  # resynced: a forward kernels removed is taken in
    if existing is not None:
        if module_name is not None and existing.module_name is None:
            existing.module_name = module_name
        return
    cls = type(module)
    if not getattr(cls, "_kernelpolicy_aware", False):
        module.__class__ = _aware_class(cls)
    assigned = module.__dict__.get("forward")
    if assigned is None or _kernels_form(assigned, module):
        _bind(module, assigned, module_name)
        return
    # Another library's forward around the module's (accelerate's hook keeps the one it wraps in
    # ``_old_forward`` and calls it there): the kernel is what it wraps, the wrapper stays around the dispatch.
    inner = module.__dict__.get(_WRAPPED)
    _bind(module, inner if _kernels_form(inner, module) else None, module_name)
    binding = _stored_binding(module)
    assert binding is not None
    binding.wrapper = assigned
    module.__dict__["forward"] = assigned
    if inner is not None:
        module.__dict__[_WRAPPED] = binding.dispatcher


#: Where accelerate's hooks keep the forward they wrap (``add_hook_to_module``), and call it from.
_WRAPPED: Final = _attributes.ACCELERATE_WRAPPED


def _kernels_form(forward: Any, module: nn.Module) -> TypeGuard[types.MethodType]:
    """Whether ``forward`` has the form of kernels' binding: a function bound to ``module`` as a method."""
    return isinstance(forward, types.MethodType) and forward.__self__ is module


def _bind(module: nn.Module, assigned: Any, module_name: str | None) -> None:
    """Bind ``assigned`` (what was set as ``module.forward``) as the module's kernel, or as the variant being bound."""
    _skip_as_dynamo_frame()
    _watch.watch()
    _with_class_forward(type(module))
    original, watched = original_forward(type(module))
    kernel = _kernel_function(module, assigned, original)
    kernel_class = _kernel_class(kernel)
    repository = None  # known once kernels is done binding: Binding.kernel_name asks _kernel_objects
    existing = _stored_binding(module)
    variant = _VARIANT.get()
    if variant is not None and existing is not None:
        if kernel is None:
            existing.variants.pop(variant, None)
        else:
            existing.variants[variant] = kernel_of(kernel, kernel_class, repository)
            register_variant(existing.layer_name, variant)
        existing.install()
        return
    no_original = next((reason for check in NO_ORIGINAL if (reason := check(original)) is not None), None)
    layer_name = str(type(module).kernel_layer_name)  # type: ignore[attr-defined]
    original = next((found for replace in ORIGINALS if (found := replace(original, layer_name))), original)
    binding = Binding(
        module=module,
        module_name=module_name,
        layer_name=layer_name,
        original=_on_own_module(module, original),
        kernel=kernel,
        kernel_class=kernel_class,
        repository=repository,
        no_original=no_original,
        watched=watched,
        replacing=existing,  # kernelized again (train()/eval()): the variants and another library's wrapper stay
    )
    _AWARE_MODULES.setdefault(binding.layer_name, weakref.WeakSet()).add(module)


def _rebind_class_patched(module: nn.Module) -> None:
    """Bind ``module`` again with the same kernel: its class's forward (patched since) is the original now."""
    binding = module.__dict__[BINDING]
    kernel = None if binding.kernel is None else types.MethodType(binding.kernel, module)
    _bind(module, kernel, binding.module_name)


ON_CLASS_PATCH.append(_rebind_class_patched)


def _assign_forward(module: nn.Module, value: Any) -> None:
    """``module.forward = value`` on a policy-aware module: only kernels' binding is a kernel.

    Kernels' binding is what kernels assigns while its binding function runs (``_watch.kernels_binding``), and any
    assignment of kernels' form, a function bound to the module as a method (``MethodType(layer.forward,
    module)``, which is also how code binds a kernel by hand), and every assignment where kernels' binding
    function cannot be watched. The module's own dispatcher assigned back (``f = m.forward; m.forward = f``,
    accelerate's ``remove_hook_from_module``) puts the dispatch back. Anything else (accelerate's hooks, a
    ``functools.partial``, a plain function) becomes the forward around the dispatch it wraps, as it would on
    a plain module; ``del module.forward`` removes it.
    """
    binding = module.__dict__[BINDING]
    if value is binding.dispatcher:
        binding.wrapper = None
        module.__dict__["forward"] = value
    elif _watch.kernels_binding() or not _watch.watching() or _kernels_form(value, module):
        by_hand = _watch.watching() and not _watch.kernels_binding()
        _bind(module, value, binding.module_name)
        kernel = module.__dict__[BINDING].kernel
        if by_hand and kernel is not None:
            _BY_HAND[module] = kernel
    else:
        binding.wrapper = value
        module.__dict__["forward"] = value


# Module -> the kernel bound on it by hand (``module.forward = MethodType(f, module)`` outside kernels), for explain.
_BY_HAND: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()


def bound_by_hand(module: nn.Module) -> bool:
    """Whether the kernel of a policy-aware ``module`` was bound as a method by hand, not by kernels' binding."""
    binding = _stored_binding(module)
    return binding is not None and binding.kernel is not None and _BY_HAND.get(module) is binding.kernel


def _on_own_module(module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, run on ``module`` itself whatever module the call names, for kernels' function wrappers.

    A kernels >= 0.19 function module routes a call by the module it runs on (``_kernel_objects.routes_by_module``):
    under compile the function's global module calls a model's wrapper's forward with itself as ``self``, and
    the original forward run on the global module would route the call back to the wrapper, without end.
    """
    if not _kernel_objects.routes_by_module(original):
        return original

    @functools.wraps(original)
    def forward(_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return original(module, *args, **kwargs)

    return forward


def bound_forward(module: nn.Module) -> types.MethodType | None:
    """The forward bound on ``module`` itself in place of its class's, or None (the one test of "bound a kernel").

    kernels binds a kernel as ``module.forward = MethodType(kernel_forward, module)``, and so does
    kernelpolicy with its policy-aware forward: :func:`binding_of` tells the two apart.
    """
    assigned = module.__dict__.get("forward")
    if not _kernels_form(assigned, module):
        return None
    function = assigned.__func__
    return None if function is _class_forward(module) or kind_of(function) is not None else assigned


def _kernel_function(module: nn.Module, assigned: Any, original: Callable[..., Any]) -> Callable[..., Any] | None:
    """The kernel ``assigned`` binds (called as ``kernel(module, ...)``), or None for the class's own forward."""
    if assigned is None:
        return None
    if _kernels_form(assigned, module):  # kernels binds the class's forward where it falls back
        function = assigned.__func__
        return None if function is original or kind_of(function) is not None else function
    if callable(assigned):
        bound = assigned
        return functools.wraps(bound)(lambda _module, *args, **kwargs: bound(*args, **kwargs))
    return None


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's original forward: its class's, past the class forwards of ``_class_dispatch``."""
    return cast("Callable[..., Any]", original_forward(type(module))[0])


def _dispatches(module: nn.Module, forward: types.FunctionType) -> bool:
    """Whether ``forward``, a class forward of ``_class_dispatch`` called while FX traces, calls the module's own.

    On a module bound by kernelpolicy whose class's forward it is, called from outside that module's own
    forward (FX's trace of the module itself; not a wrapper or kernel of the module reaching its original).
    """
    return (
        getattr(type(module), "forward", None) is forward
        and binding_of(module) is not None
        and "forward" in module.__dict__
        and not inside(module, sys._getframe(2))  # 2: above the class forward that asks
    )


def _with_class_forward(cls: type[nn.Module]) -> None:
    """Give a subclass of a class made aware in place a class forward where it defines its own forward.

    An aware subclass has one from the start, and so has a class made aware in place (:func:`_make_class_aware`);
    a subclass of the latter that defines a forward of its own gets one when its first module is bound.
    """
    for klass in cls.__mro__:
        found = vars(klass).get("forward")
        if found is None:
            continue
        aware_in_place = getattr(klass, "_kernelpolicy_aware", False) and "_kernelpolicy_original" not in vars(klass)
        if kind_of(found) is None and aware_in_place:
            made = class_forward(found, IN_PLACE, _dispatches)
            if made is not None:
                klass.forward = made  # type: ignore[attr-defined]
        return


def _kernel_class(kernel: Callable[..., Any] | None) -> type | None:
    """The kernel layer class whose ``forward`` ``kernel`` is, when it can be found from the function."""
    if kernel is None:
        return None
    owner: Any = sys.modules.get(getattr(kernel, "__module__", "") or "")
    for part in getattr(kernel, "__qualname__", "").split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if inspect.isclass(owner) else None


def _aware_class(cls: type[nn.Module]) -> type[nn.Module]:
    ref = _AWARE_CLASSES.get(cls)
    found = ref() if ref is not None else None
    if found is None:
        namespace: dict[str, Any] = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_kernelpolicy_original": cls,
        }
        namespace.update(_aware_members(cls))
        dispatch = class_forward(getattr(cls, "forward", None), OVER, _dispatches)
        if dispatch is not None:
            namespace["forward"] = dispatch
        found = _aware_type(type(cls))(cls.__name__, (cls,), namespace)
        if dispatch is not None:
            hold(dispatch, found)
        _AWARE_CLASSES[cls] = weakref.ref(found)
    return found


class AwareType(type):
    """The metaclass of the aware classes of classes whose metaclass is ``type`` (nearly all modules).

    An aware class has its original's name and module, so pickle cannot find it by name (``getattr(module,
    qualname)`` is the original). Pickle looks up how to save a class by its metaclass in ``copyreg``'s
    table, which ``type`` itself bypasses: so aware classes have a metaclass of their own, which
    :data:`CLASS_TYPES` registers there (``_copies``: rebuilt from the original class, by name). It adds
    nothing else: ``type(cls)`` is the only difference from the original's.
    """


# The metaclass of the original -> the metaclass of its aware classes (a subclass, see AwareType).
_AWARE_TYPES: dict[type, type] = {type: AwareType}
#: ``registered(metaclass)``: called for each metaclass of aware classes (:class:`AwareType` included) when it
#: is first used (pickling an aware class: ``_copies``, which registers its reduction in ``copyreg``).
CLASS_TYPES: list[Callable[[type], None]] = []
_TYPES_REGISTERED: set[type] = set()


def _aware_type(meta: type) -> type:
    """The metaclass of aware classes made of classes of metaclass ``meta`` (``abc.ABCMeta``: a subclass of it)."""
    found = _AWARE_TYPES.get(meta)
    if found is None:
        name = f"Aware{meta.__name__[:1].upper()}{meta.__name__[1:]}"
        found = _AWARE_TYPES[meta] = type(meta)(name, (meta,), {"__module__": __name__, "__doc__": AwareType.__doc__})
    if found not in _TYPES_REGISTERED:
        for registered in CLASS_TYPES:
            registered(found)
        _TYPES_REGISTERED.add(found)
    return found


def _make_class_aware(cls: type[nn.Module]) -> None:
    if cls.__dict__.get("_kernelpolicy_aware"):
        return
    for name, member in _aware_members(cls).items():
        setattr(cls, name, member)
    if "forward" in cls.__dict__:
        _with_class_forward(cls)
    else:  # inherited: a class forward over it, which looks it up when called (a patch above is seen)
        dispatch = class_forward(getattr(cls, "forward", None), OVER, _dispatches)
        if dispatch is not None:
            hold(dispatch, cls)
            cls.forward = dispatch
    original_init = cls.__dict__.get("__init__") or cls.__init__

    @functools.wraps(original_init)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if binding_of(self) is None:
            _bind(self, self.__dict__.get("forward"), None)

    cls.__init__ = __init__  # type: ignore[method-assign]


def _aware_members(cls: type[nn.Module]) -> dict[str, Any]:
    """``__setattr__``, ``__delattr__``, ``_slow_forward``, ``__call__`` and :data:`CLASS_MEMBERS`' for an aware class."""
    parent_setattr = cls.__setattr__
    parent_delattr = cls.__delattr__
    parent_slow_forward: Callable[..., Any] = cls._slow_forward

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if name == "forward" and BINDING in self.__dict__:
            _assign_forward(self, value)
        else:
            parent_setattr(self, name, value)

    def __delattr__(self: nn.Module, name: str) -> None:
        binding = self.__dict__.get(BINDING)
        if name == "forward" and isinstance(binding, Binding):
            if binding.wrapper is not None:  # the wrapper goes: the policy's dispatch is the forward again
                binding.wrapper = None
                self.__dict__["forward"] = binding.dispatcher
            else:
                _bind(self, None, binding.module_name)
        else:
            parent_delattr(self, name)

    def _slow_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        binding = binding_of(self)
        tracing_state = torch._C._get_tracing_state()
        if binding is None or not tracing_state:
            return parent_slow_forward(self, *args, **kwargs)
        # As nn.Module._slow_forward does: record this module's scope in the trace.
        module_map = torch.jit._trace._trace_module_map
        scope = module_map.get(self) if module_map is not None else None
        if scope:
            tracing_state.push_scope(scope)
        try:
            # The same table entry the eager forward reads, so recorded calls are counted here too.
            mode = getattr(in_effect().modes, binding.layer_name)
            return binding.slow_path(mode, args, kwargs, "jit")
        finally:
            if scope:
                tracing_state.pop_scope()

    members: dict[str, Any] = {
        "_kernelpolicy_aware": True,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "_slow_forward": _slow_forward,
    }
    if _call_fold.FAST_CALL and _plain_call(cls):
        members["__call__"] = _aware_call
    # GroupInputs and pickles (``_copies``) are no feature: every way of making a module aware imports them first.
    assert CLASS_MEMBERS, "kernelpolicy._attach._copies is imported before any class is made aware"
    for more in CLASS_MEMBERS:
        members.update(more(cls))
    return members

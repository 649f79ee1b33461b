"""A policy-aware class's own ``forward``: for FX, which traces a module through its class.

kernelpolicy's dispatcher is a module's instance forward (``module.__dict__["forward"]``), which
``module(x)`` and ``module.forward(x)`` call. ``torch.fx.symbolic_trace(module)`` calls
``type(module).forward(module, ...)`` for the module it traces, so it missed the dispatcher and recorded the
original forward whatever the policy (issue 47; a model containing the module calls it as ``module(x)``, which
was right). So the class of a policy-aware module has a forward of its own, made by :func:`class_forward`.
While FX traces (``symbolic_trace``, or non-strict export, which traces with it; nowhere else), called on a
module kernelpolicy bound, from outside that module's own forward, it calls what ``module(x)`` calls (the
dispatcher, or another library's wrapper around it): the trace follows the policy. Everywhere else it calls the forward it stands for, as the class did before: so
``Class.forward(self, x)``, the usual way for a wrapper or an instrumented kernel to reach the original, still
does, and a wrapper or kernel doing so inside FX's trace of the module reaches it too (its caller is the
module's own forward, on the stack: :func:`inside`).

It stands for the forward it hides, of one of two kinds (its :data:`KIND` attribute):

- :data:`OVER`: in a class that does not define that forward itself (an aware subclass, see ``_aware``, or a
  class made aware in place that inherits its forward): the next one in the module's class's MRO, reached
  with ``super()``, so a patch of a class above is seen;
- :data:`IN_PLACE`: it replaced the forward a class made aware in place defines (a class marked with
  kernelpolicy's ``use_kernel_forward_from_hub``, or a subclass of one with a forward of its own), which it
  keeps (``__wrapped__``).

It has that forward's parameters and globals (FX reads the parameters from the code ``inspect.unwrap``
reaches, rewrites the code of the function it calls where they are variadic, and wraps the math functions of
its globals), its name, docstring and ``__wrapped__`` (so ``inspect.signature`` and ``inspect.getsource``
show the original's).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, Final

from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._context import _state

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

__all__ = ["FILENAME", "IN_PLACE", "KIND", "OVER", "class_forward", "hold", "inside", "kind_of", "original_forward"]

#: The attribute that marks a class forward of this module, with its kind.
KIND: Final = "_kernelpolicy_class_forward"
OVER: Final = "over"
IN_PLACE: Final = "in place"

#: The file name of their code (the generated forwards' start with ``<kernelpolicy`` too: see :func:`inside`).
FILENAME: Final = "<kernelpolicy class forward>"
_FX, _DISPATCHES, _ITSELF, _STOOD, _HOLDER = (
    "__kernelpolicy_fx",
    "__kernelpolicy_dispatches",
    "__kernelpolicy_itself",
    "__kernelpolicy_stood",
    "__kernelpolicy_holder",
)


def kind_of(forward: object) -> str | None:
    """:data:`OVER` or :data:`IN_PLACE` for a class forward of this module, else None."""
    kind = getattr(forward, KIND, None) if isinstance(forward, types.FunctionType) else None
    return kind if isinstance(kind, str) else None


def class_forward(
    stands_for: object, kind: str, dispatches: Callable[[nn.Module, types.FunctionType], bool]
) -> types.FunctionType | None:
    """A class forward of ``kind`` standing for ``stands_for``, or None where that is not a Python function.

    ``dispatches(module, class_forward)``, asked only while FX traces: whether to call the module's instance
    forward (else the forward it stands for). An :data:`OVER` one calls ``super(holder, self).forward``: set
    its holder, the class it is put in, with :func:`hold`.
    """
    if not isinstance(stands_for, types.FunctionType):
        return None
    declared, passed = _parameters(stands_for.__code__)
    own = passed[0]
    rest = ", ".join(passed[1:])
    other = f"{_STOOD}({', '.join(passed)})" if kind == IN_PLACE else f"super({_HOLDER}, {own}).forward({rest})"
    source = (
        f"def make({_FX}, {_DISPATCHES}, {_ITSELF}, {_STOOD}, {_HOLDER}):\n"
        f"    def forward({declared}):\n"
        f"        if {_FX}() and {_DISPATCHES}({own}, {_ITSELF}):\n"
        f"            return {own}.__dict__['forward']({rest})\n"
        f"        return {other}\n"
        "    return forward\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, FILENAME, "exec"), {}, namespace)  # fixed template, checked names
    code = namespace["make"](None, None, None, None, None).__code__
    cells = {
        _FX: types.CellType(_fx_tracing),
        _DISPATCHES: types.CellType(dispatches),
        _ITSELF: types.CellType(),
        _STOOD: types.CellType(stands_for),
        _HOLDER: types.CellType(),
    }
    made = types.FunctionType(
        code,
        stands_for.__globals__,  # FX wraps the math functions of the traced forward's globals
        stands_for.__name__,
        stands_for.__defaults__,
        tuple(cells[name] for name in code.co_freevars),
    )
    made.__kwdefaults__ = stands_for.__kwdefaults__
    functools.update_wrapper(made, stands_for)
    setattr(made, KIND, kind)
    cells[_ITSELF].cell_contents = made
    return made


def hold(forward: types.FunctionType, holder: type) -> None:
    """Say which class an :data:`OVER` class forward is in (its ``super()`` starts after it)."""
    cell = forward.__closure__[forward.__code__.co_freevars.index(_HOLDER)]  # type: ignore[index]
    cell.cell_contents = holder


def _fx_tracing() -> bool:
    """Whether FX traces this call (never where TorchDynamo traces: it folds the first test; eager: two reads)."""
    return not _is_dynamo() and bool(_state.fx_tracing())


def inside(module: nn.Module, frame: types.FrameType | None) -> bool:
    """Whether ``frame`` or a frame above it runs a forward of kernelpolicy's (generated, or a class forward) on ``module``."""
    while frame is not None:
        code = frame.f_code
        if (
            code.co_filename.startswith("<kernelpolicy")
            and code.co_argcount
            and frame.f_locals.get(code.co_varnames[0]) is module
        ):
            return True
        frame = frame.f_back
    return False


def _parameters(code: types.CodeType) -> tuple[str, list[str]]:
    """(the parameter list of a function with ``code``, without defaults; how to pass each on, ``self`` first).

    Falls back to ``self, *args, **kwargs`` for a function without a positional ``self`` or with a name of
    the template's.
    """
    positional = list(code.co_varnames[: code.co_argcount])
    keywords = list(code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount])
    rest = code.co_argcount + code.co_kwonlyargcount
    variadic = code.co_varnames[rest] if code.co_flags & inspect.CO_VARARGS else None
    rest += variadic is not None
    variadic_keywords = code.co_varnames[rest] if code.co_flags & inspect.CO_VARKEYWORDS else None
    names = [*positional, *keywords, variadic, variadic_keywords]
    if not positional or any(name is not None and name.startswith("__kernelpolicy") for name in names):
        return "self, *args, **kwargs", ["self", "*args", "**kwargs"]
    declared = positional[: code.co_posonlyargcount] + (["/"] if code.co_posonlyargcount else [])
    declared += positional[code.co_posonlyargcount :]
    declared += [f"*{variadic}"] if variadic is not None else (["*"] if keywords else [])
    declared += keywords + ([f"**{variadic_keywords}"] if variadic_keywords is not None else [])
    passed = positional + ([f"*{variadic}"] if variadic is not None else []) + [f"{k}={k}" for k in keywords]
    passed += [f"**{variadic_keywords}"] if variadic_keywords is not None else []
    return ", ".join(declared), passed


def original_forward(cls: type) -> tuple[Any, type]:
    """The forward the class forward of ``cls`` stands for, and the class whose ``forward`` to watch for patches.

    The forward is the first one in ``cls``'s MRO that is not a class forward, or the one an :data:`IN_PLACE`
    class forward keeps. The class watched is the one after the first :data:`OVER` class forward (a patch of
    it or above changes its ``forward``), else ``cls`` itself.
    """
    watched: type = cls
    mro = cls.__mro__
    for index, klass in enumerate(mro):
        found = vars(klass).get("forward")
        if found is None:
            continue
        kind = kind_of(found)
        if kind == IN_PLACE:
            return found.__wrapped__, watched
        if kind == OVER:
            if watched is cls:
                watched = mro[index + 1]
            continue
        return found, watched
    raise AttributeError(f"{cls.__qualname__} has no forward")  # nn.Module has one: unreachable for modules

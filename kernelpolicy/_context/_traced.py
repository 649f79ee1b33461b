"""Scopes entered where TorchDynamo traces: inside a ``torch.compile`` region, or under strict ``torch.export``.

This module owns how such a scope is entered and exited. TorchDynamo cannot trace ``ContextVar.set``, but
it traces writes to a plain object's attributes, keeping them as side effects of the program: a scope
entered while tracing pushes a :class:`~kernelpolicy._context._active.TracedFrame` on ``DEFAULTS.traced``, the
forwards' traced branch reads it first (``_active.in_effect``), and the exit pops it, so a program ends
with ``DEFAULTS.traced`` as it began (None), and eager code never sees one. So ``with kernels_disabled():``,
``with kernel_policy(...)`` and a decorated function compile inside ``fullgraph=True`` without a graph
break and take the scope's path, as ``torch.nn.attention.sdpa_kernel`` does.

What the scope puts in effect is resolved while tracing, by :func:`_resolved_name` run as
``torch.compiler.assume_constant_result`` (TorchDynamo calls it and folds its result into the program): so
its arguments are exactly what the program must be guarded on:

- the name of the table in effect where the region began (``Active.name``, read from the table the
  forwards read, so guarded with it; one name per policy value, see ``_active.Active``);
- for each scope entered since, what it was made with, read from the scope (:func:`_value`): constants of
  the traced code for one made in the region, guarded attribute values for one made outside it (a module
  constant, a decorator's scope, one passed as an argument), a policy by its key. So equal policies and
  equal scopes share a program, and nothing is registered per scope.

The traced code then reads the resulting table as an attribute of :data:`_RESOLVED` (a module global),
which TorchDynamo guards as it guards any object read from a global. A scope that cannot be entered (bad
arguments, a refused policy) breaks the graph with the error's message, as a failing ``require`` does:
``fullgraph=True`` fails with it, and otherwise the frame runs eagerly and entering the scope raises it.

TorchDynamo before torch 2.14 enters only context managers made inside the region: a scope object made
outside (a module constant, ``DISABLED = kernels_disabled()``) then fails with TorchDynamo's
"Unsupported context manager" under ``fullgraph=True``, and breaks the graph otherwise (the frame then
runs eagerly, under the scope). ``kernels_disabled()`` makes a new object where TorchDynamo traces, and a
decorated function enters through :class:`Entered`, which is made there, so both work on every supported
torch. A graph break inside such a scope runs the whole frame eagerly (TorchDynamo does not resume inside
a context manager it traced), so the eager scope holds there.
"""

from __future__ import annotations

import ast
import sys
from typing import TYPE_CHECKING, Any, Final, Protocol, final

from .._compat._attributes import DYNAMO_CONSTANT_MARK
from .._values._errors import ScopeError
from .._values._policy import Policy
from ._active import DEFAULTS, Active, TracedFrame, named

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._values._policy import PolicyMode

__all__ = ["Entered", "async_generator_reached", "compiling", "enter", "exit", "generator_reached"]


def _compiling() -> bool:
    """Whether TorchDynamo traces this code: never before torch is imported (scopes import no torch).

    Once it is, :data:`compiling` becomes ``torch.compiler.is_dynamo_compiling`` itself (a scope's entry
    and exit each ask).
    """
    global compiling
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    compiling = torch.compiler.is_dynamo_compiling
    return compiling()


compiling: Callable[[], bool] = _compiling


class _Enterable(Protocol):
    """A scope as :func:`enter` reads it: ``kernel_policy``'s state (arguments, internal switches)."""

    _made: tuple[object, dict[str, Any]] | None
    _fixed: Policy | None
    _mode: PolicyMode | None
    _layers: dict[str, str]
    _options: tuple[dict[str, object], str]  # the checked options and their options_text
    _recording: bool | None
    _deferred: bool

    def entered(self, enclosing: Active) -> Active: ...


def enter(scope: _Enterable) -> Policy:
    """Enter ``scope`` while tracing; return the policy it puts in effect (``__enter__``'s value)."""
    frame = DEFAULTS.traced
    chain = (*((DEFAULTS.active._current.name,) if frame is None else frame.chain), *_value(scope))
    resolved = _resolved_name(*chain)
    if resolved.startswith(_REFUSED):
        # As require's failure (see _binding): fullgraph=True fails with this message; otherwise the frame
        # runs eagerly, where entering the scope raises the error itself.
        sys.modules["torch"]._dynamo.graph_break(msg=resolved[len(_REFUSED) :])
    active: Active = getattr(_RESOLVED, resolved)
    DEFAULTS.traced = TracedFrame(scope, active, frame, chain)
    return active.policy


def _value(scope: _Enterable) -> tuple[Any, ...]:
    """What entering ``scope`` depends on, as constants: (its class, mode, layers, options, recording, deferred).

    Read where TorchDynamo traces, so each read is guarded by value: equal scopes pass one program's guards,
    whether made in the region, outside it or per call. A :class:`~kernelpolicy.Policy` is given by its value,
    options by their text (``_policy.options_text``).
    """
    if scope._made is not None:
        (mode, layers), options = scope._made, ""
    else:
        mode, layers = scope._mode if scope._fixed is None else scope._fixed, scope._layers
        options = scope._options[1]
    if isinstance(mode, Policy):
        mode = (_KEY, mode._key.default, mode._key.layers, mode._options_text)
    return type(scope), mode, layers, options, scope._recording, scope._deferred


def exit(scope: object) -> None:
    """Exit ``scope`` while tracing (it must be the innermost one entered there)."""
    frame = DEFAULTS.traced
    if frame is None or frame.scope is not scope:
        raise ScopeError(f"{scope!r} exited out of order in a region TorchDynamo compiles")
    DEFAULTS.traced = frame.enclosing


def generator_reached(scope: object) -> None:
    """A generator decorated with ``scope`` is started where TorchDynamo traces: break the graph, run it eagerly.

    Its body runs in a context of its own across yields, which a traced program cannot hold: a push on
    ``DEFAULTS.traced`` would outlive the program (the process's policy for good). TorchDynamo traces a
    generator inlined in its caller: the caller's graph breaks at the call with this message (so
    ``fullgraph=True`` fails with it), and the generator runs eagerly, under the eager scope, where the
    forwards it calls are compiled as frames of their own.
    """
    sys.modules["torch"]._dynamo.graph_break(
        msg=f"kernelpolicy: a generator decorated with {scope!r} runs eagerly: its scope holds across its yields, "
        "which a compiled program cannot hold. Enter the scope with `with` inside the compiled code instead"
    )


def async_generator_reached(scope: object) -> tuple[Callable[[str], None], str]:
    """As :func:`generator_reached`, for an async generator: TorchDynamo's ``skip_frame`` and its message.

    TorchDynamo traces an async generator's frame on its own, where it cannot resume after a graph break (it
    fails with a bare ``AssertionError``); the wrapper's frame calls ``skip_frame`` itself (it skips the frame
    that calls it), so the frame runs eagerly and nothing of it is traced.
    """
    skip: Callable[[str], None] = sys.modules["torch"]._dynamo.skip_frame
    return skip, f"kernelpolicy: an async generator decorated with {scope!r} runs eagerly"


@final
class Entered:
    """A scope made outside a compiled region, entered inside one by a decorated function.

    TorchDynamo before torch 2.14 traces only context managers made in the region: this one is.
    """

    __slots__ = ("scope",)

    def __init__(self, scope: _Enterable) -> None:
        self.scope = scope

    def __enter__(self) -> Policy:
        return enter(self.scope)

    def __exit__(self, *exc_info: object) -> None:
        exit(self.scope)


@final
class _Resolved:
    """The tables scopes entered in compiled regions put in effect, one attribute each (by ``Active.name``)."""


_RESOLVED = _Resolved()


def _resolved_name(start: str, *scopes: Any) -> str:
    """The name of what the scopes entered in a region put in effect, from the table named ``start``.

    ``scopes``: six items per scope, its :func:`_value`. Kept in :data:`_RESOLVED`, so alive while compiled
    programs may read it.
    """
    active = named(start)
    for index in range(0, len(scopes), _WIDTH):
        given, mode, layers, options, recording, deferred = scopes[index : index + _WIDTH]
        try:
            scope = given(_given_mode(mode), **layers, **_options(options))
            scope._recording, scope._deferred = recording, deferred
            active = scope.entered(active)
        except Exception as error:  # noqa: BLE001 - raised where the scope is entered eagerly (see enter)
            written = _written(mode, {**layers, **_options(options)})
            return f"{_REFUSED}kernelpolicy: {written} cannot be entered: {error}"
    setattr(_RESOLVED, active.name, active)
    return active.name


def _given_mode(mode: object) -> object:
    """``mode`` as :func:`_value` gave it: a :class:`~kernelpolicy.Policy` where it was one."""
    if isinstance(mode, tuple) and mode and mode[0] == _KEY:
        _, default, layers, options = mode
        return Policy(default, **dict(layers), **_options(options))
    return mode


def _options(text: str) -> dict[str, Any]:
    """The options :func:`_value` gave as text (``_policy.options_text``; checked again by the scope made of them)."""
    return dict(ast.literal_eval(text)) if text else {}


def _written(mode: object, layers: dict[str, Any]) -> str:
    """How a scope made with ``mode`` and ``layers`` is written."""
    written = [repr(_given_mode(mode))] if mode is not None else []
    return f"kernel_policy({', '.join(written + [f'{name}={value!r}' for name, value in layers.items()])})"


_REFUSED: Final = "!"
_WIDTH: Final = 6
#: What marks a policy given by its value in :func:`_value` (a plain tuple: TorchDynamo guards a named tuple on identity).
_KEY: Final = "kernelpolicy.Policy"
# torch.compiler.assume_constant_result's mark, set directly (importing TorchDynamo takes over a second).
setattr(_resolved_name, DYNAMO_CONSTANT_MARK, True)

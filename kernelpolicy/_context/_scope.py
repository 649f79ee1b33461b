"""Scopes: how code changes the policy in effect.

This module owns :class:`kernel_policy` (context manager and decorator: what
it does to a function is ``_decorate``'s), :func:`kernels_disabled` and
:func:`set_default_policy` (``_propagate`` carries a policy elsewhere).

The nesting rule is *a scope decides what it names*: a positional mode (or a
:class:`~kernelpolicy.Policy` value) names every layer, keyword layers name
only themselves, and everything else is inherited from the enclosing scope,
captured when the scope is entered (as :func:`decimal.localcontext` does).

Guarantees:

- State lives in a :class:`contextvars.ContextVar`, so scopes are isolated per
  thread and per asyncio task. A new thread starts from the process default
  (Python < 3.14 threads do not inherit contexts); ``kernelpolicy.propagate`` carries a
  policy into a worker explicitly.
- A scope object keeps no per-entry state on itself: one object may be a
  module constant, entered from many threads and tasks at once and nested in
  itself.
- Exceptions pass through unchanged and the previous policy is restored
  exactly, also on ``GeneratorExit`` and task cancellation. Exiting scopes out
  of order raises :class:`~kernelpolicy.errors.ScopeError` instead of silently
  restoring the wrong policy.
- As a decorator: the policy holds while the body runs, and a generator's
  across its yields, unseen by the consumer (``_decorate``).
"""

from __future__ import annotations

import difflib
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, final, overload

from .._values._errors import PolicyError, ScopeError, warn_at_caller
from .._values._policy import (
    BUILTIN,
    DEFAULT_VARIANT,
    MODES,
    VALID_MODES,
    VARIANTS,
    Policy,
    PolicyMode,
    check_entry,
    check_layer_name,
    check_mode,
    options_text,
    split_options,
)
from . import _traced as traced
from ._active import (
    _SCOPED,
    DEFAULTS,
    POLICY_CHECKS,
    RECORDERS,
    Active,
    activate,
    any_variant,
    ensure_env,
    known_layers,
    known_variants,
)
from ._decorate import decorate

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from types import TracebackType

__all__ = ["kernel_policy", "kernels_disabled", "set_default_policy", "set_unchecked_default"]

F = TypeVar("F", bound="Callable[..., Any]")


class _Frame(NamedTuple):
    """One entered scope of this context (a linked list through ``enclosing``)."""

    scope: kernel_policy
    token: Token[Active]
    recorders: Token[tuple[Any, ...]] | None
    enclosing: _Frame | None


_FRAMES: ContextVar[_Frame | None] = ContextVar("kernelpolicy.frames", default=None)
_CACHE_LIMIT = 64


def _validated(
    mode: object, arguments: Mapping[str, object], *, what: str = "kernel_policy"
) -> tuple[Policy | None, PolicyMode | None, dict[str, str], dict[str, object]]:
    """Check scope arguments eagerly; return (fixed policy, default mode, layer modes, verify options).

    ``mode=`` as a keyword is the mode of every layer, like the positional (``kernelize`` takes ``mode=``
    too). A layer name close to a known one (another case, a small edit) warns with the known name, at
    the caller's line.
    """
    if "mode" in arguments:
        arguments = dict(arguments)
        keyword = arguments.pop("mode")
        if mode is not None:
            raise PolicyError(f"{what} got its mode twice: {mode!r} (positional) and mode={keyword!r}")
        mode = keyword
    if callable(mode) and not isinstance(mode, (str, Policy)):
        raise PolicyError(
            f"{what} was given {mode!r} as its mode: as a decorator it needs its arguments, "
            f"@{what}('disable') or @{what}(RMSNorm='disable'), not @{what}"
        )
    layers, options = split_options(arguments)
    checked = {check_layer_name(name): check_entry(value, f"layer {name!r}") for name, value in layers.items()}
    for name in checked:
        _hint_known_layer(name, what)
    if isinstance(mode, Policy):
        if checked or options:
            raise PolicyError(
                f"give either a Policy or layer modes and options, not both (got {mode!r} and "
                f"{sorted([*checked, *options])})"
            )
        return mode, None, {}, {}
    if mode is None:
        return None, None, checked, options
    if isinstance(mode, str) and mode not in MODES and mode.isidentifier():
        raise PolicyError(
            f"unknown kernel policy mode {mode!r} for every layer; valid modes are {VALID_MODES}. "
            f"A positional argument is the mode of every layer; to set one layer, name it: {what}({mode}='disable')"
        )
    return None, check_mode(mode, "the default"), checked, options


def _hint_known_layer(name: str, what: str) -> None:
    """Warn when ``name`` is not a known kernel layer name but differs from one by case or a small edit.

    A warning, not an error: a model loaded later may bring that name. It points at the user's line.
    """
    known = known_layers()
    if not known or name in known:
        return
    names = sorted(known)
    close = [k for k in names if k.lower() == name.lower()] or difflib.get_close_matches(name, names, 1, 0.8)
    if not close:
        return
    warn_at_caller(
        f"{what}: no kernel layer is named {name!r} (names are case-sensitive); did you mean {close[0]!r}? "
        f"Known kernel layers: {', '.join(names)}"
    )


@final
class kernel_policy:  # noqa: N801 - lowercase like numpy.errstate and decimal.localcontext
    """Set the kernel policy for a block, a function, a coroutine or a generator.

    ``kernel_policy(mode=None, /, **layers)``: ``mode`` names every layer,
    keyword arguments name single kernel layers (by the name given to
    ``use_kernel_forward_from_hub``). ``mode=`` may be given by keyword too
    (as ``kernelize`` takes it); a kernel layer cannot be named ``mode``. A
    layer name that is not known but close to a known one (another case, a
    small edit) warns with the known name. A :class:`~kernelpolicy.Policy` value
    may be passed instead of ``mode`` to re-apply a captured policy.
    ``atol``, ``rtol`` and ``on_mismatch`` set the options of ``verify``.

    >>> from kernelpolicy import current_policy, kernel_policy
    >>> with kernel_policy("prefer", RMSNorm="disable"):
    ...     with kernel_policy(SiLU="require"):
    ...         print(current_policy())
    prefer,RMSNorm=disable,SiLU=require
    >>> @kernel_policy("disable")
    ... def reference_logits():
    ...     return current_policy().default
    >>> reference_logits()
    'disable'

    Entering returns the policy now in effect. Bad arguments raise
    :class:`~kernelpolicy.PolicyError` here, never later in a forward.
    """

    __module__ = "kernelpolicy"  # the public name (see kernelpolicy/__init__.py)

    __slots__ = ("_cache", "_deferred", "_fixed", "_layers", "_made", "_mode", "_options", "_recorders", "_recording")

    def __init__(self, mode: PolicyMode | Policy | None = None, /, **layers: Any) -> None:
        # Internal (record_calls, propagate): switch recording, install recorders.
        self._recording: bool | None = None
        self._recorders: tuple[Any, ...] | None = None
        # Internal (the pytest plugin, a policy propagate carried to a worker): the variants named are checked
        # by the caller later (once fixtures bound them), or not at all (the worker's task binds them).
        self._deferred = False
        self._made: tuple[object, dict[str, Any]] | None = (mode, layers) if traced.compiling() else None  # see _traced
        if self._made is not None:
            return
        self._fixed, self._mode, self._layers, options = _validated(mode, layers)
        self._options = (options, options_text(options))  # the text: what traced code reads (see _traced)
        self._cache: dict[Active, Active] = {}

    def entered(self, enclosing: Active) -> Active:
        """What entering this scope inside ``enclosing`` puts in effect, checked as ``__enter__`` checks it."""
        ensure_env()
        active = self.resolve(enclosing)
        if active.policy._names_variants and not self._deferred:
            check_variants(active.policy, "kernel_policy")
        if POLICY_CHECKS:
            _check(active.policy)
        return active

    def resolve(self, enclosing: Active) -> Active:
        """What this scope puts in effect inside ``enclosing`` (recording is inherited unless set here)."""
        found = self._cache.get(enclosing)
        if found is None:
            policy = self._fixed
            if policy is None:
                policy = enclosing.policy.overlay(self._mode, self._layers, self._options[0])
            found = activate(policy, enclosing.recording if self._recording is None else self._recording)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[enclosing] = found
        return found

    def __enter__(self) -> Policy:
        if traced.compiling():
            return traced.enter(self)
        return self._enter_here()

    def _enter_here(self) -> Policy:
        """Enter in this context, as eager code does (also a generator's: see ``_decorate``)."""
        if self._made is not None:  # made while TorchDynamo traced, entered eagerly (a graph break)
            self._fixed, self._mode, self._layers, options = _validated(*self._made)
            self._options = (options, options_text(options))
            self._cache, self._made = {}, None
        active = self.entered(DEFAULTS.active._current)
        token = _SCOPED.set(active)
        recorders = None if self._recorders is None else RECORDERS.set(self._recorders)
        _FRAMES.set(_Frame(self, token, recorders, _FRAMES.get()))
        return active.policy

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if DEFAULTS.traced is not None:  # entered where TorchDynamo traces (never set in eager code)
            return traced.exit(self)
        frame = _FRAMES.get()
        if frame is None or frame.scope is not self:
            raise ScopeError(
                f"{self!r} exited out of order: "
                + (
                    "no scope is active in this context (exited twice, or in another thread or task?)"
                    if frame is None
                    else f"the innermost active scope here is {frame.scope!r}"
                )
            )
        try:
            _SCOPED.reset(frame.token)
            if frame.recorders is not None:
                RECORDERS.reset(frame.recorders)
        except (ValueError, RuntimeError) as error:  # token from another Context, or already used
            raise ScopeError(
                f"{self!r} exited in another context than it was entered in, or exited there already"
            ) from error
        _FRAMES.set(frame.enclosing)

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so that its body runs under this scope (see ``_decorate``).

        A ``classmethod`` or ``staticmethod`` (the decorator written above it) stays one, its function decorated.
        """
        return decorate(self, fn)

    def __repr__(self) -> str:
        if self._made is not None:
            mode, layers = self._made
            return f"kernel_policy({', '.join([repr(mode)] + [f'{name}={value!r}' for name, value in layers.items()])})"
        if self._fixed is not None:
            return f"kernel_policy({self._fixed!r})"
        args = [repr(self._mode)] if self._mode is not None else []
        args += [f"{name}={mode!r}" for name, mode in self._layers.items()]
        args += [f"{name}={value!r}" for name, value in self._options[0].items()]
        return f"kernel_policy({', '.join(args)})"


_DISABLED_ALL = kernel_policy("disable")


@overload
def kernels_disabled(function: F, /) -> F: ...


@overload
def kernels_disabled(*layer_names: str) -> kernel_policy: ...


def kernels_disabled(*layer_names: Any) -> Any:
    """``kernel_policy("disable")``; with names, disable only those kernel layers.

    >>> from kernelpolicy import current_policy, kernels_disabled
    >>> with kernels_disabled():
    ...     current_policy().mode_for("RMSNorm")
    'disable'
    >>> with kernels_disabled("RMSNorm"):
    ...     current_policy().mode_for("RMSNorm"), current_policy().mode_for("SiLU")
    ('disable', 'prefer')

    As a decorator, with or without parentheses:

    >>> @kernels_disabled
    ... def reference():
    ...     return current_policy().default
    >>> reference()
    'disable'
    """
    if not layer_names:
        return kernel_policy("disable") if traced.compiling() else _DISABLED_ALL  # see _traced.Entered
    if len(layer_names) == 1 and (
        isinstance(layer_names[0], (classmethod, staticmethod))
        or (callable(layer_names[0]) and not isinstance(layer_names[0], str))
    ):
        return _DISABLED_ALL(layer_names[0])  # type: ignore[type-var]  # @kernels_disabled without parentheses
    seen: set[str] = set()
    for name in layer_names:
        check_layer_name(name)
        if name in seen:
            raise PolicyError(f"layer {name!r} named twice")
        seen.add(name)
    disable: PolicyMode = "disable"
    return kernel_policy(**dict.fromkeys(layer_names, disable))


def set_default_policy(mode: PolicyMode | Policy | None = None, /, **layers: Any) -> Policy:
    """Set the process-wide policy seen where no scope is active; return the previous one.

    Arguments are those of :class:`kernel_policy` and layer over the
    ``KERNELPOLICY`` variable (or the built-in ``prefer``): what the call names
    wins, the rest comes from the variable. Called with no arguments it
    restores the default from ``KERNELPOLICY``. It applies to every thread and
    task, including ones already running; scopes active elsewhere keep the
    policy they captured when they were entered. Thread-safe.

    >>> import kernelpolicy
    >>> previous = kernelpolicy.set_default_policy("disable")
    >>> kernelpolicy.current_policy().default
    'disable'
    >>> _ = kernelpolicy.set_default_policy(previous)
    """
    fixed, default, checked, options = _validated(mode, layers, what="set_default_policy")
    ensure_env()
    restore = fixed is None and default is None and not checked and not options
    base = DEFAULTS.env if DEFAULTS.env is not None else BUILTIN
    new = base if restore else fixed if fixed is not None else base.overlay(default, checked, options)
    if new.names_variants:
        check_variants(new, "set_default_policy")
    return _set_default(new, explicit=not restore)


def set_unchecked_default(policy: Policy) -> Policy:
    """``set_default_policy(policy)`` without checking that its variants are bound: a policy carried to a worker.

    See ``_propagate``'s docstring (``processes.worker_init_fn`` calls it).
    """
    ensure_env()
    return _set_default(policy, explicit=True)


def _set_default(new: Policy, *, explicit: bool) -> Policy:
    if POLICY_CHECKS:
        _check(new)
    with DEFAULTS.lock:
        previous = DEFAULTS.active.policy
        DEFAULTS.explicit = new if explicit else None
        DEFAULTS.set(new)
    return previous


def check_variants(policy: Policy, what: str) -> None:
    """Every variant a policy names must be bound for its layer somewhere in the process (or be ``default``)."""
    reference = policy.options.reference
    if reference not in (None, "original", DEFAULT_VARIANT) and not any_variant(reference):
        raise PolicyError(
            f"{what}: reference={reference!r} names no kernel variant bound in this process; give 'original', "
            f"{DEFAULT_VARIANT!r} or a variant bound with kernelpolicy.kernelize(model, mode=..., variant=...)"
        )
    for layer, names in policy.variant_entries:
        bound = known_variants(layer)
        for name in names:
            if name != DEFAULT_VARIANT and name not in bound:
                listed = ", ".join(repr(v) for v in sorted(bound)) if bound else "none yet"
                raise PolicyError(
                    f"{what}: no kernel variant {name!r} is bound for kernel layer {layer!r} "
                    f"(in {layer}={VARIANTS}{'|'.join(names)}); bound: {listed}, and {DEFAULT_VARIANT!r} (the kernel "
                    f"bound without a variant name). kernelpolicy.kernelize(model, mode=..., variant={name!r}) binds one"
                )


def _check(policy: Policy) -> None:
    for check in tuple(POLICY_CHECKS):
        check(policy)


def _recording_scope(policy: Policy | None, *, recording: bool | None, recorders: tuple[Any, ...]) -> kernel_policy:
    """A scope that also switches call recording and installs ``recorders`` (for record_calls and propagate).

    ``policy`` None keeps the enclosing policy; ``recording`` None keeps the enclosing recording state.
    """
    scope = kernel_policy() if policy is None else kernel_policy(policy)
    scope._recording = recording
    scope._recorders = recorders
    return scope

"""Carrying the policy in effect to where a callable runs: another thread, a pool, another process.

This module owns :func:`propagate`: a callable wrapped to run under the policy (and the ``record_calls``
recorders) in effect where it was wrapped, which pickles with that policy for process pools; and what a
worker's initializer (``processes.worker_init_fn``) does with a carried policy: :func:`leave_scopes`.

A policy carried to another process may name kernel variants (``RMSNorm="kernel:fast"``): they were bound
where it was captured, and the worker binds its own later, in its task (as a ``KERNELPOLICY`` naming variants
is read before any is bound). So a carried policy takes effect there unchecked; a call whose variant is not
bound takes the entry's next candidate or the original (``explain``: ``no variant can run ('fast' not bound)``),
and ``require`` raises.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, Any, TypeVar, cast, final

from ._active import _SCOPED, DEFAULTS, RECORDERS, ensure_env, in_effect
from ._scope import _FRAMES, _recording_scope, kernel_policy

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._values._policy import Policy
    from ._active import Active

__all__ = ["leave_scopes", "propagate"]

F = TypeVar("F", bound="Callable[..., Any]")


def propagate(fn: F) -> F:
    """Wrap ``fn`` to run under the policy in effect now, wherever it is called.

    Carries kernelpolicy's state only: the policy, and the ``record_calls``
    recorders active here (so calls made by the worker are counted for the
    caller). Thread pools and ``loop.run_in_executor`` do not carry contexts;
    wrap the callable before handing it over:

    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from kernelpolicy import current_policy, kernels_disabled, propagate
    >>> with ThreadPoolExecutor(1) as pool, kernels_disabled():
    ...     pool.submit(propagate(lambda: str(current_policy()))).result()
    'disable'

    A wrapped plain function pickles by value, so it also goes to a process
    pool (fork, spawn or forkserver) when ``fn`` itself pickles: the worker
    process runs it under the same policy. Recorders stay in this process:
    calls made in another process are not counted here.
    """
    ensure_env()
    current: Active = in_effect()
    wrapped = _recording_scope(current.policy, recording=current.recording, recorders=RECORDERS.get())(fn)
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        return wrapped
    return cast("F", _Propagated(fn, current.policy, wrapped))


@final
class _Propagated:
    """What :func:`propagate` returns for a plain callable: calls it in its scope, pickles as (``fn``, policy)."""

    def __init__(self, fn: Callable[..., Any], policy: Policy, call: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self._policy = policy
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[object, ...]:
        return (_propagated, (self.__wrapped__, self._policy))  # type: ignore[attr-defined]


def _propagated(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """``fn`` under ``policy``, rebuilt in another process (its variants unchecked: see the module docstring)."""
    scope = kernel_policy(policy)
    scope._deferred = True
    return scope(fn)


def leave_scopes() -> None:
    """End every scope active in this context, unexited: from here on the process default is in effect in it.

    For a worker's initializer (``processes.worker_init_fn``): a forked worker runs in a copy of the forking
    thread's context, whose scopes (and ``record_calls`` recorders, copies of the parent's) would otherwise
    hold for the worker's life over the default the initializer sets. The variable is reset to what it was
    before the outermost scope (unset); where that scope was entered in another context (a generator's own),
    the variable holds the process default's own table, which reads as unset does (the same object) until
    ``set_default_policy`` replaces it. The scopes' exits are never called in the worker.
    """
    frame, outermost = _FRAMES.get(), None
    while frame is not None:
        frame, outermost = frame.enclosing, frame
    if outermost is not None:
        with contextlib.suppress(ValueError, RuntimeError):  # entered in another context than this one
            _SCOPED.reset(outermost.token)
    if _SCOPED.get(None) is not None:
        _SCOPED.set(DEFAULTS.active)
    _FRAMES.set(None)
    RECORDERS.set(())

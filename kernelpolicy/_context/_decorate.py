"""What a scope does to a function it decorates: the body runs under the scope.

This module owns what decorating with ``kernel_policy`` does (:func:`decorate`, which
``kernel_policy.__call__`` calls). On a sync function or ``async def`` coroutine the policy holds while the
body runs; on a generator or async generator function the body runs in its own copy of the context in which it
is first iterated (a generator's body starts at its first ``next()``, and the decorated function stays a
generator function), so the policy holds across its yields and the consumer never sees it; the
``record_calls`` blocks active in the consumer's context count its calls at each step. Started under
``torch.compile``, it runs eagerly (``_traced.generator_reached``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, final

from . import _traced as traced
from ._active import _SCOPED, DEFAULTS, RECORDERS
from ._traced import _Enterable

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
    from types import TracebackType

    from .._values._policy import Policy

__all__ = ["decorate"]

F = TypeVar("F", bound="Callable[..., Any]")


class Decorated(_Enterable, Protocol):
    """A scope as :func:`decorate` reads it (``kernel_policy``): entered with ``with``, or in a generator's context."""

    _recorders: tuple[Any, ...] | None

    def _enter_here(self) -> Policy: ...

    def __enter__(self) -> Policy: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def decorate(scope: Decorated, fn: F) -> F:
    """Decorate ``fn`` so that its body runs under ``scope`` (see the module docstring).

    A ``classmethod`` or ``staticmethod`` (the decorator written above it) stays one, its function decorated.
    """
    if isinstance(fn, (classmethod, staticmethod)):
        return cast("F", type(fn)(decorate(scope, fn.__func__)))
    if not callable(fn) or inspect.isclass(fn):
        raise TypeError(f"kernel_policy can decorate functions, not {fn!r}")
    if inspect.isasyncgenfunction(fn):
        return cast("F", _wrap_async_generator(scope, fn))
    if inspect.iscoroutinefunction(fn):
        return cast("F", _wrap_coroutine(scope, fn))
    if inspect.isgeneratorfunction(fn):
        return cast("F", _wrap_generator(scope, fn))

    @functools.wraps(fn)
    def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
        with traced.Entered(scope) if traced.compiling() else scope:
            return fn(*args, **kwargs)

    return cast("F", sync_wrapper)


def _wrap_coroutine(scope: Decorated, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    # The coroutine runs in its caller's task; the caller is suspended
    # while it awaits, so setting the scope around the body is exact.
    @functools.wraps(fn)
    async def coroutine_wrapper(*args: Any, **kwargs: Any) -> Any:
        with scope:
            return await fn(*args, **kwargs)

    return coroutine_wrapper


def _start(scope: Decorated) -> contextvars.Context:
    """A generator's own context, ``scope`` entered there eagerly (never exited: dropped with the generator)."""
    if traced.compiling():  # TorchDynamo traces a generator inlined in its caller: break the graph there
        traced.generator_reached(scope)
    ctx = contextvars.copy_context()
    ctx.run(scope._enter_here)
    return ctx


def _follow(scope: Decorated, ctx: contextvars.Context) -> None:
    """Before a generator's step: its context counts in the ``record_calls`` blocks active in the consumer's.

    The generator keeps its own policy across yields; the recorders (and whether calls are recorded) are
    the consumer's at each step, so a recorder counts the calls made while its block is active. A scope
    that installs recorders of its own (``propagate``) keeps them.
    """
    if scope._recorders is not None:
        return
    ctx.run(_follow_recorders, RECORDERS.get(), DEFAULTS.active._current.recording)


def _wrap_generator(
    scope: Decorated, fn: Callable[..., Generator[Any, Any, Any]]
) -> Callable[..., Generator[Any, Any, Any]]:
    @functools.wraps(fn)
    def generator_wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        ctx, gen = _start(scope), fn(*args, **kwargs)
        try:
            _follow(scope, ctx)
            value = ctx.run(next, gen)
        except StopIteration as stop:
            return stop.value
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                ctx.run(gen.close)
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded into the generator
                try:
                    _follow(scope, ctx)
                    value = ctx.run(gen.throw, exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    _follow(scope, ctx)
                    value = ctx.run(gen.send, sent)
                except StopIteration as stop:
                    return stop.value

    return generator_wrapper


def _wrap_async_generator(
    scope: Decorated, fn: Callable[..., AsyncGenerator[Any, Any]]
) -> Callable[..., AsyncGenerator[Any, Any]]:
    @functools.wraps(fn)
    async def async_generator_wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        if traced.compiling():  # TorchDynamo traces this frame on its own: skip it (called here, see _traced)
            skip_frame, message = traced.async_generator_reached(scope)
            skip_frame(message)
        ctx, agen = _start(scope), fn(*args, **kwargs)
        try:
            _follow(scope, ctx)
            value = await _InContext(ctx, agen.__anext__())
        except StopAsyncIteration:
            return
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                await _InContext(ctx, agen.aclose())
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded into the generator
                try:
                    _follow(scope, ctx)
                    value = await _InContext(ctx, agen.athrow(exc))
                except StopAsyncIteration:
                    return
            else:
                try:
                    _follow(scope, ctx)
                    value = await _InContext(ctx, agen.asend(sent))
                except StopAsyncIteration:
                    return

    return async_generator_wrapper


@final
class _InContext:
    """Await ``awaitable`` with every step of it run inside ``ctx``."""

    __slots__ = ("_awaitable", "_ctx")

    def __init__(self, ctx: contextvars.Context, awaitable: Awaitable[Any]) -> None:
        self._ctx = ctx
        self._awaitable = awaitable

    def __await__(self) -> Generator[Any, Any, Any]:
        steps = self._awaitable.__await__()
        run = self._ctx.run
        sent: Any = None
        error: BaseException | None = None
        while True:
            try:
                signal = run(steps.send, sent) if error is None else run(steps.throw, error)
            except StopIteration as stop:
                return stop.value
            try:
                sent, error = (yield signal), None
            except BaseException as exc:  # noqa: BLE001 - forwarded into the awaitable
                sent, error = None, exc


def _follow_recorders(recorders: tuple[Any, ...], recording: bool) -> None:
    """In a generator's context: these recorders, and the recording state, on the policy in effect there."""
    RECORDERS.set(recorders)
    active = DEFAULTS.active._current
    if active.recording != recording:
        _SCOPED.set(active.recorded(recording))

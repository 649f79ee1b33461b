"""kernel_policy as a decorator: sync functions, coroutines, generators and async generators."""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
from typing import TYPE_CHECKING

import pytest

import kernelpolicy as kp
from kernelpolicy import Policy, current_policy, kernel_policy
from kernelpolicy._values._policy import MODES

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator

PREFER = Policy("prefer")
DISABLED = Policy("disable")


class CustomError(Exception):
    pass


# --- metadata and kind ------------------------------------------------------------


def _sync(a: int) -> int:
    """Sync doc."""
    return a


async def _coro(a: int) -> int:
    """Coroutine doc."""
    return a


def _gen(a: int) -> Iterator[int]:
    """Generator doc."""
    yield a


async def _agen(a: int) -> AsyncIterator[int]:
    """Async generator doc."""
    yield a


KINDS = [
    (_sync, (False, False, False)),
    (_coro, (True, False, False)),
    (_gen, (False, True, False)),
    (_agen, (False, False, True)),
]


@pytest.mark.parametrize(("fn", "kind"), KINDS)
def test_wraps_metadata_and_kind(fn: object, kind: tuple[bool, bool, bool]) -> None:
    decorated = kernel_policy("disable")(fn)  # type: ignore[type-var]
    assert decorated is not fn
    assert decorated.__name__ == fn.__name__  # type: ignore[attr-defined]
    assert decorated.__qualname__ == fn.__qualname__  # type: ignore[attr-defined]
    assert decorated.__doc__ == fn.__doc__
    assert decorated.__module__ == fn.__module__
    assert decorated.__wrapped__ is fn  # type: ignore[attr-defined]
    assert (
        inspect.iscoroutinefunction(decorated),
        inspect.isgeneratorfunction(decorated),
        inspect.isasyncgenfunction(decorated),
    ) == kind


@pytest.mark.parametrize("target", [int, type("Model", (), {}), 42, "text", None, [1]])
def test_decorating_class_or_non_callable_raises_type_error(target: object) -> None:
    with pytest.raises(TypeError):
        kernel_policy("disable")(target)  # type: ignore[type-var]


def test_decorating_callable_object() -> None:
    class Callable:
        def __call__(self, x: int) -> tuple[int, Policy]:
            return x, current_policy()

    decorated = kernel_policy(RMSNorm="disable")(Callable())
    assert decorated(3) == (3, Policy("prefer", RMSNorm="disable"))
    assert current_policy() == PREFER


# --- sync functions -----------------------------------------------------------------


def test_sync_function_policy_holds_in_body() -> None:
    @kernel_policy("disable", SiLU="require")
    def body(a: int, *, b: int) -> tuple[int, Policy]:
        return a + b, current_policy()

    assert body(1, b=2) == (3, Policy("disable", SiLU="require"))
    assert current_policy() == PREFER


def test_sync_decorator_inherits_enclosing_at_call_time() -> None:
    @kernel_policy(RMSNorm="disable")
    def body() -> Policy:
        return current_policy()

    with kernel_policy("require"):
        assert body() == Policy("require", RMSNorm="disable")
    with kernel_policy(SiLU="disable"):
        assert body() == Policy("prefer", RMSNorm="disable", SiLU="disable")
    assert body() == Policy("prefer", RMSNorm="disable")


def test_sync_recursive_and_nested_scope_in_body() -> None:
    @kernel_policy(RMSNorm="disable")
    def recurse(n: int) -> list[Policy]:
        seen = [current_policy()]
        if n:
            with kernel_policy(SiLU=MODES[n % 2 + 1]):
                seen += recurse(n - 1)
            seen.append(current_policy())
        return seen

    seen = recurse(3)
    assert seen[0] == Policy("prefer", RMSNorm="disable")
    assert seen[1] == Policy("prefer", RMSNorm="disable", SiLU="require")
    assert seen[2] == Policy("prefer", RMSNorm="disable", SiLU="disable")
    assert seen[3] == Policy("prefer", RMSNorm="disable", SiLU="require")
    assert len(seen) == 7
    assert seen[-1] == Policy("prefer", RMSNorm="disable")
    assert current_policy() == PREFER


def test_sync_method_decoration() -> None:
    class Model:
        @kernel_policy("disable")
        def run(self, x: int) -> tuple[Model, int, Policy]:
            return self, x, current_policy()

    model = Model()
    assert model.run(4) == (model, 4, DISABLED)


def test_sync_exception_propagates_unchanged() -> None:
    error = CustomError("sync")

    @kernel_policy("require")
    def fail() -> None:
        raise error

    with kernel_policy(SiLU="disable") as outer:
        with pytest.raises(CustomError) as info:
            fail()
        assert info.value is error
        assert current_policy() == outer
    assert current_policy() == PREFER


# --- coroutines ------------------------------------------------------------------------


def test_coroutine_policy_holds_across_awaits() -> None:
    @kernel_policy("disable", GELU="require")
    async def body(n: int) -> list[Policy]:
        seen = []
        for _ in range(n):
            seen.append(current_policy())
            await asyncio.sleep(0)
        with kernel_policy(RMSNorm="require"):
            await asyncio.sleep(0)
            seen.append(current_policy())
        seen.append(current_policy())
        return seen

    async def main() -> tuple[list[Policy], list[Policy], Policy]:
        other: list[Policy] = []

        async def observer() -> None:
            for _ in range(5):
                other.append(current_policy())
                await asyncio.sleep(0)

        seen, _ = await asyncio.gather(body(3), observer())
        return seen, other, current_policy()

    seen, other, after = asyncio.run(main())
    expected = Policy("disable", GELU="require")
    assert seen == [expected] * 3 + [Policy("disable", GELU="require", RMSNorm="require"), expected]
    assert other == [PREFER] * 5
    assert after == PREFER


def test_coroutine_return_value_and_exception() -> None:
    error = CustomError("coro")

    @kernel_policy("require")
    async def ok(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    @kernel_policy("require")
    async def fail() -> None:
        await asyncio.sleep(0)
        raise error

    async def main() -> None:
        assert await ok(21) == 42
        with kernel_policy(SiLU="disable") as outer:
            with pytest.raises(CustomError) as info:
                await fail()
            assert info.value is error
            assert current_policy() == outer

    asyncio.run(main())
    assert current_policy() == PREFER


def _cancel_once_started(runner: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``runner`` as a task, cancel it once it sets the event, check it re-raises and leaks nothing."""

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(runner(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert current_policy() == PREFER

    asyncio.run(main())


def test_cancelled_task_inside_decorated_coroutine_restores_policy() -> None:
    seen_inside: list[Policy] = []
    after_cancel: list[Policy] = []

    @kernel_policy("disable", RMSNorm="require")
    async def body(started: asyncio.Event) -> None:
        seen_inside.append(current_policy())
        started.set()
        await asyncio.Event().wait()

    async def runner(started: asyncio.Event) -> None:
        with kernel_policy(SiLU="require") as outer:
            try:
                await body(started)
            except asyncio.CancelledError:
                after_cancel.append(current_policy())
                assert current_policy() == outer
                raise

    _cancel_once_started(runner)
    assert seen_inside == [Policy("disable", RMSNorm="require")]
    assert after_cancel == [Policy("prefer", SiLU="require")]


# --- generators -------------------------------------------------------------------------


def test_generator_policy_holds_across_yields_and_consumer_never_sees_it() -> None:
    @kernel_policy("disable", GELU="require")
    def body() -> Iterator[Policy]:
        yield current_policy()
        with kernel_policy(SiLU="require"):
            yield current_policy()
            yield current_policy()
        yield current_policy()

    with kernel_policy(RMSNorm="require") as consumer:
        produced = []
        for value in body():
            assert current_policy() is consumer
            produced.append(value)
        assert current_policy() is consumer
    outer = Policy("disable", GELU="require")
    nested = Policy("disable", GELU="require", SiLU="require")
    assert produced == [outer, nested, nested, outer]
    assert current_policy() == PREFER


def test_generator_interleaved_with_consumer_scopes() -> None:
    @kernel_policy(RMSNorm="disable")
    def body() -> Iterator[Policy]:
        for _ in range(3):
            yield current_policy()

    gen = body()
    with kernel_policy("require"):
        first = next(gen)
        assert current_policy() == Policy("require")
    with kernel_policy("disable") as other:
        second = next(gen)
        assert current_policy() is other
    third = next(gen)
    assert first == second is third
    assert current_policy() == PREFER
    with pytest.raises(StopIteration):
        next(gen)


def test_two_decorated_generators_interleaved() -> None:
    @kernel_policy("disable")
    def a() -> Iterator[Policy]:
        with kernel_policy(SiLU="require"):
            for _ in range(3):
                yield current_policy()

    @kernel_policy("require")
    def b() -> Iterator[Policy]:
        for _ in range(3):
            yield current_policy()

    pairs = list(zip(a(), b(), strict=True))
    assert pairs == [(Policy("disable", SiLU="require"), Policy("require"))] * 3
    assert current_policy() == PREFER


def test_generator_send_and_return_value() -> None:
    @kernel_policy("disable")
    def accumulator() -> Generator[tuple[int, Policy], int, str]:
        total = 0
        while True:
            received = yield total, current_policy()
            if received < 0:
                return f"total={total}"
            total += received

    gen = accumulator()
    assert next(gen) == (0, DISABLED)
    assert gen.send(5) == (5, DISABLED)
    assert current_policy() == PREFER
    assert gen.send(7) == (12, DISABLED)
    with pytest.raises(StopIteration) as info:
        gen.send(-1)
    assert info.value.value == "total=12"
    assert current_policy() == PREFER


def test_generator_return_value_through_yield_from() -> None:
    @kernel_policy(SiLU="require")
    def inner() -> Generator[Policy, None, int]:
        yield current_policy()
        return 99

    def outer() -> Generator[Policy, None, None]:
        result = yield from inner()
        assert result == 99
        yield current_policy()

    with kernel_policy("disable"):
        values = list(outer())
    assert values == [Policy("disable", SiLU="require"), Policy("disable")]


def test_generator_returning_before_first_yield() -> None:
    @kernel_policy("disable")
    def empty() -> Generator[int, None, str]:
        return "done"
        yield 1  # pragma: no cover

    gen = empty()
    with pytest.raises(StopIteration) as info:
        next(gen)
    assert info.value.value == "done"
    assert current_policy() == PREFER


def test_generator_throw_handled_inside_body() -> None:
    @kernel_policy("require")
    def body() -> Generator[str, None, str]:
        with kernel_policy(RMSNorm="disable"):
            try:
                yield "first"
            except CustomError as exc:
                yield f"caught {exc} under {current_policy()}"
        return "end"

    gen = body()
    assert next(gen) == "first"
    assert gen.throw(CustomError("x")) == "caught x under require,RMSNorm=disable"
    with pytest.raises(StopIteration) as info:
        next(gen)
    assert info.value.value == "end"
    assert current_policy() == PREFER


def test_generator_throw_returning_passes_value() -> None:
    @kernel_policy("require")
    def body() -> Generator[int, None, str]:
        try:
            yield 1
        except CustomError:
            return "stopped"
        yield 2  # pragma: no cover

    gen = body()
    next(gen)
    with pytest.raises(StopIteration) as info:
        gen.throw(CustomError())
    assert info.value.value == "stopped"


def test_generator_throw_unhandled_propagates_same_object() -> None:
    @kernel_policy("disable")
    def body() -> Iterator[int]:
        yield 1
        yield 2  # pragma: no cover

    error = CustomError("unhandled")
    gen = body()
    next(gen)
    with kernel_policy(SiLU="require") as outer:
        with pytest.raises(CustomError) as info:
            gen.throw(error)
        assert info.value is error
        assert current_policy() == outer
    assert current_policy() == PREFER


def test_generator_exception_from_body_propagates_same_object() -> None:
    error = CustomError("body")

    @kernel_policy("disable")
    def body() -> Iterator[int]:
        with kernel_policy(SiLU="require"):
            yield 1
            raise error

    gen = body()
    assert next(gen) == 1
    with pytest.raises(CustomError) as info:
        next(gen)
    assert info.value is error
    assert current_policy() == PREFER


def test_generator_closed_early_runs_cleanup_under_policy_and_leaks_nothing() -> None:
    cleanup: list[Policy] = []

    @kernel_policy("disable")
    def body() -> Iterator[int]:
        try:
            with kernel_policy(GELU="require"):
                yield 1
                yield 2  # pragma: no cover
        finally:
            cleanup.append(current_policy())

    with kernel_policy("require") as consumer:
        gen = body()
        assert next(gen) == 1
        gen.close()
        assert current_policy() is consumer
        assert cleanup == [DISABLED]
        with pytest.raises(StopIteration):
            next(gen)
    assert current_policy() == PREFER


def test_generator_break_in_for_loop_and_garbage_collection() -> None:
    closed: list[Policy] = []

    @kernel_policy("disable")
    def body() -> Iterator[int]:
        try:
            with kernel_policy(SiLU="require"):
                yield from range(100)
        finally:
            closed.append(current_policy())

    for value in body():
        if value == 3:
            break
    gc.collect()
    assert closed == [DISABLED]
    assert current_policy() == PREFER


def test_unstarted_generator_close_is_harmless() -> None:
    started: list[bool] = []

    @kernel_policy("disable")
    def body() -> Iterator[int]:
        started.append(True)
        yield 1

    gen = body()
    gen.close()
    assert started == []
    assert current_policy() == PREFER


def test_generator_captures_enclosing_policy_at_first_iteration() -> None:
    # A decorated generator must stay a generator function (inspect truth), so its
    # body, and the context copy, start at the first next(), as any generator's do.
    @kernel_policy(RMSNorm="require")
    def body() -> Iterator[Policy]:
        yield current_policy()

    with kernel_policy("disable"):
        gen = body()
    assert next(gen) == Policy("prefer", RMSNorm="require")
    with kernel_policy("disable"):
        started_inside = body()
        first = next(started_inside)
    assert first == Policy("disable", RMSNorm="require")
    assert next(started_inside, None) is None


# --- async generators ---------------------------------------------------------------------


def test_async_generator_policy_across_yields_and_consumer_never_sees_it() -> None:
    @kernel_policy("disable", GELU="require")
    async def body() -> AsyncIterator[Policy]:
        yield current_policy()
        await asyncio.sleep(0.001)
        with kernel_policy(SiLU="require"):
            yield current_policy()
            await asyncio.sleep(0)
            yield current_policy()
        yield current_policy()

    async def main() -> list[Policy]:
        produced = []
        with kernel_policy(RMSNorm="require") as consumer:
            async for value in body():
                assert current_policy() is consumer
                await asyncio.sleep(0)
                produced.append(value)
            assert current_policy() is consumer
        return produced

    produced = asyncio.run(main())
    outer = Policy("disable", GELU="require")
    nested = Policy("disable", GELU="require", SiLU="require")
    assert produced == [outer, nested, nested, outer]
    assert current_policy() == PREFER


def test_async_generator_concurrent_with_other_tasks() -> None:
    @kernel_policy("require")
    async def body(n: int) -> AsyncIterator[Policy]:
        for _ in range(n):
            await asyncio.sleep(0)
            yield current_policy()

    async def consume(mode: str) -> list[tuple[Policy, Policy]]:
        out = []
        with kernel_policy(mode) as mine:  # type: ignore[arg-type]
            async for value in body(4):
                out.append((value, current_policy()))
                assert current_policy() is mine
        return out

    async def main() -> list[list[tuple[Policy, Policy]]]:
        return await asyncio.gather(*(consume(MODES[i % 2]) for i in range(20)))

    results = asyncio.run(main())
    for i, result in enumerate(results):
        assert result == [(Policy("require"), Policy(MODES[i % 2]))] * 4


def test_async_generator_asend_athrow_aclose() -> None:
    cleanup: list[Policy] = []

    @kernel_policy("disable", RMSNorm="require")
    async def body() -> AsyncIterator[tuple[object, Policy]]:
        received: object = None
        try:
            while True:
                try:
                    received = yield received, current_policy()
                except CustomError as exc:
                    received = f"caught {exc}"
                await asyncio.sleep(0)
        finally:
            await asyncio.sleep(0)
            cleanup.append(current_policy())

    expected = Policy("disable", RMSNorm="require")

    async def main() -> None:
        gen = body()
        assert await gen.__anext__() == (None, expected)
        assert await gen.asend("hello") == ("hello", expected)
        assert current_policy() == PREFER
        assert await gen.athrow(CustomError("boom")) == ("caught boom", expected)
        assert current_policy() == PREFER
        await gen.aclose()
        assert current_policy() == PREFER
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()

    asyncio.run(main())
    assert cleanup == [expected]


def test_async_generator_athrow_unhandled_and_finishing() -> None:
    error = CustomError("unhandled")

    @kernel_policy("disable")
    async def raising() -> AsyncIterator[int]:
        yield 1
        yield 2  # pragma: no cover

    @kernel_policy("disable")
    async def finishing() -> AsyncIterator[int]:
        try:
            yield 1
        except CustomError:
            return

    async def main() -> None:
        gen = raising()
        await gen.__anext__()
        with pytest.raises(CustomError) as info:
            await gen.athrow(error)
        assert info.value is error
        other = finishing()
        await other.__anext__()
        with pytest.raises(StopAsyncIteration):
            await other.athrow(CustomError())
        assert current_policy() == PREFER

    asyncio.run(main())


def test_async_generator_closed_early_leaves_no_leak() -> None:
    closed: list[Policy] = []

    @kernel_policy("require")
    async def body() -> AsyncIterator[int]:
        try:
            with kernel_policy(SiLU="disable"):
                for i in range(100):
                    yield i
        finally:
            closed.append(current_policy())

    async def main() -> None:
        with kernel_policy("disable") as mine:
            gen = body()
            async for value in gen:
                if value == 2:
                    break
            await gen.aclose()
            assert current_policy() is mine

    asyncio.run(main())
    assert closed == [Policy("require")]
    assert current_policy() == PREFER


def test_cancelled_task_inside_decorated_async_generator_restores_policy() -> None:
    cleanup: list[Policy] = []
    after_cancel: list[Policy] = []

    @kernel_policy("disable")
    async def body(started: asyncio.Event) -> AsyncIterator[int]:
        try:
            yield 1
            started.set()
            await asyncio.Event().wait()
            yield 2  # pragma: no cover
        finally:
            cleanup.append(current_policy())

    async def runner(started: asyncio.Event) -> None:
        with kernel_policy(SiLU="require") as outer:
            gen = body(started)
            try:
                async for _ in gen:
                    pass
            except asyncio.CancelledError:
                after_cancel.append(current_policy())
                assert current_policy() == outer
                raise

    _cancel_once_started(runner)
    assert cleanup == [DISABLED]
    assert after_cancel == [Policy("prefer", SiLU="require")]


def test_async_generator_captures_enclosing_policy_at_first_iteration() -> None:
    # As for generators: the context copy is taken at the first __anext__().
    @kernel_policy(RMSNorm="require")
    async def body() -> AsyncIterator[Policy]:
        yield current_policy()

    async def main() -> Policy:
        with kernel_policy("disable"):
            gen = body()
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    assert asyncio.run(main()) == Policy("prefer", RMSNorm="require")


# --- misc ----------------------------------------------------------------------------------


def test_kernels_disabled_and_policy_value_as_decorators() -> None:
    @kp.kernels_disabled("RMSNorm")
    def a() -> Policy:
        return current_policy()

    @kernel_policy(Policy("require", SiLU="prefer"))
    def b() -> Policy:
        return current_policy()

    with kernel_policy("require"):
        assert a() == Policy("require", RMSNorm="disable")
        assert b() == Policy("require", SiLU="prefer")
    with kernel_policy("disable"):
        assert b() == Policy("require", SiLU="prefer")


def test_decorating_partial_of_generator_function() -> None:
    def numbered(start: int) -> Iterator[tuple[int, Policy]]:
        yield start, current_policy()

    decorated = kernel_policy("disable")(functools.partial(numbered, 5))
    assert list(decorated()) == [(5, DISABLED)]
    assert current_policy() == PREFER

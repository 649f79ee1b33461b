"""Isolation of scopes between threads and asyncio tasks, exceptions, and propagate()."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy import Policy, current_policy, kernel_policy
from kernelpolicy._values._policy import MODES
from kernelpolicy.testing import DemoModel

# One scope object shared by every thread and task in this module.
SHARED_SCOPE = kernel_policy(RMSNorm="disable")

N_THREADS = 16
N_TASKS = 120
LAYERS = ("RMSNorm", "SiLU", "GELU")


def _outer_for(worker: int, step: int) -> Policy:
    """A distinct enclosing policy per worker and step (many more than any per-scope cache)."""
    mode = MODES[(worker + step) % 3]
    other = MODES[(worker + step + 1) % 3]
    return Policy(mode, **{f"W{worker}": other, f"S{step}": other})


def _expected_shared(enclosing: Policy) -> Policy:
    return Policy(enclosing.default, **dict(enclosing.layers), RMSNorm="disable")


# --- threads ----------------------------------------------------------------------------


def test_threads_see_only_their_own_nested_policies() -> None:
    barrier = threading.Barrier(N_THREADS)
    steps = 25
    checks = [0] * N_THREADS
    leaks = [0] * N_THREADS

    def worker(index: int) -> None:
        try:
            for step in range(steps):
                outer = _outer_for(index, step)
                barrier.wait(timeout=20)
                with kernel_policy(outer.default, **dict(outer.layers)) as got:
                    assert got == outer
                    barrier.wait(timeout=20)
                    assert current_policy() == outer
                    checks[index] += 1
                    inner_mode = MODES[(index * 7 + step) % 3]
                    with kernel_policy(SiLU=inner_mode) as inner:
                        expected = Policy(outer.default, **dict(outer.layers), SiLU=inner_mode)
                        assert inner == expected
                        barrier.wait(timeout=20)
                        assert current_policy() == expected
                        checks[index] += 1
                        with kernel_policy("disable", GELU="require"):
                            barrier.wait(timeout=20)
                            assert current_policy() == Policy("disable", GELU="require")
                            checks[index] += 1
                        assert current_policy() == expected
                    barrier.wait(timeout=20)
                    assert current_policy() == outer
                    checks[index] += 1
                if current_policy() != Policy("prefer"):
                    leaks[index] += 1
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=N_THREADS) as pool:
        futures = [pool.submit(worker, index) for index in range(N_THREADS)]
        for future in futures:
            future.result(timeout=60)
    assert checks == [steps * 4] * N_THREADS
    assert sum(leaks) == 0
    assert current_policy() == Policy("prefer")


def test_shared_scope_constant_entered_from_many_threads() -> None:
    barrier = threading.Barrier(N_THREADS)
    steps = 20
    leaks = [0] * N_THREADS
    checks = [0] * N_THREADS

    def worker(index: int) -> None:
        try:
            for step in range(steps):
                enclosing = _outer_for(index, step)
                with kernel_policy(enclosing):
                    barrier.wait(timeout=20)
                    with SHARED_SCOPE as entered:
                        expected = _expected_shared(enclosing)
                        assert entered == expected
                        barrier.wait(timeout=20)
                        assert current_policy() == expected
                        # Nest the shared scope in itself (through another scope, too).
                        with SHARED_SCOPE as again:
                            assert again == expected
                            with kernel_policy(SiLU="require"), SHARED_SCOPE as deeper:
                                assert deeper == Policy(expected.default, **dict(expected.layers), SiLU="require")
                            assert current_policy() == expected
                        assert current_policy() == expected
                        checks[index] += 1
                    barrier.wait(timeout=20)
                    assert current_policy() is enclosing
                if current_policy() != Policy("prefer"):
                    leaks[index] += 1
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=N_THREADS) as pool:
        futures = [pool.submit(worker, index) for index in range(N_THREADS)]
        for future in futures:
            future.result(timeout=60)
    assert checks == [steps] * N_THREADS
    assert sum(leaks) == 0
    assert current_policy() == Policy("prefer")


def test_shared_scope_constant_nested_in_itself_in_one_thread() -> None:
    with SHARED_SCOPE as a:
        assert a == Policy("prefer", RMSNorm="disable")
        with kernel_policy("require"), SHARED_SCOPE as b:
            assert b == Policy("require", RMSNorm="disable")
            with SHARED_SCOPE as c:
                assert c is b
            assert current_policy() is b
        assert current_policy() is a
    assert current_policy() == Policy("prefer")


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="threads inherit the context from Python 3.14")
def test_new_thread_starts_from_process_default_not_creator_scope() -> None:
    seen: list[Policy] = []

    def record() -> None:
        seen.append(current_policy())
        with kernel_policy(SiLU="require"):
            seen.append(current_policy())

    with kernel_policy("disable", RMSNorm="require"):
        thread = threading.Thread(target=record)
        thread.start()
        thread.join(timeout=10)
        assert current_policy() == Policy("disable", RMSNorm="require")
    assert seen == [Policy("prefer"), Policy("prefer", SiLU="require")]


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="threads inherit the context from Python 3.14")
def test_new_thread_sees_set_default_policy_not_creator_scope() -> None:
    seen: list[Policy] = []
    kp.set_default_policy("require", GELU="disable")
    try:
        with kernel_policy("prefer"):
            thread = threading.Thread(target=lambda: seen.append(current_policy()))
            thread.start()
            thread.join(timeout=10)
    finally:
        kp.set_default_policy()
    assert seen == [Policy("require", GELU="disable")]


# --- asyncio tasks ------------------------------------------------------------------------


def test_many_concurrent_tasks_with_interleaved_nested_scopes() -> None:
    leaks: list[int] = []
    checks: list[int] = []

    async def task(index: int) -> None:
        start = current_policy()
        count = 0
        for step in range(5):
            outer = _outer_for(index, step)
            with kernel_policy(outer.default, **dict(outer.layers)):
                await asyncio.sleep(0)
                assert current_policy() == outer
                count += 1
                mode = MODES[(index + 2 * step) % 3]
                with kernel_policy(SiLU=mode) as inner:
                    await asyncio.sleep(0)
                    assert inner == Policy(outer.default, **dict(outer.layers), SiLU=mode)
                    assert current_policy() == inner
                    count += 1
                    with SHARED_SCOPE as shared:
                        await asyncio.sleep(0)
                        assert shared == _expected_shared(inner)
                        assert current_policy() is shared
                        count += 1
                    await asyncio.sleep(0)
                    assert current_policy() == inner
                    count += 1
                await asyncio.sleep(0)
                assert current_policy() == outer
                count += 1
            await asyncio.sleep(0)
            assert current_policy() is start
        checks.append(count)
        if current_policy() is not start:
            leaks.append(index)

    async def main() -> None:
        with kernel_policy("disable", LayerNorm="require") as parent:
            await asyncio.gather(*(task(i) for i in range(N_TASKS)))
            assert current_policy() is parent
        assert current_policy() == Policy("prefer")

    asyncio.run(main())
    assert checks == [25] * N_TASKS
    assert leaks == []
    assert current_policy() == Policy("prefer")


def test_task_inherits_scope_at_creation_and_does_not_leak_back() -> None:
    seen: list[Policy] = []

    async def child() -> None:
        seen.append(current_policy())
        with kernel_policy(SiLU="require"):
            await asyncio.sleep(0)
            seen.append(current_policy())
        seen.append(current_policy())

    async def main() -> None:
        with kernel_policy("disable"):
            task = asyncio.create_task(child())
        # The parent left its scope before the child ran; the child keeps what it inherited.
        await task
        seen.append(current_policy())

    asyncio.run(main())
    assert seen == [
        Policy("disable"),
        Policy("disable", SiLU="require"),
        Policy("disable"),
        Policy("prefer"),
    ]


# --- exceptions through scopes ------------------------------------------------------------


class CustomError(Exception):
    pass


class CustomBaseError(BaseException):
    pass


def _raise_through_scopes(error: BaseException) -> None:
    with kernel_policy(SiLU="require"), kernel_policy("disable"), SHARED_SCOPE:
        raise error


@pytest.mark.parametrize("error", [CustomError("boom"), CustomBaseError("base"), KeyError("k"), StopIteration(3)])
def test_exception_propagates_unchanged_and_policy_restored(error: BaseException) -> None:
    with kernel_policy("require", RMSNorm="prefer") as outer:
        with pytest.raises(type(error)) as info:
            _raise_through_scopes(error)
        assert info.value is error
        assert current_policy() == outer
    assert current_policy() == Policy("prefer")


def test_exception_keeps_its_cause_and_traceback() -> None:
    cause = ValueError("cause")

    def body() -> None:
        with kernel_policy("disable"):
            raise CustomError("effect") from cause

    with pytest.raises(CustomError) as info:
        body()
    assert info.value.__cause__ is cause
    assert any(entry.name == "body" for entry in info.traceback)
    assert current_policy() == Policy("prefer")


def test_exceptions_in_threads_restore_each_thread() -> None:
    barrier = threading.Barrier(N_THREADS)
    results: list[bool] = [False] * N_THREADS

    def worker(index: int) -> None:
        try:
            with kernel_policy(MODES[index % 3]) as outer:
                barrier.wait(timeout=20)
                error = CustomError(index)
                caught: list[BaseException] = []
                try:
                    with kernel_policy(RMSNorm="require"), SHARED_SCOPE:
                        barrier.wait(timeout=20)
                        raise error
                except CustomError as exc:
                    caught.append(exc)
                assert caught == [error]
                assert caught[0] is error
                assert current_policy() == outer
            results[index] = current_policy() == Policy("prefer")
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=N_THREADS) as pool:
        for future in [pool.submit(worker, i) for i in range(N_THREADS)]:
            future.result(timeout=60)
    assert all(results)


# --- propagate ------------------------------------------------------------------------------


def test_propagate_in_thread_pool_and_worker_unaffected_afterwards() -> None:
    def read() -> Policy:
        return current_policy()

    with ThreadPoolExecutor(max_workers=1) as pool:
        with kernel_policy("disable", SiLU="require") as captured:
            wrapped = kp.propagate(read)
            assert pool.submit(wrapped).result(timeout=10) is captured
            # Without propagate the worker does not see the caller's scope.
            assert pool.submit(read).result(timeout=10) == Policy("prefer")
        # The policy is the one at wrap time, even after the caller left its scope.
        assert pool.submit(wrapped).result(timeout=10) is captured
        assert pool.submit(read).result(timeout=10) == Policy("prefer")
    assert current_policy() == Policy("prefer")


def test_propagate_keeps_metadata_and_arguments() -> None:
    def add(a: int, b: int = 0) -> tuple[int, Policy]:
        """Add two numbers."""
        return a + b, current_policy()

    with kernel_policy(RMSNorm="disable") as captured:
        wrapped = kp.propagate(add)
    assert wrapped.__name__ == "add"
    assert wrapped.__doc__ == "Add two numbers."
    assert wrapped.__wrapped__ is add  # type: ignore[attr-defined]
    assert wrapped(2, b=3) == (5, captured)
    assert current_policy() == Policy("prefer")


def test_propagate_in_run_in_executor() -> None:
    def read() -> Policy:
        return current_policy()

    async def main() -> tuple[Policy, Policy, Policy, Policy]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1) as pool:
            with kernel_policy("require", GELU="disable") as captured:
                propagated = await loop.run_in_executor(pool, kp.propagate(read))
                plain = await loop.run_in_executor(pool, read)
            after = await loop.run_in_executor(pool, read)
        return captured, propagated, plain, after

    captured, propagated, plain, after = asyncio.run(main())
    assert captured == Policy("require", GELU="disable")
    assert propagated is captured
    assert plain == Policy("prefer")
    assert after == Policy("prefer")


def test_propagate_outside_any_scope_captures_the_current_default() -> None:
    def read() -> Policy:
        return current_policy()

    wrapped = kp.propagate(read)
    kp.set_default_policy("disable")
    try:
        assert current_policy() == Policy("disable")
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(wrapped).result(timeout=10) == Policy("prefer")
            assert pool.submit(read).result(timeout=10) == Policy("disable")
    finally:
        kp.set_default_policy()


def test_propagate_exception_restores_worker() -> None:
    error = CustomError("in worker")

    def fail() -> None:
        raise error

    def read() -> Policy:
        return current_policy()

    with ThreadPoolExecutor(max_workers=1) as pool:
        with kp.kernels_disabled():
            wrapped = kp.propagate(fail)
        future = pool.submit(wrapped)
        with pytest.raises(CustomError) as info:
            future.result(timeout=10)
        assert info.value is error
        assert pool.submit(read).result(timeout=10) == Policy("prefer")


def test_tables_of_policies_no_longer_in_use_are_released() -> None:
    """5,000 distinct policies entered once each (a server's header policies): the tables made for them go when
    their scopes do; nothing is kept per policy value for the life of the process (was 4.4 MB here)."""
    model = DemoModel(8).eval()
    x = torch.ones(1, 8)

    def enter(count: int, start: int) -> None:
        for i in range(start, start + count):
            with kp.kernel_policy(kp.Policy.parse(f"prefer,RMSNorm=disable,Layer{i}=disable")):
                model(x)

    enter(500, 0)  # what the first calls allocate once
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        enter(5000, 10_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, f"{grown / 1e6:.2f} MB kept after 5,000 policies"

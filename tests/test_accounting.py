"""Call accounting with record_calls(): per layer, path and reason; threads, tasks, compile."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._context._active import DEFAULTS
from kernelpolicy.testing import DemoModel

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(8))


def test_counts_by_layer_module_path_and_reason(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    with kp.record_calls() as calls:
        model(X)
        with kp.kernels_disabled():
            model(X)
        with kp.kernel_policy(RMSNorm="disable"):
            model(X)
    assert calls.by_layer() == {"RMSNorm": {"kernel": 3, "original": 6}}
    assert calls.by_module()["norm"] == {"kernel": 1, "original": 2}
    assert calls.total() == 9
    assert calls.total(path="original") == 6
    reasons = {(module, path, reason): n for (module, _, path, reason, _), n in calls.items()}
    assert reasons[("blocks.0.1", "original", "disabled by policy")] == 2
    assert reasons[("blocks.0.1", "kernel", "kernel usable")] == 1
    text = str(calls)
    assert text.splitlines()[0].split() == ["module", "layer", "path", "reason", "calls"]
    assert "disabled by policy" in text


def test_errors_are_counted_before_they_raise() -> None:
    model = kp.attach(DemoModel(16))
    with kp.record_calls() as calls, kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError):
        model(X)
    assert calls.by_layer() == {"RMSNorm": {"error": 1}}


def test_a_call_require_refuses_is_recorded_with_the_class_of_its_error() -> None:
    """Issue 47, item 2 (was: recorded with an empty ``raised``, so ``total(raised=True)`` was 0 and the table
    had no ``raised`` column, while a kernel's own error kept its class)."""
    model = kp.attach(DemoModel(16))
    with kp.record_calls() as calls, kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError):
        model(X)
    assert calls.items() == [(("blocks.0.1", "RMSNorm", "error", "no kernel bound", "KernelUnavailableError"), 1)]
    assert calls.total(raised=True) == calls.total(path="error") == 1
    header, row = str(calls).splitlines()[0].split(), str(calls).splitlines()[-1]
    assert header == ["module", "layer", "path", "reason", "raised", "calls"]
    assert "KernelUnavailableError" in row


def test_nothing_is_recorded_outside_the_block(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    with kp.record_calls() as calls:
        model(X)
    model(X)
    assert calls.total() == 3
    assert not DEFAULTS.active._current.recording


def test_policy_inside_recording_is_the_logical_policy(kernelized: Callable[..., DemoModel]) -> None:
    with kp.record_calls():
        assert kp.current_policy() == kp.Policy("prefer")
        with kp.kernel_policy("disable") as entered:
            assert entered == kp.Policy("disable")
            assert kp.current_policy() == kp.Policy("disable")
            assert DEFAULTS.active._current.recording
    assert kp.current_policy() == kp.Policy("prefer")


def test_nested_blocks_each_count_what_runs_inside(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    with kp.record_calls() as outer:
        model(X)
        with kp.record_calls() as inner:
            model(X)
    assert outer.total() == 6
    assert inner.total() == 3


def test_threads_record_separately_and_propagate_carries_the_recorder(
    kernelized: Callable[..., DemoModel],
) -> None:
    model = kernelized("exact")
    totals: list[int] = []
    barrier = threading.Barrier(4)

    def worker(repeat: int) -> None:
        with kp.record_calls() as calls:
            barrier.wait(timeout=30)
            for _ in range(repeat):
                model(X)
        totals.append(calls.total())

    threads = [threading.Thread(target=worker, args=(n,)) for n in (1, 2, 3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(totals) == [3, 6, 9, 12]

    with kp.record_calls() as calls, kp.kernels_disabled(), ThreadPoolExecutor(2) as pool:
        propagated = kp.propagate(lambda: model(X))
        for future in [pool.submit(propagated) for _ in range(4)]:
            future.result()
        pool.submit(lambda: model(X)).result()  # not propagated: not counted
    assert calls.by_layer() == {"RMSNorm": {"original": 12}}


def test_asyncio_tasks_record_separately(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")

    async def task(repeat: int) -> int:
        with kp.record_calls() as calls:
            for _ in range(repeat):
                await asyncio.sleep(0)
                model(X)
        return calls.total()

    async def main() -> list[int]:
        return await asyncio.gather(*(task(n % 4 + 1) for n in range(20)))

    assert asyncio.run(main()) == [3 * (n % 4 + 1) for n in range(20)]


def test_explain_shows_recorded_calls(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    with kp.record_calls() as calls:
        model(X)
        model(X)
    table = kp.explain(model, calls=calls)
    assert [row.calls for row in table] == [{"kernel": 2}] * 3
    assert "recorded calls" in str(table) and "kernel 2" in str(table)


def test_compiled_calls_follow_policy_but_are_not_counted(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("traceable")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    expected = model(X)
    with kp.record_calls() as calls:
        torch.testing.assert_close(compiled(X), expected)
    assert calls.total() == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("tracer", ["jit", "fx"])
def test_traced_calls_are_counted_by_every_tracer(kernelized: Callable[..., DemoModel], tracer: str) -> None:
    model = kernelized("untraceable")
    with kp.record_calls() as calls:
        if tracer == "jit":
            torch.jit.trace(model, (X,), check_trace=False)  # type: ignore[no-untyped-call]
        else:
            torch.fx.symbolic_trace(model)
    reason = f"kernel cannot be traced under {tracer} (it does not declare can_torch_compile = True)"
    assert calls.by_layer() == {"RMSNorm": {"original": 3}}
    assert {key[3] for key, _ in calls.items()} == {reason}


def test_a_decorated_generator_counts_in_the_block_active_at_each_step(
    kernelized: Callable[..., DemoModel],
) -> None:
    """Issue 33, finding 6 (was: the recorders of the generator's first step, for good)."""
    model = kernelized("traceable")
    x = torch.ones(2, 16)

    @kp.kernels_disabled
    def steps() -> Iterator[str]:
        while True:
            model(x)  # 3 RMSNorm calls a step, under the generator's own policy
            yield kp.current_policy().default

    late = steps()
    assert next(late) == "disable"  # first step outside any block
    with kp.record_calls() as calls:
        assert next(late) == "disable"
    assert calls.by_layer() == {"RMSNorm": {"original": 3}}
    early = steps()
    with kp.record_calls() as calls:
        next(early)
    next(early)  # after the block: not counted there
    assert calls.total() == 3
    with kp.record_calls() as outer:
        with kp.record_calls() as inner:
            next(early)
        next(early)
    assert inner.total() == 3 and outer.total() == 6


def test_a_decorated_async_generator_counts_in_the_block_active_at_each_step(
    kernelized: Callable[..., DemoModel],
) -> None:
    model = kernelized("traceable")
    x = torch.ones(2, 16)

    @kp.kernels_disabled
    async def steps() -> AsyncIterator[str]:
        while True:
            model(x)
            yield kp.current_policy().default

    async def main() -> tuple[int, int]:
        late = steps()
        assert await anext(late) == "disable"
        with kp.record_calls() as calls:
            assert await anext(late) == "disable"
        await anext(late)
        early = steps()
        with kp.record_calls() as first:
            await anext(early)
        await anext(early)
        return calls.total(), first.total()

    assert asyncio.run(main()) == (3, 3)

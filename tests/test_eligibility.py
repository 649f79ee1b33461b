"""Per-call eligibility: ``kernel_accepts`` rules on real local kernel repositories, eager and compiled.

The kernel adds 100 to its output, so every output shows which path it took. The model sums two RMSNorm layers
(Llama's) applied to its input; they take any floating dtype with float32 weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _helpers import CountingBackend, NormPair, graph_breaks, kernel_ran
from torch import nn
from torch._dynamo.utils import counters

import kernelpolicy as kp

F32 = torch.ones(2, 16)
BF16 = torch.ones(2, 16, dtype=torch.bfloat16)
REFUSED_F32 = (
    "kernel does not accept this call: argument 0 (hidden_states) has dtype torch.float32; "
    "the kernel accepts torch.bfloat16"
)


@pytest.fixture(autouse=True)
def _no_rule() -> Iterator[None]:
    yield
    kp.kernel_accepts("RMSNorm")


@pytest.fixture
def norms(mapping: Callable[[str], Any]) -> nn.Module:
    model = NormPair().eval()
    with mapping("traceable"):
        kp.kernelize(model, mode="inference", device="cpu")
    return model


def test_prefer_runs_the_kernel_only_for_calls_its_rule_accepts(
    norms: nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    from kernelpolicy._forward._failures import _logged

    _logged.discard(("RMSNorm", REFUSED_F32))
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    with caplog.at_level(logging.INFO, logger="kernelpolicy"), kp.record_calls() as calls:
        assert not kernel_ran(norms(F32))
        assert kernel_ran(norms(BF16).float())
    assert calls.by_layer() == {"RMSNorm": {"original": 2, "kernel": 2}}
    assert {key[3] for key, _ in calls.items()} == {REFUSED_F32, "kernel usable"}
    # INFO: the rule declined calls as it was declared to (a warning is for a kernel that cannot run at all)
    assert [r.levelno for r in caplog.records if REFUSED_F32 in r.getMessage()] == [logging.INFO]


def test_a_line_the_logger_level_hides_is_not_counted_as_said(
    norms: nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 47 (was: the INFO line of a declined call counted as said while the level hid it, so turning INFO
    on afterwards never showed it)."""
    from kernelpolicy._forward._failures import _logged

    _logged.discard(("RMSNorm", REFUSED_F32))
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    with caplog.at_level(logging.WARNING, logger="kernelpolicy"):  # a default set-up: INFO hidden
        assert not kernel_ran(norms(F32))
    assert not [r for r in caplog.records if REFUSED_F32 in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="kernelpolicy"):  # INFO turned on: said now, once
        for _ in range(3):
            assert not kernel_ran(norms(F32))
    assert [r.levelno for r in caplog.records if REFUSED_F32 in r.getMessage()] == [logging.INFO]


def test_require_names_the_argument_and_the_rule(norms: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16, torch.float16])
    with kp.kernel_policy("require"):
        assert kernel_ran(norms(BF16).float())
        with pytest.raises(kp.KernelUnavailableError) as raised:
            norms(F32)
    assert str(raised.value) == (
        "kernel required but unavailable for module 'a' (kernelpolicy.testing.RMSNorm, kernel layer 'RMSNorm'): "
        "kernel does not accept this call: argument 0 (hidden_states) has dtype torch.float32; "
        "the kernel accepts torch.bfloat16, torch.float16"
    )


def test_devices_and_a_check_on_the_call(norms: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", devices=["cuda"])
    with (
        kp.kernel_policy("require"),
        pytest.raises(kp.KernelUnavailableError, match="is on cpu; the kernel accepts cuda"),
    ):
        norms(F32)

    def multiple_of_32(module: nn.Module, hidden_states: torch.Tensor) -> bool | str:
        size = hidden_states.shape[-1]
        return size % 32 == 0 or f"hidden size {size} is not a multiple of 32"

    kp.kernel_accepts("RMSNorm", check=multiple_of_32)
    with kp.record_calls() as calls:
        assert not kernel_ran(norms(F32))
    [reason] = {key[3] for key, _ in calls.items()}  # one per norm: module 'a' and 'b'
    assert reason.endswith(
        "check test_devices_and_a_check_on_the_call.<locals>.multiple_of_32: hidden size 16 is not a multiple of 32"
    )
    kp.kernel_accepts("RMSNorm", check=lambda module, hidden_states: hidden_states.shape[-1] == 16)
    assert kernel_ran(norms(F32))


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes: Python >= 3.11")
def test_an_error_in_a_check_comes_out_unchanged_and_marked_as_the_checks(norms: nn.Module) -> None:
    """Decided (issue 31): the error passes as it is (its type is the check's business), with a note naming it."""

    def broken(module: nn.Module, hidden_states: torch.Tensor) -> bool:
        raise KeyError("no such shape")

    kp.kernel_accepts("RMSNorm", check=broken)
    with pytest.raises(KeyError, match="no such shape") as raised:
        norms(F32)
    assert raised.value.__notes__ == [
        "kernelpolicy: raised by the kernel_accepts check of kernel layer 'RMSNorm' "
        "(kernelpolicy.testing.RMSNorm at 'a'), asked before its kernel runs"
    ]


def test_a_rule_reaches_modules_bound_before_and_goes_away(norms: nn.Module) -> None:
    assert norms.a.forward.__qualname__ == "kernelpolicy.always_usable.forward"
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    assert norms.a.forward.__qualname__ == "kernelpolicy.ruled.forward"
    assert not kernel_ran(norms(F32))
    kp.kernel_accepts("RMSNorm")  # no criteria: every call again, on the fast forward
    assert norms.a.forward.__qualname__ == "kernelpolicy.always_usable.forward"
    assert kernel_ran(norms(F32))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_one_program_per_outcome_without_graph_breaks(norms: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    backend = CountingBackend()
    compiled = torch.compile(norms, backend=backend, fullgraph=True)
    counters.clear()
    with kp.kernel_policy("prefer"):  # in a scope: unscoped calls would add a program of the default's
        for _ in range(2):
            assert not kernel_ran(compiled(F32))
            assert kernel_ran(compiled(BF16).float())
    assert backend.compiles == 2 and graph_breaks() == 0
    for mode in ("require", "verify"):  # where the kernel runs, the same program: `required` is read on refusal only
        with kp.kernel_policy(mode):
            assert kernel_ran(compiled(BF16).float())
    assert backend.compiles == 2 and graph_breaks() == 0
    with (
        kp.kernel_policy("require"),
        pytest.raises(Exception, match=r"argument 0 \(hidden_states\) has dtype torch.float32"),
    ):
        compiled(F32)  # fullgraph=True: the refusal is the compile error


def test_threads_each_get_their_calls_path(norms: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    failures: list[str] = []
    start = threading.Barrier(2)

    def run(x: torch.Tensor, kernel: bool) -> None:
        start.wait()
        for _ in range(200):
            if kernel_ran(norms(x).float()) is not kernel:
                failures.append(str(x.dtype))

    threads = [threading.Thread(target=run, args=(F32, False)), threading.Thread(target=run, args=(BF16, True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_asyncio_tasks_each_get_their_calls_path(norms: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    wrong: list[str] = []

    async def task(x: torch.Tensor, kernel: bool, mode: str) -> None:
        with kp.kernel_policy(mode):
            for _ in range(20):
                await asyncio.sleep(0)  # interleave with the other tasks
                try:
                    if kernel_ran(norms(x).float()) is not kernel:
                        wrong.append(f"{mode} {x.dtype}")
                except kp.KernelUnavailableError:
                    if mode != "require" or kernel:
                        wrong.append(f"{mode} {x.dtype} raised")

    async def main() -> None:
        await asyncio.gather(task(F32, False, "prefer"), task(BF16, True, "require"), task(F32, False, "require"))

    asyncio.run(main())
    assert wrong == []


def test_explain_shows_the_rule_and_what_example_inputs_get(norms: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16])
    assert kp.explain(norms).rows[0].reason == "kernel usable for calls its rule accepts (dtypes torch.bfloat16)"
    rows = kp.explain(norms, F32).rows
    assert [(row.path, row.reason) for row in rows] == [("original", REFUSED_F32)] * 2
    assert [(row.path, row.reason) for row in kp.explain(norms, BF16).rows] == [("kernel", "kernel usable")] * 2
    with kp.kernel_policy("require"):
        rows = kp.explain(norms, F32).rows  # the first norm raises: the second is not reached
    assert [(row.path, row.reason) for row in rows] == [
        ("error", REFUSED_F32),
        ("kernel", "not called by these inputs"),
    ]


def test_bad_rules_name_the_value() -> None:
    with pytest.raises(TypeError, match=r"takes floating-point torch dtypes .*; got torch.int64"):
        kp.kernel_accepts("RMSNorm", dtypes=[torch.int64])
    with pytest.raises(ValueError, match=r"device types such as 'cuda', 'cpu', 'mps', 'xpu'; got 'gpu'"):
        kp.kernel_accepts("RMSNorm", devices=["gpu"])
    with pytest.raises(TypeError, match=r"takes a function of \(module, \*args, \*\*kwargs\); got 3"):
        kp.kernel_accepts("RMSNorm", check=3)  # type: ignore[arg-type]
    with pytest.raises(kp.PolicyError):
        kp.kernel_accepts("not a name")

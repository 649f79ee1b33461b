"""Processes: errors that pickle, forked children that never inherit a held lock, KERNELPOLICY on every path."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import kernelpolicy as kp


def test_errors_pickle_with_their_attributes() -> None:
    unavailable = kp.KernelUnavailableError(path="norm", layer_name="RMSNorm", module_class="m.N", reason="no kernel")
    mismatch = kp.KernelMismatchError(
        path="norm",
        layer_name="RMSNorm",
        module_class="m.N",
        where="output",
        detail="values differ",
        max_abs=0.5,
        max_rel=0.25,
        index=(0, 1),
    )
    for error in (unavailable, mismatch):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert vars(copy) == vars(error)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_children_create_policies_while_a_thread_holds_the_intern_lock() -> None:
    """Each child forks while another thread of the parent is creating policies (the intern lock often held)."""
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            kp.Policy("disable", **{f"Churn{n % 5000}": "require"})
            n += 1

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    children = []
    try:
        for i in range(40):
            pid = os.fork()
            if pid == 0:  # child: a new policy needs the intern lock
                code = 1
                try:
                    kp.Policy("require", **{f"Child{i}": "disable"})
                    kp.set_default_policy("disable")  # and the defaults lock
                    code = 0
                finally:
                    os._exit(code)
            children.append(pid)
    finally:
        stop.set()
        worker.join(10)
    deadline = time.monotonic() + 60
    hung = []
    for pid in children:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung.append(pid)
                break
            time.sleep(0.01)
    assert not hung, f"{len(hung)} of {len(children)} forked children hung"


def test_kernelpolicy_variable_holds_on_the_class_decorator_path() -> None:
    code = textwrap.dedent(
        """
        import types, torch, kernelpolicy

        @kernelpolicy.use_kernel_forward_from_hub("EnvLayer")
        class EnvLayer(torch.nn.Module):
            def forward(self, x):
                return x + 1

        class Kernel(torch.nn.Module):
            def forward(self, x):
                return x + 100

        layer = EnvLayer()
        layer.forward = types.MethodType(Kernel.forward, layer)  # as kernels binds
        print(layer(torch.zeros(1)).item())
        """
    )
    env = {**os.environ, "KERNELPOLICY": "disable"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0"]
    env["KERNELPOLICY"] = "EnvLayer=fast"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "KERNELPOLICY='EnvLayer=fast': unknown kernel policy mode 'fast'" in done.stderr


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_propagate_carries_the_policy_into_a_process_pool(method: str) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from _workers import policy_text

    context = multiprocessing.get_context(method)
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        # Started outside any scope: a worker forked inside one would hold that scope (fork copies the
        # forking thread's context), as any ContextVar does.
        assert pool.submit(policy_text).result(timeout=120) == "prefer"
        with kp.kernel_policy("disable", RMSNorm="require"):
            carried = pool.submit(kp.propagate(policy_text))
            plain = pool.submit(policy_text)
        assert carried.result(timeout=120) == "disable,RMSNorm=require"
        assert plain.result(timeout=120) == "prefer"


def test_propagated_function_keeps_its_name_and_pickles_by_value() -> None:
    from _workers import policy_text

    with kp.kernels_disabled():
        wrapped = kp.propagate(policy_text)
    assert wrapped.__name__ == "policy_text" and wrapped.__wrapped__ is policy_text  # type: ignore[attr-defined]
    assert wrapped() == "disable"
    assert pickle.loads(pickle.dumps(wrapped))() == "disable"

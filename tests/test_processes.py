"""Processes: errors that pickle, forked children that never inherit a held lock, KERNELPOLICY on every path,
process pools under every start method, DataLoader workers (fork and spawn), launched children."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

import kernelpolicy as kp
import kernelpolicy.processes


def test_errors_pickle_with_their_attributes() -> None:
    unavailable = kp.KernelUnavailableError(
        module_name="norm", layer_name="RMSNorm", module_class="m.N", reason="no kernel"
    )
    mismatch = kp.KernelMismatchError(
        module_name="norm",
        layer_name="RMSNorm",
        module_class="m.N",
        where="output",
        detail="values differ",
        max_abs=0.5,
        max_rel=0.25,
        index=(0, 1),
    )
    original = kp.errors.OriginalUnavailableError(
        module_name="mlp.up", layer_name="FusedUp", module_class="m.L", reason="fused"
    )
    for error in (unavailable, mismatch, original):
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


def _loader_items(method: str, **options: Any) -> list[str]:
    from torch.utils.data import DataLoader

    dataset = options.pop("dataset", None)
    if dataset is None:
        from _workers import PolicyReport

        dataset = PolicyReport()
    loader = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context=method, timeout=120, **options)
    return list(loader)


def test_forked_dataloader_workers_inherit_the_scope_where_iteration_starts() -> None:
    assert _loader_items("fork") == ["prefer", "prefer"]
    with kp.kernel_policy("disable", RMSNorm="require"):
        assert _loader_items("fork") == ["disable,RMSNorm=require"] * 2


@pytest.mark.slow
def test_spawned_dataloader_workers_see_only_the_environment_unless_given_worker_init_fn() -> None:
    with kp.kernel_policy("disable", RMSNorm="require"):
        assert _loader_items("spawn") == ["prefer", "prefer"]  # the scope does not reach a spawned worker
        init = kernelpolicy.processes.worker_init_fn()
    assert _loader_items("spawn", worker_init_fn=init) == ["disable,RMSNorm=require"] * 2


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_worker_init_fn_calls_the_users_initializer_after_setting_the_policy(method: str) -> None:
    from _workers import InitReport, note_worker_id

    with kp.kernels_disabled():
        init = kernelpolicy.processes.worker_init_fn(note_worker_id)
    assert _loader_items(method, worker_init_fn=init, dataset=InitReport()) == ["0 disable", "0 disable"]


def test_persistent_forked_workers_keep_the_policy_of_their_first_iteration() -> None:
    from _workers import PolicyReport
    from torch.utils.data import DataLoader

    loader = DataLoader(
        PolicyReport(),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        persistent_workers=True,
        timeout=120,
    )
    with kp.kernels_disabled():
        assert list(loader) == ["disable", "disable"]
    assert list(loader) == ["disable", "disable"]  # the same worker process, forked inside the scope
    with kp.kernel_policy("require"):
        assert list(loader) == ["disable", "disable"]


def test_worker_init_fn_is_the_initializer_of_a_spawned_process_pool() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from _workers import policy_text

    with kp.kernel_policy(RMSNorm="disable"):
        init = kernelpolicy.processes.worker_init_fn()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=init) as pool:
        assert pool.submit(policy_text).result(timeout=120) == "prefer,RMSNorm=disable"


def test_child_env_sets_the_policy_of_a_launched_process() -> None:
    with kp.kernel_policy("verify", atol=0.5, RMSNorm="disable"):
        env = kernelpolicy.processes.child_env()
    code = "import kernelpolicy; print(kernelpolicy.current_policy())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert kp.Policy.parse(done.stdout.strip()) == kp.Policy("verify", atol=0.5, RMSNorm="disable")


def test_a_pickled_module_says_its_kernel_was_dropped(tmp_path: Any) -> None:
    import torch

    from kernelpolicy.testing import DemoModel, kernelize_locally, rms_norm_kernel_source, write_kernel_repo

    repo = write_kernel_repo(tmp_path / "repo", rms_norm_kernel_source(can_torch_compile=True, offset=100.0))
    model = kernelize_locally(DemoModel(16).eval(), {"RMSNorm": repo})
    loaded = pickle.loads(pickle.dumps(model))  # what a spawned DataLoader worker or process pool receives
    x = torch.randn(2, 16)
    with kp.kernels_disabled():
        torch.testing.assert_close(loaded(x), model(x))  # under prefer: the original, silently but for explain
    dropped = f"no kernel bound: {repo}:RMSNorm was dropped when the module was pickled (kernelize after loading)"
    assert {(row.path, row.reason) for row in kp.explain(loaded)} == {("original", dropped)}
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match="was dropped when the module"):
        loaded(x)
    kernelize_locally(loaded, {"RMSNorm": repo})
    assert {(row.path, row.reason) for row in kp.explain(loaded)} == {("kernel", "kernel usable")}


def test_worker_init_fn_wins_over_the_scope_a_forked_dataloader_worker_inherits() -> None:
    """The policy captured where worker_init_fn() was called holds in fork workers started inside another scope."""
    with kp.kernel_policy("prefer", RMSNorm="require"):
        init = kernelpolicy.processes.worker_init_fn()
    with kp.kernels_disabled():  # the workers fork here: their context holds this scope
        assert _loader_items("fork", worker_init_fn=init) == ["prefer,RMSNorm=require"] * 2
    with kp.kernels_disabled():
        assert kp.current_policy() == kp.Policy("disable")  # the parent's scope is untouched


def test_worker_init_fn_holds_in_fork_pools_first_used_inside_a_scope() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from _workers import policy_text

    context = multiprocessing.get_context("fork")
    init = kernelpolicy.processes.worker_init_fn()  # the process default: prefer
    with ProcessPoolExecutor(1, mp_context=context, initializer=init) as pool, kp.kernels_disabled():
        assert pool.submit(policy_text).result(timeout=120) == "prefer"  # the worker forks here, in the scope
        assert pool.submit(kp.propagate(policy_text)).result(timeout=120) == "disable"  # a task's own scope wins
    # multiprocessing.Pool replaces a worker after each task (from its own thread, outside the scope): every
    # worker, the first forked in the scope and its replacements, sees the initializer's policy.
    with kp.kernel_policy(RMSNorm="disable"):
        init = kernelpolicy.processes.worker_init_fn()
    with kp.kernel_policy("require"), context.Pool(1, initializer=init, maxtasksperchild=1) as pool:
        seen = [pool.apply_async(policy_text).get(timeout=120) for _ in range(3)]
    assert seen == ["prefer,RMSNorm=disable"] * 3


def test_a_carried_variant_policy_is_checked_where_its_variants_are_bound() -> None:
    """In a worker the variants a carried policy names are bound later, by its task: neither carrier refuses them."""
    from _workers import policy_text

    from kernelpolicy._context._propagate import _propagated

    carried = kp.Policy.parse("prefer,CarriedNorm=kernel:elsewhere")  # bound in the process it came from only
    assert _propagated(policy_text, carried)() == str(carried)  # what a pool worker rebuilds
    init = kernelpolicy.processes.worker_init_fn()
    init.policy = carried
    previous = kp.current_policy()
    try:
        init()  # what a worker runs first
        assert kp.current_policy() == carried
    finally:
        kp.set_default_policy(previous)
    with pytest.raises(kp.PolicyError, match="no kernel variant 'elsewhere'"):  # here, in a scope, it is checked
        kp.kernel_policy(carried).__enter__()


@pytest.mark.slow
@pytest.mark.parametrize("carrier", ["propagate", "worker_init_fn"])
def test_variant_policies_reach_spawned_workers(carrier: str, tmp_path: Any) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from _workers import variant_offset

    from kernelpolicy.testing import (
        RMSNorm,
        kernelize_locally,
        local_mapping,
        rms_norm_kernel_source,
        write_kernel_repo,
    )

    repos = [
        str(write_kernel_repo(tmp_path / name, rms_norm_kernel_source(offset=value), name=f"norm-{name}"))
        for name, value in (("default", 100.0), ("fast", 200.0))
    ]
    norm = kernelize_locally(RMSNorm(16).eval(), {"RMSNorm": repos[0]})
    with local_mapping({"RMSNorm": repos[1]}, inherit=False):
        kp.kernelize(norm, mode="inference", device="cpu", variant="fast")  # the scope below checks it is bound
    with kp.kernel_policy(RMSNorm="kernel:fast"):
        task = kp.propagate(variant_offset) if carrier == "propagate" else variant_offset
        init = kernelpolicy.processes.worker_init_fn() if carrier == "worker_init_fn" else None
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=init) as pool:
        assert pool.submit(task, *repos).result(timeout=300) == "200 prefer,RMSNorm=kernel:fast"

"""Functions for worker processes: importable by name in a spawned child, and without torch (cheap to start)."""

from __future__ import annotations

from typing import NoReturn

import kernelpolicy as kp


def policy_text() -> str:
    """The policy in effect where this runs."""
    return str(kp.current_policy())


def init_group(rank: int, world: int, port: int) -> None:
    """Join a gloo process group on 127.0.0.1 whose collectives time out after 60 s."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def end_rank() -> NoReturn:
    """Leave the process group and end this rank now, with exit status 0: call it once the rank's results are written.

    A barrier first, so no rank is inside a collective; then the group (and what TorchDynamo and reference
    cycles still hold of DDP's reducer or FSDP2's state) goes while the interpreter is whole; then
    ``os._exit`` skips interpreter finalization. There gloo's worker threads, torn down with tensors that
    still hold Python references, aborted a finished rank now and then ("terminate called without an active
    exception", SIGABRT, about one run in a few dozen; pytorch/pytorch#179291 describes the mechanism). A
    rank that raised does not get here: its exception reaches the parent through torch.multiprocessing.
    """
    import gc
    import os
    import sys

    import torch
    import torch.distributed as dist

    dist.barrier()
    torch._dynamo.reset()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def distributed_worker(rank: int, world: int, port: int, out_dir: str, case: str, repo: str) -> None:
    """One rank of a gloo group on 127.0.0.1 (bounded timeout): ``kernelpolicy.distributed`` under ``case``; the outcome to a file."""
    from pathlib import Path

    import kernelpolicy.distributed
    from kernelpolicy.testing import DemoModel, kernelize_locally

    init_group(rank, world, port)
    missing = case == "kernel missing on rank 1" and rank == 1  # e.g. it failed to load on that node
    if case == "failure recovered on rank 1" and rank == 1:  # its kernel's first call fails, then it runs
        from kernelpolicy.testing import rms_norm_kernel_source, write_kernel_repo

        source = rms_norm_kernel_source(can_torch_compile=True, offset=1.0).replace(
            "            def forward(self, hidden_states):\n",
            "            def forward(self, hidden_states):\n"
            "                if CALLS[0] == 0:\n"
            "                    CALLS[0] += 1\n"
            "                    raise RuntimeError('CUDA error: an illegal memory access on GPU 0')\n",
        )
        repo = str(write_kernel_repo(Path(out_dir, "failing-once"), source))
    model = kernelize_locally(DemoModel(16).eval(), {} if missing else {"RMSNorm": repo}, inherit=False)
    modes = {
        "same": ("prefer,RMSNorm=disable",) * 2,
        "policies differ": ("require", "disable"),
        "broadcast": ("require", "disable,RMSNorm=prefer"),
        "failure recovered on rank 1": ("prefer,fallback_on=RuntimeError",) * 2,
    }
    policy = modes.get(case, ("prefer", "prefer"))[rank]
    with kp.kernel_policy(kp.Policy.parse(policy)):
        if case == "failure recovered on rank 1":
            import torch

            model(torch.ones(2, 16))  # rank 1: the kernel fails once, the original answers this call
        if case == "broadcast":
            with kernelpolicy.distributed.broadcast_policy(src=1):
                outcome = f"ok {kernelpolicy.distributed.check_consistent(model)}"
        else:
            try:
                outcome = f"ok {kernelpolicy.distributed.check_consistent(model)}"
            except kernelpolicy.distributed.PolicyMismatchError as error:
                outcome = f"mismatch {error}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)
    end_rank()


def sequence_parallel_worker(rank: int, world: int, port: int, out_dir: str, repo: str) -> None:
    """One rank: a kernelized RMSNorm under ``SequenceParallel`` on a CPU mesh, every policy; results to JSON.

    Each rank holds its slice of the sequence (``Shard(1)``); the full input is
    the same on every rank (seeded), so each rank computes the reference.
    """
    import json
    from pathlib import Path

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import kernelpolicy.distributed
    from kernelpolicy.testing import RMSNorm, kernelize_locally

    init_group(rank, world, port)
    results: dict[str, object] = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = kernelize_locally(nn.Sequential(RMSNorm(8)).eval(), {"RMSNorm": repo}, inherit=False)
        parallelize_module(model, mesh, {"0": SequenceParallel()})
        full = torch.randn(2, 4 * world, 8, generator=torch.Generator().manual_seed(0))
        reference = full * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + 1e-6)
        local = full.chunk(world, dim=1)[rank]  # this rank's part of the sequence

        def run(case: str) -> None:
            with kp.record_calls() as calls:
                try:
                    out = model(local).full_tensor()
                except kp.KernelUnavailableError as error:
                    results[case] = {"error": str(error), "calls": calls.by_layer()}
                    return
            results[case] = {
                "offset": round((out - reference).mean().item(), 4),  # 0: the original; 100: the kernel
                "calls": calls.by_layer(),
                "explain": [row.path + ": " + row.reason for row in kp.explain(model)],
            }

        run("prefer")
        with kp.kernel_policy("require"):
            run("require")
        with kp.kernels_disabled():
            run("disable")
        kernelpolicy.distributed.run_on_local_shards("RMSNorm")
        run("prefer, local shards")
        with kp.kernel_policy("require"):
            run("require, local shards")
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    end_rank()


class PolicyReport:
    """A map-style dataset (what DataLoader needs: ``__len__``, ``__getitem__``) whose items are the policy where they are made."""

    def __init__(self, size: int = 2) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> str:
        return policy_text()


WORKER_IDS: list[int] = []


def note_worker_id(worker_id: int) -> None:
    """A user's ``worker_init_fn``: it sees the policy already set, and its worker id."""
    WORKER_IDS.append(worker_id)
    import os

    os.environ["KP_TEST_INIT"] = f"{worker_id} {policy_text()}"


class InitReport(PolicyReport):
    """Items report what :func:`note_worker_id` saw in this worker."""

    def __getitem__(self, index: int) -> str:
        import os

        return os.environ.get("KP_TEST_INIT", "not called")


def variant_offset(default_repo: str, variant_repo: str) -> str:
    """Bind an RMSNorm's default kernel and the variant ``fast`` here, call it once: the offset of what ran, and the policy.

    A worker's task that kernelizes its own model: the variant a carried policy names is bound only now.
    """
    import torch

    from kernelpolicy.testing import RMSNorm, kernelize_locally, local_mapping

    norm = kernelize_locally(RMSNorm(16).eval(), {"RMSNorm": default_repo})
    with local_mapping({"RMSNorm": variant_repo}, inherit=False):
        kp.kernelize(norm, mode="inference", device="cpu", variant="fast")
    out = norm(torch.ones(2, 16))
    return f"{round(out.mean().item() - 1)} {policy_text()}"

"""Functions for worker processes: importable by name in a spawned child, and without torch (cheap to start)."""

from __future__ import annotations

import kernelpolicy as kp


def policy_text() -> str:
    """The policy in effect where this runs."""
    return str(kp.current_policy())


def distributed_worker(rank: int, world: int, port: int, out_dir: str, case: str, repo: str) -> None:
    """One rank of a gloo group on 127.0.0.1 (bounded timeout): ``kernelpolicy.distributed`` under ``case``; the outcome to a file."""
    import datetime
    from pathlib import Path

    import kernels
    import torch.distributed as dist

    import kernelpolicy.distributed
    from kernelpolicy._demo import DemoModel

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = DemoModel(16).eval()
        layer = kernels.LocalLayerRepository(repo_path=Path(repo), layer_name="RMSNorm")
        missing = case == "kernel missing on rank 1" and rank == 1  # e.g. it failed to load on that node
        with kernels.use_kernel_mapping({} if missing else {"RMSNorm": {"cpu": layer}}, inherit_mapping=False):
            kp.kernelize(model, mode="inference", device="cpu")
        modes = {
            "same": ("prefer,RMSNorm=disable",) * 2,
            "policies differ": ("require", "disable"),
            "broadcast": ("require", "disable,RMSNorm=prefer"),
        }
        policy = modes.get(case, ("prefer", "prefer"))[rank]
        with kp.kernel_policy(kp.Policy.parse(policy)):
            if case == "broadcast":
                with kernelpolicy.distributed.broadcast_policy(src=1):
                    outcome = f"ok {kernelpolicy.distributed.check_consistent(model)}"
            else:
                try:
                    outcome = f"ok {kernelpolicy.distributed.check_consistent(model)}"
                except kp.PolicyMismatchError as error:
                    outcome = f"mismatch {error}"
        Path(out_dir, f"rank{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()

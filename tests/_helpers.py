"""Helpers shared by the tests (pytest puts tests/ on sys.path: ``pythonpath`` in pyproject)."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from torch._dynamo.utils import counters

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

#: The test kernels add this offset (``rms_norm_kernel_source(offset=100.0)``): their outputs show the path.
KERNEL_OFFSET = 100.0


def graph_breaks() -> int:
    """Graph breaks since the last ``counters.clear()`` (``torch._dynamo.explain`` misses some)."""
    return sum(counters["graph_break"].values())


def kernel_ran(out: torch.Tensor) -> bool:
    """Whether ``out`` came through an offset test kernel (the originals give values near 0)."""
    return out.mean().item() > KERNEL_OFFSET / 2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(worker: Callable[..., None], *args: Any, nprocs: int = 2, deadline_s: float = 180) -> None:
    """``worker(rank, *args)`` in ``nprocs`` spawned processes; raise if any fails or all have not ended by the deadline.

    The ranks' own process-group timeout (``tests/_workers.py``, 60 s) bounds a
    collective that waits; the deadline bounds the whole run, and stragglers
    are killed, so no test can hang.
    """
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")  # type: ignore[attr-defined,no-untyped-call]
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} ranks of {worker.__name__} did not finish in {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()

"""Helpers shared by the tests (pytest puts tests/ on sys.path: ``pythonpath`` in pyproject)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import types
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import kernelpolicy as kp

if TYPE_CHECKING:
    from collections.abc import Callable

#: The test kernels add this offset (``rms_norm_kernel_source(offset=100.0)``): their outputs show the path.
KERNEL_OFFSET = 100.0


def graph_breaks() -> int:
    """Graph breaks since the last ``counters.clear()`` (``torch._dynamo.explain`` misses some)."""
    return sum(counters["graph_break"].values())


def kernel_ran(out: torch.Tensor) -> bool:
    """Whether ``out`` came through an offset test kernel (the originals give values near 0)."""
    return out.mean().item() > KERNEL_OFFSET / 2


def in_another_thread(function: Callable[[], object], timeout_s: float = 60) -> None:
    """Call ``function`` in a new thread (which starts from the process default policy); re-raise its error here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            function()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{function!r} did not return within {timeout_s} s"
    if errors:
        raise errors[0]


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


class CountingBackend:
    """An eager backend that keeps every graph it is given."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(gm)
        return gm.forward

    @property
    def compiles(self) -> int:
        return len(self.graphs)


NAMES = ("KpA", "KpB", "KpC")


class KpKernel0(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class KpKernel1(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 10


class KpKernel2(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 100


#: Python code that drops every capability of its process (Linux ``capset``), root's included: the process keeps its
#: user, so it still reads what it owns (an interpreter installed under /root), but its file accesses are checked
#: against the permission bits as an ordinary user's are (root ignores them: a chmod 555 folder stops no root).
WITHOUT_CAPABILITIES = """
import ctypes
class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
if ctypes.CDLL(None, use_errno=True).capset(ctypes.byref(_Header(0x20080522, 0)), (_Data * 2)()) != 0:  # version 3
    raise OSError(ctypes.get_errno(), "capset")
"""


def as_ordinary_user(code: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (Python) in a new process without capabilities (see :data:`WITHOUT_CAPABILITIES`): what a user
    who is not root meets, where the tests run as root. Linux only; the caller checks ``returncode``."""
    source = WITHOUT_CAPABILITIES + textwrap.dedent(code)
    command = [sys.executable, "-c", source, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)


def three_kernel_layers() -> nn.Sequential:
    """Three layers with distinct kernel layer names; kernel i adds 10**i (all traceable)."""
    layers = []
    for name, kernel_class in zip(NAMES, (KpKernel0, KpKernel1, KpKernel2), strict=True):
        layer = type(name, (nn.Module,), {"kernel_layer_name": name, "forward": lambda self, x: x * 1.0})()
        layer.forward = types.MethodType(kernel_class.forward, layer)  # as kernels binds
        layers.append(layer)
    return kp.attach(nn.Sequential(*layers))


class NormPair(nn.Module):
    """Two RMSNorm(16) layers (Llama's, kernel layer ``RMSNorm``) applied to the input, summed: ``a(x) + b(x)``.

    Each norm sees the input itself, so each one's path shows in the output (an offset kernel is not
    normalized away by a norm after it) and a refusal in ``a`` leaves ``b`` unreached when it raises.
    """

    def __init__(self) -> None:
        from kernelpolicy.testing import RMSNorm

        super().__init__()
        self.a, self.b = RMSNorm(16), RMSNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) + self.b(x)
        return out

"""Helpers shared by the compile and tracing tests (pytest puts tests/ on sys.path: ``pythonpath`` in pyproject)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch._dynamo.utils import counters

if TYPE_CHECKING:
    import torch

#: The test kernels add this offset (``rms_norm_kernel_source(offset=100.0)``): their outputs show the path.
KERNEL_OFFSET = 100.0


def graph_breaks() -> int:
    """Graph breaks since the last ``counters.clear()`` (``torch._dynamo.explain`` misses some)."""
    return sum(counters["graph_break"].values())


def kernel_ran(out: torch.Tensor) -> bool:
    """Whether ``out`` came through an offset test kernel (the originals give values near 0)."""
    return out.mean().item() > KERNEL_OFFSET / 2

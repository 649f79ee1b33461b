"""DTensor: whether a call has DTensor arguments or parameters, and what a kernel without a sharding strategy does.

This module owns the one kernel failure known before the kernel computes anything: a custom-op kernel given
DTensor inputs or parameters (tensor or sequence parallelism) for which its op has no sharding strategy
(:func:`_no_sharding_strategy`), and :data:`LOCAL_SHARDS`, the layers whose kernel runs on the local shards
instead (registered by :func:`kernelpolicy.distributed.run_on_local_shards`). The binding's slow path
(``Binding.unsupported``) and ``explain`` read them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Final

from .._values._tensors import tensors_in

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

__all__ = ["LOCAL_SHARDS", "NO_SHARDING", "ON_LOCAL_SHARDS", "has_dtensor"]

NO_SHARDING: Final = "kernel cannot run on DTensor inputs (its op has no sharding strategy)"
ON_LOCAL_SHARDS: Final = "kernel run on local shards (declared with kernelpolicy.distributed.run_on_local_shards)"
#: Kernel layer name -> how its kernel runs on local shards when its op has no DTensor sharding strategy:
#: ``run(kernel, module, args, kwargs)``. Registered by :func:`kernelpolicy.distributed.run_on_local_shards`.
LOCAL_SHARDS: dict[str, Callable[[Callable[..., Any], nn.Module, tuple[Any, ...], dict[str, Any]], Any]] = {}


def _no_sharding_strategy(error: NotImplementedError, where: tuple[Any, ...]) -> bool:
    """Whether ``error`` is DTensor's "no sharding strategy" for a call that has DTensor arguments or parameters."""
    if "does not have a sharding strategy registered" not in str(error):
        return False
    args, kwargs, module = where
    return has_dtensor(module) or any(_is_dtensor(t) for t in tensors_in((args, kwargs)))


def has_dtensor(module: nn.Module) -> bool:
    """Whether ``module`` has DTensor parameters or buffers of its own."""
    return any(_is_dtensor(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def _is_dtensor(tensor: torch.Tensor) -> bool:
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it is imported
    dtensor = getattr(tensor_module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)

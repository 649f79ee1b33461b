"""The tensors of a call's structure: what a kernel's arguments and outputs hold, walked the same way everywhere.

This module owns the walk over tuples (named ones kept), lists and dicts that ``verify`` (clones and comparisons),
the eligibility rules (dtypes and devices), DTensor sharding and serve's metrics read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["clone_tensors", "map_tensors", "tensors_in"]


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside tuples (named ones kept), lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [map_tensors(item, fn) for item in value]
    if isinstance(value, dict):
        return {key: map_tensors(item, fn) for key, item in value.items()}
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside tuples, lists and dicts of ``value``, in order."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def clone_tensors(value: Any) -> Any:
    """``value`` with every tensor inside tuples, lists and dicts cloned."""
    return map_tensors(value, lambda tensor: tensor.detach().clone())

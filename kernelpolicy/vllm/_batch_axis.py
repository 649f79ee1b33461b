"""Governed calls whose tensors carry a leading batch axis of one: the tokens on axis 1, not axis 0.

vLLM's own models call their ops on token-major tensors (``[tokens, ...]``), which :func:`._rowwise.choose` takes
row by row. vLLM's Transformers backend (``model_impl="transformers"``) runs transformers' modeling code on
``[1, tokens, ...]`` (its ``Base.forward`` adds the batch axis), so the norms and activations it swapped in for
transformers' layers get that shape; taken as is, the call's one row would be its first token's, and that token's
path would be every token's. :func:`per_token` views such a call's tensors without the batch axis, lets
:func:`._rowwise.choose` take each token's path, and gives the outputs the axis back.

A call has such an axis where its first tensor is ``[1, n, ...]`` with ``n`` over one in an eager step of two tokens
or more (whose token-major tensors have two rows or more), or, traced, where its first dimension is 1 and its second
more (vLLM traces once, with the token count a dynamic dimension whose example is far over 1: a token-major tensor is
never taken for one with a batch axis, and the backend's batch axis, a fixed 1, always is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._values._tensors import map_tensors
from ._codes import STEP

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["leading_unit_axis", "per_token"]


def per_token(
    choose: Callable[..., Any], column: int, paths: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, clone: bool
) -> Any:
    """``choose(column, paths, args, kwargs, clone=clone)`` (:func:`._rowwise.choose`) for a call whose tensors are
    ``[1, tokens, ...]`` (:func:`leading_unit_axis`): on views without the batch axis, the outputs given it back."""
    tokens = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1).shape[1]

    def squeezed(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == tokens:
            return tensor[0]
        return tensor

    def unsqueezed(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[None] if tensor.dim() >= 1 and tensor.shape[0] == tokens else tensor

    flat_args, flat_kwargs = map_tensors((args, kwargs), squeezed)
    found = choose(column, paths, flat_args, flat_kwargs, clone=clone)
    restored: Any = map_tensors(found, unsqueezed)
    return restored


def leading_unit_axis(tensor: torch.Tensor, *, compiling: bool) -> bool:
    """Whether ``tensor``'s first axis is a batch axis of one in front of the tokens (see the module)."""
    if tensor.dim() < 2 or tensor.shape[0] != 1 or tensor.shape[1] < 2:
        return False
    return compiling or STEP.rows > 1

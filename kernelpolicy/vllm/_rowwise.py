"""How a vLLM op takes each row's path: ``CustomOp`` layers and IR ops choosing per token from the step's codes.

This module owns :func:`govern_custom_op` (a ``CustomOp`` layer, when built: its kernel is the platform forward,
``forward_cpu`` / ``forward_cuda`` / ..., its original ``forward_native``), :func:`ir_inner_call` (an IR op's call:
its kernel is the first provider other than ``native`` that the platform supports for the call, by vLLM's priority
list first, its original the ``native`` provider) and :func:`choose`, one call's choice: with no policy in the step,
vLLM's own path and nothing else (eager); where rows differ, both paths (the kernel on clones of the caller's
tensors, so an in-place kernel never writes what the original reads) joined per token with ``torch.where`` on the
codes. Traced code (vLLM compiles once, every guard dropped) always takes the second form: the choice is data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._values._tensors import map_tensors
from ._codes import KERNEL, ORIGINAL, STEP, codes_in_context

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["choose", "govern_custom_op", "ir_inner_call", "platform_forward"]

#: The platform forward a ``CustomOp`` dispatches to when enabled, by platform (vLLM's ``dispatch_forward``).
_PLATFORMS = (
    ("is_rocm", "forward_hip"),
    ("is_cpu", "forward_cpu"),
    ("is_tpu", "forward_tpu"),
    ("is_xpu", "forward_xpu"),
    ("is_out_of_tree", "forward_oot"),
)


def platform_forward(op: Any) -> Callable[..., Any] | None:
    """``op``'s platform forward, None where its class keeps the base one (which runs ``forward_native``)."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.platforms import current_platform

    name = next((method for test, method in _PLATFORMS if getattr(current_platform, test)()), "forward_cuda")
    own = [name] + (["forward_cuda"] if name == "forward_hip" else [])
    if all(getattr(type(op), method) is getattr(CustomOp, method) for method in own):
        return None
    forward: Callable[..., Any] = getattr(op, name)
    return forward


def govern_custom_op(op: Any) -> None:
    """Make a just-built ``CustomOp`` layer choose per row (nothing where the platform has no kernel of its own)."""
    kernel = platform_forward(op)
    if kernel is None:
        return
    default = op._forward_method
    default_is_kernel = default == kernel
    original = op.forward_native if default_is_kernel else default
    column = STEP.column(type(op).name)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return choose(column, default_is_kernel, kernel, original, default, args, kwargs, clone=True)

    op._forward_method = forward


def ir_inner_call(op: Any, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of IR op ``op`` (``inner``: vLLM's ``IrOp._inner_call``), each row on its own path."""
    column = STEP.columns.get(op.name)
    if column is None or (not STEP.mixed and not torch.compiler.is_compiling()):
        return inner(op, *args, **kwargs)
    native = op.impls["native"]
    priority = list(op._priority_impls)
    kernel = next(
        (
            impl
            for impl in priority + [impl for impl in op.impls.values() if impl not in priority]
            if impl.provider != "native" and impl.supported and impl.supports_args(*args, **kwargs)
        ),
        None,
    )
    if kernel is None:
        return inner(op, *args, **kwargs)
    default_is_kernel = op.dispatch(*args, **kwargs) is not native

    def default(*args: Any, **kwargs: Any) -> Any:
        return inner(op, *args, **kwargs)

    return choose(
        column, default_is_kernel, kernel.func_impl_fn, native.func_impl_fn, default, args, kwargs, clone=False
    )


def choose(
    column: int,
    default_is_kernel: bool,
    kernel: Callable[..., Any],
    original: Callable[..., Any],
    default: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    clone: bool,
) -> Any:
    """One call of a governed op: each token's row takes the path its code gives (``default``: vLLM's own)."""
    compiling = torch.compiler.is_compiling()
    if not compiling and not STEP.mixed:
        return default(*args, **kwargs)
    codes = codes_in_context()
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
    if codes is None or first is None:
        return default(*args, **kwargs)
    count = first.shape[0]
    if not compiling and count > codes.shape[0]:
        return default(*args, **kwargs)
    rows = codes[:count, column]
    kernel_rows = rows != ORIGINAL if default_is_kernel else rows == KERNEL
    if not compiling:
        if bool(kernel_rows.all()):
            return kernel(*args, **kwargs)
        if not bool(kernel_rows.any()):
            return original(*args, **kwargs)
    caller = {id(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    if clone:
        own_args, own_kwargs = map_tensors((args, kwargs), lambda t: t.clone() if _rows_of(t, count) else t)
        kernel_out = kernel(*own_args, **own_kwargs)
    else:
        kernel_out = kernel(*args, **kwargs)
    return _joined(kernel_rows, kernel_out, original(*args, **kwargs), count, caller)


def _rows_of(tensor: torch.Tensor, count: int) -> bool:
    return tensor.dim() >= 1 and tensor.shape[0] == count


def _joined(kernel_rows: torch.Tensor, kernel_out: Any, original_out: Any, count: int, caller: set[int]) -> Any:
    """The two paths' outputs joined per token (axis 0); where the original returned a caller's tensor (an in-place
    op), the joined rows are written into it, so the caller sees what it would have."""
    if isinstance(original_out, torch.Tensor) and isinstance(kernel_out, torch.Tensor):
        if not _rows_of(original_out, count) or kernel_out.shape != original_out.shape:
            return original_out
        mask = kernel_rows.view(count, *([1] * (original_out.dim() - 1)))
        joined = torch.where(mask, kernel_out, original_out)
        if id(original_out) in caller:
            original_out.copy_(joined)
            return original_out
        return joined
    if isinstance(original_out, (tuple, list)) and isinstance(kernel_out, (tuple, list)):
        items = [_joined(kernel_rows, k, o, count, caller) for k, o in zip(kernel_out, original_out, strict=True)]
        return type(original_out)(items) if isinstance(original_out, list) else tuple(items)
    return original_out

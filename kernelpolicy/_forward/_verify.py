"""``verify`` mode: run the kernel and the original forward, compare, return the kernel's output.

This module owns the comparison (structures of tensors, default tolerances by
dtype) and :class:`~kernelpolicy.KernelMismatchError`'s numbers.

How one verified call runs (eager only; under any tracer ``verify`` behaves
like ``prefer``):

1. the original forward runs first, on clones of every tensor argument (so
   an in-place original cannot change what the kernel sees), under
   ``torch.no_grad()`` and inside ``torch.random.fork_rng`` (so the kernel
   sees the random state it would have seen without ``verify``);
2. the kernel runs on the real arguments, exactly as under ``prefer``;
3. the outputs are compared: same structure (tensors, tuples, lists, dicts
   by key, other values by ``==``), same shapes and dtypes, and
   ``|kernel - original| <= atol + rtol * |original|`` elementwise, integers
   included (NaN equal to NaN; NaN or an infinity against a finite number is
   a mismatch with an infinite error);
4. then the tensor arguments each run left (``args[1]``, ``kwargs['out']``):
   a kernel that writes its result into an ``out=`` tensor, or works in place
   on an input, is compared on what it wrote. The caller's arguments hold
   what the kernel wrote, as under ``prefer``.

Module buffers (running statistics and the like, of the module and its
children) are saved before step 1 and restored after it, so both runs start
from the same state and it ends updated once, by the kernel; the buffers
each run leaves are compared too (``buffers['running_mean']``). State outside
buffers (plain attributes, a cache passed as an argument and mutated) is
updated by both runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._values._tensors import clone_tensors, tensors_in

if TYPE_CHECKING:
    from .._values._policy import Tolerance

__all__ = [
    "DEFAULT_TOLERANCES",
    "BufferState",
    "Mismatch",
    "compare",
    "run_and_compare",
    "tolerances",
]

#: (rtol, atol) by dtype when the policy gives none; exact for integers and bool.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.complex128: (1e-7, 1e-7),
    torch.complex64: (1e-5, 1e-5),
}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where and by how much a kernel's output differs from the original's."""

    where: str
    detail: str
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    index: tuple[int, ...] | None = None


#: ``hook(module, tested output, reference output, mismatch or None)`` after each comparison of ``verify``
#: (serve's metrics: the largest errors per layer).
COMPARED: list[Callable[[nn.Module, Any, Any, Mismatch | None], None]] = []


def tolerances(dtype: torch.dtype, rtol: Tolerance, atol: Tolerance) -> tuple[float, float]:
    """(rtol, atol) for ``dtype``: the policy's, for that dtype or for every dtype (``*``), else the default."""
    default = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    return _pick(rtol, dtype, default[0]), _pick(atol, dtype, default[1])


def _pick(value: Tolerance, dtype: torch.dtype, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, tuple):
        named = dict(value)
        return named.get(str(dtype).removeprefix("torch."), named.get("*", default))
    return value


class BufferState:
    """The buffers of a module tree: saved once, restorable, readable by qualified name."""

    __slots__ = ("_saved",)

    def __init__(self, module: nn.Module) -> None:
        self._saved = [
            (owner, name, f"{prefix}.{name}" if prefix else name, tensor, tensor.detach().clone())
            for prefix, owner in module.named_modules()
            for name, tensor in owner._buffers.items()
            if tensor is not None
        ]

    def __bool__(self) -> bool:
        return bool(self._saved)

    def current(self) -> dict[str, Any]:
        """The buffers now (the objects the modules hold under the saved names)."""
        return {qualified: owner._buffers.get(name) for owner, name, qualified, _, _ in self._saved}

    def restore(self) -> None:
        """Put the saved objects back, with their saved values."""
        with torch.no_grad():
            for owner, name, _, tensor, value in self._saved:
                owner._buffers[name] = tensor
                tensor.copy_(value)


def compare(kernel: Any, original: Any, *, rtol: Tolerance, atol: Tolerance, where: str = "output") -> Mismatch | None:
    """The first mismatch between ``kernel`` and ``original`` outputs, or None."""
    if isinstance(original, torch.Tensor):
        if not isinstance(kernel, torch.Tensor):
            return Mismatch(where, f"kernel returned {type(kernel).__name__}, original a tensor")
        if kernel.shape != original.shape or kernel.dtype != original.dtype:
            return Mismatch(
                where,
                f"kernel returned {tuple(kernel.shape)} {kernel.dtype}, original {tuple(original.shape)} {original.dtype}",
            )
        return _compare_tensors(kernel.detach(), original.detach(), rtol=rtol, atol=atol, where=where)
    if isinstance(original, (tuple, list)):
        if not isinstance(kernel, (tuple, list)) or len(kernel) != len(original):
            return Mismatch(where, f"kernel returned {_describe(kernel)}, original {_describe(original)}")
        names = getattr(original, "_fields", None)  # a named tuple's items by name
        for position, (k_item, o_item) in enumerate(zip(kernel, original, strict=True)):
            at = f"{where}.{names[position]}" if names else f"{where}[{position}]"
            found = compare(k_item, o_item, rtol=rtol, atol=atol, where=at)
            if found is not None:
                return found
        return None
    if isinstance(original, Mapping):
        if not isinstance(kernel, Mapping) or set(kernel.keys()) != set(original.keys()):  # in any order
            return Mismatch(where, f"kernel returned {_describe(kernel)}, original {_describe(original)}")
        for key in original:
            found = compare(kernel[key], original[key], rtol=rtol, atol=atol, where=f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if dataclasses.is_dataclass(original) and not isinstance(original, type):
        if type(kernel) is not type(original):
            return Mismatch(where, f"kernel returned {_describe(kernel)}, original {_describe(original)}")
        for field in dataclasses.fields(original):
            found = compare(
                getattr(kernel, field.name),
                getattr(original, field.name),
                rtol=rtol,
                atol=atol,
                where=f"{where}.{field.name}",
            )
            if found is not None:
                return found
        return None
    try:
        equal = bool(kernel == original)
    except (RuntimeError, TypeError, ValueError) as error:  # an object holding tensors compares elementwise
        return Mismatch(
            where,
            f"cannot compare the {type(original).__name__} outputs ({error}); verify compares tensors and "
            "tuples, lists, dicts and dataclasses of them",
        )
    if not equal:
        return Mismatch(where, f"kernel returned {kernel!r}, original {original!r}")
    return None


def _compare_tensors(
    k: torch.Tensor, o: torch.Tensor, *, rtol: Tolerance, atol: Tolerance, where: str
) -> Mismatch | None:
    """Two tensors of one shape and dtype: ``|k - o| <= atol + rtol * |o|`` elementwise (see the module docstring)."""
    r, a = tolerances(o.dtype, rtol, atol)
    if o.dtype.is_floating_point or o.dtype.is_complex:
        close = torch.isclose(k, o, rtol=r, atol=a, equal_nan=True)
        diff = (k.to(torch.float64) - o.to(torch.float64)).abs() if not o.is_complex() else (k - o).abs().double()
    elif o.dtype == torch.bool:
        close = k == o
        diff = (k != o).to(torch.float64)
    else:  # integers: the difference in exact integer arithmetic, the tolerance as given (exact by default)
        diff = (k.to(torch.int64) - o.to(torch.int64)).abs().to(torch.float64)
        close = diff <= a + r * o.to(torch.int64).abs().to(torch.float64)
    if bool(close.all()):
        return None
    scale = o.abs().to(torch.float64) if o.dtype != torch.bool else torch.ones_like(diff)
    rel = torch.where(scale > 0, diff / scale, torch.where(diff > 0, float("inf"), 0.0))  # against 0: infinite
    finite = torch.isfinite(diff)
    nonfinite = int((~close & ~finite).sum())  # NaN or an infinity against a finite number, or inf against -inf
    detail = f"{int((~close).sum())} of {close.numel()} elements differ beyond rtol={r}, atol={a}"
    if nonfinite:
        detail += f" ({nonfinite} of them NaN or infinite where the other is not, or infinities of opposite signs)"
    some = bool(finite.any())
    return Mismatch(
        where,
        detail,
        max_abs=float("inf") if nonfinite or not some else float(diff[finite].max()),
        max_rel=float("inf") if nonfinite or not some else float(rel[finite].max()),
        index=tuple(int(i) for i in (~close).nonzero()[0].tolist()),
    )


def _describe(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and not isinstance(value, Mapping):
        return f"{type(value).__name__} (a dataclass)"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {list(value.keys())}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def run_and_compare(
    module: nn.Module,
    reference: Callable[..., Any],
    tested: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    rtol: Tolerance,
    atol: Tolerance,
) -> tuple[Any, Mismatch | None]:
    """The procedure of ``verify``: (the tested forward's output, the first mismatch with the reference or None).

    The reference runs first, on clones of the arguments, without grad, with the random state forked and the
    module's buffers saved and restored; then the tested forward on the arguments themselves. The outputs
    are compared, then the buffers each run left.
    """
    devices = sorted({t.device.index or 0 for t in tensors_in((args, kwargs)) if t.is_cuda})
    buffers = BufferState(module)
    reference_args, reference_kwargs = clone_tensors(args), clone_tensors(kwargs)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            expected = reference(module, *reference_args, **reference_kwargs)
        expected_buffers = clone_tensors(buffers.current()) if buffers else {}
    finally:
        buffers.restore()
    out = tested(module, *args, **kwargs)
    mismatch = compare(out, expected, rtol=rtol, atol=atol)
    if mismatch is None and buffers:
        mismatch = compare(buffers.current(), expected_buffers, rtol=rtol, atol=atol, where="buffers")
    if mismatch is None:
        mismatch = _arguments_left(args, kwargs, reference_args, reference_kwargs, rtol=rtol, atol=atol)
    for compared in COMPARED:
        compared(module, out, expected, mismatch)
    return out, mismatch


def _arguments_left(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reference_args: tuple[Any, ...],
    reference_kwargs: dict[str, Any],
    *,
    rtol: Tolerance,
    atol: Tolerance,
) -> Mismatch | None:
    """The first mismatch in the tensors each run left in its arguments (``out=``, in place), or None.

    Only tensors are compared (inside tuples, lists and dicts): other arguments were not cloned, both runs
    saw the same objects.
    """
    pairs = [(f"args[{i}]", a, r) for i, (a, r) in enumerate(zip(args, reference_args, strict=True))]
    pairs += [(f"kwargs[{key!r}]", kwargs[key], reference_kwargs[key]) for key in kwargs]
    for where, left, expected in pairs:
        tested, reference = tensors_in(left), tensors_in(expected)
        if len(tested) != len(reference):
            return Mismatch(where, f"the kernel left {len(tested)} tensors in it, the reference {len(reference)}")
        for position, (k, o) in enumerate(zip(tested, reference, strict=True)):
            at = where if len(tested) == 1 and isinstance(left, torch.Tensor) else f"{where} (tensor {position})"
            found = compare(k, o, rtol=rtol, atol=atol, where=f"{at} as the call left it")
            if found is not None:
                return found
    return None

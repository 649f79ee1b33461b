"""How a vLLM op takes each row's path: ``CustomOp`` layers and IR ops choosing per token from the step's codes.

This module owns :func:`govern_custom_op` (a ``CustomOp`` layer, when built: its kernel is the platform forward,
``forward_cpu`` / ``forward_cuda`` / ..., its original ``forward_native``), :func:`ir_inner_call` (an IR op's call:
its kernel is the first provider other than ``native`` that the platform supports for the call, by vLLM's priority
list first, its original the ``native`` provider, its variants the other providers the platform supports) and
:func:`choose`, one call's choice: with no policy in the step, vLLM's own path and nothing else (eager); where rows
differ, each path that a row takes, once (a kernel on clones of the caller's tensors, so an in-place kernel never
writes what the original reads), joined per token with ``torch.where`` on the codes. A kernel or variant that raises
fails the requests of its rows (``StepCodes.fail``), whose rows then take the original, so the step goes on for the
others. Traced code (vLLM compiles once, every guard dropped) computes every path on every row: the choice is data.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._forward._verify import tolerances
from .._values._errors import KernelMismatchError
from .._values._tensors import map_tensors
from ._batch_axis import leading_unit_axis, per_token
from ._codes import DEFAULT, KERNEL, ORIGINAL, REQUIRED, STEP, VARIANTS, VERIFIED, codes_in_context, has_provider

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Paths", "choose", "govern_custom_op", "ir_inner_call", "ir_inplace_call", "platform_forward"]

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


class Paths(NamedTuple):
    """The paths of one call of governed op ``op``: vLLM's ``default``, the ``kernel`` (``kernel_name`` says which,
    in errors), the ``original``, and the IR providers that variant codes name (``variant(code)``: the provider's
    name and function, None where it cannot take the call)."""

    op: str
    default_is_kernel: bool
    default: Callable[..., Any]
    kernel: Callable[..., Any]
    kernel_name: str
    original: Callable[..., Any]
    variant: Callable[[int], tuple[str, Callable[..., Any]] | None] = lambda code: None
    #: The variant codes a traced call computes (every IR provider the platform supports for the call, but the
    #: kernel's own).
    traced_variants: tuple[int, ...] = ()
    #: The variant code of the kernel's own provider (its rows take the kernel; -1: none).
    kernel_code: int = -1
    #: (rtol, atol) of ``verify`` for an output's dtype (an IR op's own; kernelpolicy's defaults).
    tolerance: Callable[[torch.dtype], tuple[float, float]] = lambda dtype: tolerances(dtype, None, None)

    def path(self, code: int) -> tuple[int, str, Callable[..., Any]] | None:
        """The path of rows with ``code``: its key (``KERNEL``, or the variant's code), its name in errors, its
        function; None for the original."""
        found = self.variant(code) if code >= VARIANTS and code != self.kernel_code else None
        if found is not None:
            return code, f"{self.op}'s variant ({found[0]})", found[1]
        if code in (KERNEL, REQUIRED, VERIFIED, self.kernel_code) or (code == DEFAULT and self.default_is_kernel):
            return KERNEL, f"{self.op}'s kernel ({self.kernel_name})", self.kernel
        return None


def govern_custom_op(op: Any) -> None:
    """Make a just-built ``CustomOp`` layer choose per row (nothing where the platform has no kernel of its own)."""
    from vllm.ir.op import IrOp

    name = type(op).name
    if name in IrOp.registry:  # a layer of an IR op's name (RMSNorm) calls the op, which chooses per row
        return
    kernel = platform_forward(op)
    column = STEP.column(name)
    if kernel is None:
        STEP.no_kernel(column, f"{type(op).__name__} has no platform forward of its own")
        return
    default = op._forward_method
    default_is_kernel = default == kernel
    original = op.forward_native if default_is_kernel else default
    paths = Paths(name, default_is_kernel, default, kernel, f"{type(op).__name__}.{kernel.__name__}", original)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return choose(column, paths, args, kwargs, clone=True)

    op._forward_method = forward


def ir_inner_call(op: Any, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of IR op ``op`` (``inner``: vLLM's ``IrOp._inner_call``), each row on its own path."""
    column = STEP.columns.get(op.name)
    if column is None:
        return inner(op, *args, **kwargs)
    compiling = torch.compiler.is_compiling()
    if not STEP.mixed and not compiling:
        return inner(op, *args, **kwargs)
    native = op.impls["native"]
    uniform = DEFAULT if compiling else STEP.uniform[column]
    if uniform == ORIGINAL:
        return native.func_impl_fn(*args, **kwargs)
    if (uniform == DEFAULT and not compiling) or not has_provider(op):  # no kernel here: a policy's requests
        return inner(op, *args, **kwargs)  # that require one failed when the step was filled (StepCodes)
    impls = list(op.impls.values())
    takes = [impl is not native and impl.supported and impl.supports_args(*args, **kwargs) for impl in impls]
    ranked = [impl for impl in op._priority_impls if impl is not native] + impls
    kernel = next((impl for impl in ranked if takes[impls.index(impl)]), None)
    if kernel is None:
        if not compiling:  # the rows that require a kernel fail (traced: a guard-free program cannot fail them)
            STEP.no_kernel(column, "no provider but 'native' takes the call here")
        return inner(op, *args, **kwargs)

    def default(*args: Any, **kwargs: Any) -> Any:
        return inner(op, *args, **kwargs)

    def variant(code: int) -> tuple[str, Callable[..., Any]] | None:
        place = code - VARIANTS
        if 0 <= place < len(impls) and takes[place]:
            return f"provider {impls[place].provider!r}", impls[place].func_impl_fn
        return None

    place = impls.index(kernel)
    paths = Paths(
        op.name,
        op.dispatch(*args, **kwargs) is not native,
        default,
        kernel.func_impl_fn,
        f"provider {kernel.provider!r}",
        native.func_impl_fn,
        variant,
        tuple(VARIANTS + other for other, ok in enumerate(takes) if ok and other != place),
        VARIANTS + place,
        functools.partial(_ir_tolerance, op),
    )
    return choose(column, paths, args, kwargs, clone=False)


def _ir_tolerance(op: Any, dtype: torch.dtype) -> tuple[float, float]:
    """IR op ``op``'s (rtol, atol) for ``dtype`` (vLLM's, with its overrides), else kernelpolicy's default."""
    try:
        found = op.get_tolerance(dtype)
    except ValueError:
        return tolerances(dtype, None, None)
    return float(found["rtol"]), float(found["atol"])


def ir_inplace_call(
    overload: Any, inplace: Callable[..., Any], inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """One call of an IR op's in-place overload (``overload``, vLLM's ``IrOpInplaceOverload``; ``inplace``: its
    ``_inner_call``): vLLM's own where no policy is in the step, else the op's functional call, each row on its own
    path (``maybe_inplace`` lets the op write its inputs, never obliges it to)."""
    if (not STEP.mixed and not torch.compiler.is_compiling()) or not has_provider(overload.op):
        return inplace(overload, *args, **kwargs)
    return ir_inner_call(overload.op, inner, args, kwargs)


def choose(column: int, paths: Paths, args: tuple[Any, ...], kwargs: dict[str, Any], *, clone: bool) -> Any:
    """One call of a governed op: each token's row takes the path its code gives (``default``: vLLM's own)."""
    compiling = torch.compiler.is_compiling()
    if not compiling:
        if not STEP.mixed:
            return paths.default(*args, **kwargs)
        uniform = STEP.uniform[column]
        if uniform >= 0 and uniform != VERIFIED:  # every row of the step takes one path: no codes read
            return _uniform(uniform, paths, args, kwargs)
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
    if first is None:
        return paths.default(*args, **kwargs)
    if leading_unit_axis(first, compiling=compiling):  # vLLM's Transformers backend: [1, tokens, ...]
        return per_token(choose, column, paths, args, kwargs, clone=clone)
    count = first.shape[0]
    caller = {id(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    if compiling:
        return _every_path(column, paths, args, kwargs, clone, count, caller)
    masks = STEP.masks(column, count)
    if masks is None:
        return paths.default(*args, **kwargs)
    # eager: each path that a row takes, once; a kernel that raises fails the requests of its rows
    taken: dict[int, tuple[str, Callable[..., Any], torch.Tensor]] = {}
    original = False
    for code, mask in masks.items():
        path = paths.path(code)
        if path is None:
            original = True
        elif path[0] in taken:  # the kernel by two codes (vLLM's default and the policy's)
            name, function, rows = taken[path[0]]
            taken[path[0]] = (name, function, rows | mask)
        else:
            taken[path[0]] = (path[1], path[2], mask)
    verified = masks.get(VERIFIED)
    if not original and len(taken) == 1 and verified is None:
        [(name, function, mask)] = taken.values()
        return _alone(name, function, mask, paths, args, kwargs)
    outputs: dict[int, tuple[torch.Tensor, Any]] = {}
    for key, (name, function, mask) in taken.items():
        try:
            outputs[key] = (mask, _run(function, args, kwargs, clone, count))
        except Exception as error:  # noqa: BLE001  # any kernel error fails its rows' requests, not the step
            STEP.fail(mask, name, error)
    joined = paths.original(*args, **kwargs)
    if verified is not None and KERNEL in outputs:
        _compare_rows(verified, outputs[KERNEL][1], joined, paths, count)
    for mask, output in outputs.values():
        joined = _joined(mask, output, joined, count, caller)
    return joined


def _compare_rows(rows: torch.Tensor, kernel_out: Any, original_out: Any, paths: Paths, count: int) -> None:
    """``verify``: the requests of ``rows`` whose kernel output differs from the original's beyond the op's
    tolerance (per row, every floating output of the call's rows) fail, the error naming the op and the errors."""
    bad: torch.Tensor | None = None
    worst: tuple[float, str, float, float, float] = (0.0, "output", 0.0, 0.0, 0.0)
    for where, kernel, original in _pairs(kernel_out, original_out, "output"):
        if kernel.shape != original.shape or not _rows_of(original, count) or not original.is_floating_point():
            continue
        rtol, atol = paths.tolerance(original.dtype)
        close = torch.isclose(kernel, original, rtol=rtol, atol=atol, equal_nan=True).reshape(count, -1).all(1)
        off = rows & ~close
        if bool(off.any()):
            bad = off if bad is None else bad | off
            expected = original[off].double()
            difference = (kernel[off].double() - expected).abs()
            relative = float((difference / expected.abs().clamp_min(torch.finfo(torch.float64).tiny)).max())
            worst = max(worst, (float(difference.max()), where, rtol, atol, relative))
    if bad is not None:
        error, where, rtol, atol, relative = worst
        STEP.fail(
            bad,
            f"{paths.op}'s kernel ({paths.kernel_name}) under verify",
            KernelMismatchError(
                module_name=f"vLLM op {paths.op}",
                layer_name=paths.op,
                module_class=paths.kernel_name,
                where=where,
                detail=f"rows beyond rtol={rtol:g}, atol={atol:g} (the op's tolerance for the dtype)",
                max_abs=error,
                max_rel=relative,
                index=None,
            ),
        )


def _pairs(kernel: Any, original: Any, where: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The tensors of two outputs of one structure (tensors, tuples, lists), paired, with where each is."""
    if isinstance(kernel, torch.Tensor) and isinstance(original, torch.Tensor):
        return [(where, kernel, original)]
    if isinstance(kernel, (tuple, list)) and isinstance(original, (tuple, list)) and len(kernel) == len(original):
        pairs = enumerate(zip(kernel, original, strict=True))
        return [pair for i, (k, o) in pairs for pair in _pairs(k, o, f"{where}[{i}]")]
    return []


def _every_path(
    column: int,
    paths: Paths,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    clone: bool,
    count: int,
    caller: set[int],
) -> Any:
    """A traced call (vLLM compiles once for every step): every path on every row, joined by the codes, an input
    of the program (data: no guard, no recompile)."""
    codes = codes_in_context()
    if codes is None:
        return paths.default(*args, **kwargs)
    rows = codes[:count, column]
    kernel_rows = (rows == KERNEL) | (rows == REQUIRED)
    if paths.default_is_kernel:
        kernel_rows = kernel_rows | (rows == DEFAULT)
    if paths.kernel_code >= VARIANTS:  # a variant naming the kernel's own provider
        kernel_rows = kernel_rows | (rows == paths.kernel_code)
    kernel_out = _run(paths.kernel, args, kwargs, clone, count)
    joined = _joined(kernel_rows, kernel_out, paths.original(*args, **kwargs), count, caller)
    for code in paths.traced_variants:
        found = paths.variant(code)
        if found is not None:
            joined = _joined(rows == code, found[1](*args, **kwargs), joined, count, caller)
    return joined


def _uniform(code: int, paths: Paths, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One eager call whose rows all have ``code``: that path alone."""
    if code == DEFAULT:
        return paths.default(*args, **kwargs)
    found = paths.path(code)
    if found is None:
        return paths.original(*args, **kwargs)
    return _alone(found[1], found[2], None, paths, args, kwargs)


def _alone(
    name: str,
    function: Callable[..., Any],
    rows: torch.Tensor | None,
    paths: Paths,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``function`` (a kernel or a variant) on every row of the call; where it raises, the requests of ``rows``
    (None: of the step) fail and the original runs instead."""
    try:
        return function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001  # any kernel error fails its rows' requests, not the step
        STEP.fail(rows, name, error)
        return paths.original(*args, **kwargs)


def _run(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], clone: bool, count: int) -> Any:
    """``function``'s output on the call's tensors (on clones of those with the call's rows where ``clone``: a
    kernel that writes in place never touches what another path reads)."""
    if clone:
        args, kwargs = map_tensors((args, kwargs), lambda t: t.clone() if _rows_of(t, count) else t)
    return function(*args, **kwargs)


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

"""Execution-state detection: eager, or which tracer is running.

This module owns the answer to "can a kernel that is not traceable run now?",
on every supported torch: the readers are chosen once, at import, from what
the installed torch provides (see ``_compat``), not from its version.

=========== =========================================================
state       detected by
=========== =========================================================
``compile`` TorchDynamo is tracing (``torch.compile``, strict export);
            ``torch.compiler.is_dynamo_compiling()`` folds to True there
``export``  ``torch.export`` (strict or not): ``torch.compiler``'s
            export flag, which export sets before tracing
``fx``      ``torch.fx.symbolic_trace``: the tracer's flag (a module
            global up to torch 2.13, thread-local from 2.14)
``jit``     ``torch.jit.trace`` and the TorchScript ONNX exporter:
            ``nn.Module`` routes calls through ``_slow_forward`` while
            tracing, which policy-aware layers override (see
            ``_binding``); :func:`execution_state` asks the
            tracer
``eager``   none of the above
=========== =========================================================

A ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``jvp``,
``functional_call`` under one of them) is not a tracer: its Python runs as
eager code, on wrapped tensors, so the state is ``eager`` and every mode
takes its eager path. One thing differs, and :func:`in_transform` tells it:
``verify`` does not compare there (under ``vmap`` a comparison would branch
on batched values, which vmap forbids), it runs the kernel as ``prefer``
does, logs that once per layer and records the reason.

Order matters: the Dynamo check must come first. Under Dynamo the
``torch.compiler._is_compiling_flag`` global reads True at trace time and
False at run time, so reading it in traced code would recompile every call.
Non-strict export sets the compile flag and the fx flag too, so the export
check comes before both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal

import torch
import torch.compiler as _compiler
import torch.fx._symbolic_trace as _fx
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._compat._compat import COMPILING_FLAG, EXPORTING_FLAG, FUNCTORCH_STACK, FX_TRACING, first_present, lookup

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "READERS",
    "TRACING_CHECK",
    "TRACING_NAMES",
    "ExecutionState",
    "execution_state",
    "fx_tracing",
    "in_transform",
    "traced_state",
]

ExecutionState = Literal["eager", "compile", "export", "jit", "fx"]


def _fx_reader() -> str:
    found = first_present(FX_TRACING)
    if found == FX_TRACING.names[0]:
        return "_fx._is_fx_tracing_flag"
    if found == FX_TRACING.names[1]:
        # A thread-local: ``__dict__.get`` (about 50 ns) rather than ``getattr(..., "flag", False)``,
        # which raises and catches AttributeError in every thread that never traced (about 500 ns).
        return '_fx._is_fx_tracing_tls.__dict__.get("flag", False)'
    return "_fx.is_fx_symbolic_tracing()"


#: The source of each flag reader on this torch (``python -m kernelpolicy doctor`` prints them).
READERS: Final[dict[str, str]] = {
    "compile": "_compiler._is_compiling_flag" if first_present(COMPILING_FLAG) else "_compiler.is_compiling()",
    "export": "_compiler._is_exporting_flag" if first_present(EXPORTING_FLAG) else "_compiler.is_exporting()",
    "fx": _fx_reader(),
}

#: The hot path's check outside TorchDynamo's traced code, true under ``torch.compile``'s run-time flag,
#: non-strict export and fx, as source over :data:`TRACING_NAMES`: ``_dispatch`` inlines it into the
#: generated forwards (a function call costs as much as the check), after they have asked
#: ``_is_dynamo()`` once. Policy-aware layers learn about jit tracing from ``_slow_forward`` instead,
#: which costs nothing in eager mode.
TRACING_CHECK: Final = f"{READERS['compile']} or {READERS['fx']}"
TRACING_NAMES: Final[dict[str, Any]] = {"_is_dynamo": _is_dynamo, "_compiler": _compiler, "_fx": _fx}


def _reader(source: str) -> Any:
    return eval(f"lambda: {source}", {"__builtins__": {}, **TRACING_NAMES})  # fixed sources, above


_HAS_EXPORT_FLAG: Final = READERS["export"] == "_compiler._is_exporting_flag"
_exporting = _reader(READERS["export"])
_compiling = _reader(READERS["compile"])
_fx_tracing = _reader(READERS["fx"])
#: Whether FX traces (``symbolic_trace``, and non-strict export under it), in eager code: the flag alone.
fx_tracing: Callable[[], bool] = _fx_tracing
_get_tracing_state = torch._C._get_tracing_state  # see _compat.JIT_TRACING_STATE


def execution_state() -> ExecutionState:
    """The execution state of the current call.

    >>> from kernelpolicy.introspect import execution_state
    >>> execution_state()
    'eager'
    """
    if _is_dynamo():
        # Traced code. Dynamo folds ``torch.compiler.is_exporting()`` to True under plain
        # ``torch.compile`` before torch 2.13 (seen on 2.9.1); it reads the flag itself as a guarded global.
        exporting = _compiler._is_exporting_flag if _HAS_EXPORT_FLAG else _compiler.is_exporting()
        return "export" if exporting else "compile"
    if _exporting():
        return "export"
    if _compiling():
        return "compile"
    if _fx_tracing():
        return "fx"
    if _get_tracing_state() is not None:
        return "jit"
    return "eager"


def traced_state() -> Literal["compile", "export"]:
    """What TorchDynamo traces for, asked by code it calls while tracing (not traced itself).

    Strict ``torch.export`` (which sets the export flag before TorchDynamo traces), else ``torch.compile``.
    """
    return "export" if _exporting() else "compile"


_peek_transforms = lookup(FUNCTORCH_STACK.names[0]) if first_present(FUNCTORCH_STACK) else (lambda: None)


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...) is running the current call.

    >>> import torch
    >>> from kernelpolicy._context._state import in_transform
    >>> in_transform(), torch.func.vmap(lambda x: x * in_transform())(torch.ones(2)).tolist()
    (False, [1.0, 1.0])
    """
    return _peek_transforms() is not None

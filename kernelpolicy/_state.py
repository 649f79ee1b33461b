"""Execution-state detection: eager, or which tracer is running.

This module owns the answer to "can a kernel that is not traceable run now?".

=========== =========================================================
state       detected by
=========== =========================================================
``compile`` TorchDynamo is tracing (``torch.compile``, strict export);
            ``torch.compiler.is_dynamo_compiling()`` folds to True there
``export``  ``torch.export`` (strict or not): ``torch.compiler`` flags
``fx``      ``torch.fx.symbolic_trace``: the tracer's module flag
``jit``     ``torch.jit.trace`` and the TorchScript ONNX exporter:
            ``nn.Module`` routes calls through ``_slow_forward`` while
            tracing, which policy-aware layers override (see
            ``_binding``); :func:`execution_state` also asks the tracer
``eager``   none of the above
=========== =========================================================

Order matters: the Dynamo check must come first. Under Dynamo the
``torch.compiler._is_compiling_flag`` global reads True at trace time and
False at run time, so reading it in traced code would recompile every call.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.compiler as _compiler
import torch.fx._symbolic_trace as _fx
from torch.compiler import is_dynamo_compiling as _is_dynamo

__all__ = ["TRACING_CHECK", "TRACING_NAMES", "ExecutionState", "execution_state", "is_tracing"]

ExecutionState = Literal["eager", "compile", "export", "jit", "fx"]
_get_tracing_state = torch._C._get_tracing_state

#: The hot path's check, true under any tracer except ``torch.jit.trace``, as
#: source over :data:`TRACING_NAMES`: ``_dispatch`` inlines it into the
#: generated forwards (a function call costs as much as the check). Policy-aware
#: layers learn about jit tracing from ``_slow_forward`` instead, which costs
#: nothing in eager mode.
TRACING_CHECK = "_is_dynamo() or _compiler._is_compiling_flag or _fx._is_fx_tracing_flag"
TRACING_NAMES: dict[str, Any] = {"_is_dynamo": _is_dynamo, "_compiler": _compiler, "_fx": _fx}


def is_tracing() -> bool:
    """:data:`TRACING_CHECK` as a function."""
    return bool(eval(TRACING_CHECK, {"__builtins__": {}}, TRACING_NAMES))


def execution_state() -> ExecutionState:
    """The execution state of the current call.

    >>> from kernelpolicy import execution_state
    >>> execution_state()
    'eager'
    """
    if _is_dynamo():
        return "export" if _compiler.is_exporting() else "compile"
    if _compiler._is_exporting_flag:
        return "export"
    if _compiler._is_compiling_flag:
        return "compile"
    if _fx._is_fx_tracing_flag:
        return "fx"
    if _get_tracing_state() is not None:
        return "jit"
    return "eager"

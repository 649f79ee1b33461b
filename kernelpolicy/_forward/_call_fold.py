"""The call fold: ``module(...)`` of a policy-aware module in one frame, as kernels' direct binding costs.

This module owns :func:`_aware_call`, which policy-aware classes get as ``__call__`` where torch's
``nn.Module.__call__`` path reads exactly the names it was checked against (:data:`FAST_CALL`; the doctor
reports it), and the frame kernelpolicy's bindings hide from TorchDynamo.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.nn.modules.module import (  # the names nn.Module._call_impl reads, for _aware_call
    Module,
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)

from .._compat import _compat

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["FAST_CALL", "torch_call_names"]


_CALL_NAMES = ("__call__", "_wrapped_call_impl", "_call_impl")


def _aware_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(...)`` for a policy-aware module: ``nn.Module.__call__`` in one frame.

    ``nn.Module.__call__`` (``_wrapped_call_impl``) calls ``_call_impl``,
    which calls ``forward``: with kernelpolicy's dispatching ``forward`` that
    is one Python frame more than ``kernels``' direct binding. This is the
    fast path of those two frames (torch 2.13, ``nn.Module._call_impl``):
    with no compiled call (``module.compile()``), no jit tracer and no module
    or global hook, call ``forward``. In every other case, and whenever
    something has patched ``nn.Module.__call__`` (``torch.fx`` tracing does),
    it calls ``nn.Module.__call__`` itself, so hooks, ``_slow_forward`` and
    patchers run exactly as without it.

    The function runs with the globals of ``torch.nn.modules.module`` (see
    below), so TorchDynamo reads the global hook dicts, ``Module`` and
    ``torch`` from the same source as in ``nn.Module._call_impl``: no
    aliasing guards between the two.
    """
    if (
        self._compiled_call_impl is not None
        or torch._C._get_tracing_state()
        or self._backward_hooks
        or self._backward_pre_hooks
        or self._forward_hooks
        or self._forward_pre_hooks
        or _global_backward_pre_hooks
        or _global_backward_hooks
        or _global_forward_hooks
        or _global_forward_pre_hooks
        or Module.__call__ is not Module._wrapped_call_impl
    ):
        return Module.__call__(self, *args, **kwargs)
    return self.forward(*args, **kwargs)


def _with_torch_globals(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` rebuilt over the globals of ``torch.nn.modules.module``, which define all it reads."""
    namespace = vars(_torch_module)
    for name in function.__code__.co_names:
        if name in function.__globals__ and namespace.get(name) is not function.__globals__[name]:
            raise RuntimeError(f"torch.nn.modules.module.{name} is not what kernelpolicy expects")  # pragma: no cover
    rebuilt = types.FunctionType(function.__code__, namespace, function.__name__)
    rebuilt.__qualname__ = function.__qualname__
    rebuilt.__module__ = function.__module__
    rebuilt.__doc__ = function.__doc__
    return rebuilt


_aware_call = _with_torch_globals(_aware_call)


_FRAME_SKIPPED = False


def _skip_as_dynamo_frame() -> None:
    """Have TorchDynamo skip ``_aware_call`` as a frame, as it skips ``nn.Module.__call__``.

    A compiled region that resumes in eager code after a graph break converts the frames it then enters:
    for a plain module it starts at ``forward``; at ``_aware_call`` it would trace the call path and its
    hooks (FSDP2's pre-forward hook is ``torch._dynamo.disable``d: one more graph break). Skipping the
    frame (``torch._dynamo.eval_frame.skip_code``; inlining in traced code is unaffected) restores torch's
    behaviour. Done once Dynamo is imported, at the first binding after that (Dynamo takes over a second to
    import, so kernelpolicy never imports it).
    """
    global _FRAME_SKIPPED
    if _FRAME_SKIPPED:
        return
    module = _compat.DYNAMO_SKIP_CODE.names[0].rpartition(".")[0]
    skip = _compat.resolve(_compat.DYNAMO_SKIP_CODE) if module in sys.modules else None  # told if it moved
    if skip is not None:
        skip(_aware_call.__code__)
        _FRAME_SKIPPED = True


# The names ``nn.Module._wrapped_call_impl`` and ``_call_impl`` read in the
# torch versions whose fast path ``_aware_call`` reproduces: 2.9 to 2.14, and
# 2.15, which asks ``torch._C._is_tracing()`` where earlier releases asked
# ``_get_tracing_state()`` (the same answer; ``_aware_call`` asks the latter,
# present in both). A torch whose call path reads anything else (a new hook
# dict, say) gets no ``__call__`` override: correct, one frame slower.
# ``python -m kernelpolicy doctor`` reports which.
_CALL_NAMES_2_9 = frozenset(
    {
        "_C", "_backward_hooks", "_backward_pre_hooks", "_call_impl", "_compiled_call_impl", "_forward_hooks",
        "_forward_hooks_always_called", "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_get_tracing_state",
        "_global_backward_hooks", "_global_backward_pre_hooks", "_global_forward_hooks",
        "_global_forward_hooks_always_called", "_global_forward_pre_hooks", "_slow_forward", "compiler",
        "Exception", "forward", "is_compiling", "items", "set", "str", "torch", "warn", "warnings",
    }
)  # fmt: skip
_CHECKED_CALL_NAMES: Final = (_CALL_NAMES_2_9, _CALL_NAMES_2_9 - {"_get_tracing_state"} | {"_is_tracing"})


def torch_call_names() -> frozenset[str]:
    """The global and attribute names torch's ``nn.Module.__call__`` path reads."""
    return frozenset(Module._wrapped_call_impl.__code__.co_names) | frozenset(Module._call_impl.__code__.co_names)


#: Whether policy-aware classes get :func:`_aware_call` on this torch.
FAST_CALL: Final = torch_call_names() in _CHECKED_CALL_NAMES


def _plain_call(cls: type[nn.Module]) -> bool:
    """Whether ``cls`` calls like ``nn.Module`` (no ``__call__`` or ``_call_impl`` of its own)."""
    return all(getattr(cls, name, None) is getattr(Module, name) for name in _CALL_NAMES)

"""kernelpolicy: decide at every forward call whether a layer runs its kernel.

Hugging Face ``kernels`` binds a hub kernel to a layer once, ahead of time.
kernelpolicy makes that binding obey a policy read at every call, from a
:class:`contextvars.ContextVar` together with the trace/compile state:

>>> import torch, kernelpolicy
>>> @kernelpolicy.use_kernel_forward_from_hub("Double")
... class Double(torch.nn.Module):
...     def forward(self, x):
...         return 2 * x
>>> layer = Double()
>>> with kernelpolicy.kernels_disabled():
...     layer(torch.ones(1))
tensor([2.])

Importing kernelpolicy does not import ``kernels`` or ``huggingface_hub``, nor ``torch``
until a name that needs it (``attach``, ``kernelize``, ...) is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._active import current_policy, known_layers
from ._autoattach import auto_attach
from ._errors import (
    KernelMismatchError,
    KernelUnavailableError,
    OriginalUnavailableError,
    PolicyError,
    ScopeError,
)
from ._policy import Policy, PolicyMode
from ._scope import kernel_policy, kernels_disabled, propagate, set_default_policy

if TYPE_CHECKING:
    from ._accounting import CallCounts, record_calls
    from ._attach import (
        attach,
        kernel_accepts,
        kernelize,
        replace_kernel_forward_from_hub,
        reset_failures,
        use_kernel_forward_from_hub,
    )
    from ._explain import Explanation, LayerRow, explain, will_use_kernel
    from ._state import ExecutionState, execution_state
    from ._warmup import WarmupReport, warmup

__version__ = "0.1.0"

# What needs torch is imported on first use, so that policies and scopes (and
# the pytest plugin, loaded in every pytest run where kernelpolicy is
# installed) cost no torch import; tools no forward needs likewise (import
# time: see benchmarks, section "import").
_LAZY = {
    "attach": "._attach",
    "kernel_accepts": "._attach",
    "kernelize": "._attach",
    "replace_kernel_forward_from_hub": "._attach",
    "reset_failures": "._attach",
    "use_kernel_forward_from_hub": "._attach",
    "ExecutionState": "._state",
    "execution_state": "._state",
    "CallCounts": "._accounting",
    "record_calls": "._accounting",
    "Explanation": "._explain",
    "LayerRow": "._explain",
    "explain": "._explain",
    "will_use_kernel": "._explain",
    "WarmupReport": "._warmup",
    "warmup": "._warmup",
}


#: Features that plug into the core through its hook lists (``_attach.ATTACH_HOOKS``, ``_aware.NO_ORIGINAL``,
#: ``_explain.ROW_SOURCES`` and ``UNGOVERNED_SOURCES``) when imported: imported here, with the first name
#: that needs torch, so that they are in place before any module is bound or explained.
_FEATURES = ("._transformers", ".training", ".batching")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelpolicy' has no attribute {name!r}")
    for feature in _FEATURES:
        importlib.import_module(feature, __name__)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "CallCounts",
    "ExecutionState",
    "Explanation",
    "KernelMismatchError",
    "KernelUnavailableError",
    "LayerRow",
    "OriginalUnavailableError",
    "Policy",
    "PolicyError",
    "PolicyMode",
    "ScopeError",
    "WarmupReport",
    "attach",
    "auto_attach",
    "current_policy",
    "execution_state",
    "explain",
    "kernel_accepts",
    "kernel_policy",
    "kernelize",
    "kernels_disabled",
    "known_layers",
    "propagate",
    "record_calls",
    "replace_kernel_forward_from_hub",
    "reset_failures",
    "set_default_policy",
    "use_kernel_forward_from_hub",
    "warmup",
    "will_use_kernel",
]

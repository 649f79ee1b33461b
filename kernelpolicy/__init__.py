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
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import TYPE_CHECKING, Any

from ._attach._autoattach import auto_attach
from ._context._active import current_policy
from ._context._propagate import propagate
from ._context._scope import kernel_policy, kernels_disabled, set_default_policy
from ._values._errors import KernelMismatchError, KernelUnavailableError, PolicyError
from ._values._policy import Policy

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from . import errors as errors
    from . import introspect as introspect
    from . import types as types
    from ._attach._attach import (
        attach,
        kernel_accepts,
        kernelize,
        replace_kernel_forward_from_hub,
        reset_failures,
        use_kernel_forward_from_hub,
    )
    from ._tell._accounting import record_calls
    from ._tell._explain import explain, will_use_kernel
    from ._tell._warmup import warmup

__version__ = "0.1.0"

# What needs torch is imported on first use, so that policies and scopes (and
# the pytest plugin, loaded in every pytest run where kernelpolicy is
# installed) cost no torch import; tools no forward needs likewise (import
# time: see benchmarks, section "import").
_LAZY = {
    "attach": "._attach._attach",
    "kernel_accepts": "._attach._attach",
    "kernelize": "._attach._attach",
    "replace_kernel_forward_from_hub": "._attach._attach",
    "reset_failures": "._attach._attach",
    "use_kernel_forward_from_hub": "._attach._attach",
    "record_calls": "._tell._accounting",
    "explain": "._tell._explain",
    "will_use_kernel": "._tell._explain",
    "warmup": "._tell._warmup",
}
#: The public submodules reached as attributes (``kernelpolicy.errors.ScopeError``), imported on first use.
_SUBMODULES = frozenset({"errors", "introspect", "types"})
#: Names that were top-level before 0.1.0 and moved (CHANGELOG): still found here, with a DeprecationWarning.
_MOVED = {
    "CallCounts": "types",
    "Explanation": "types",
    "LayerRow": "types",
    "WarmupReport": "types",
    "ExecutionState": "types",
    "PolicyMode": "types",
    "execution_state": "introspect",
    "known_layers": "introspect",
    "ScopeError": "errors",
    "OriginalUnavailableError": "errors",
}


#: Private modules the house in wings (0.1.0, issue 42) moved into folders, whose old names pickles of earlier
#: builds carry (the functions that rebuild a policy, an error, a propagated function, a policy-aware module):
#: the old name still imports the module where it lives now, on first use, so that those pickles load.
_MOVED_MODULES = {
    "kernelpolicy._policy": "kernelpolicy._values._policy",
    "kernelpolicy._errors": "kernelpolicy._values._errors",
    "kernelpolicy._propagate": "kernelpolicy._context._propagate",
    "kernelpolicy._aware": "kernelpolicy._attach._copies",  # pickles name its _restore, _restore_reduced
}


class _Forwarding(MetaPathFinder, Loader):
    """The finder and loader of the old names in :data:`_MOVED_MODULES` (on :data:`sys.meta_path`)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        return ModuleSpec(fullname, self) if fullname in _MOVED_MODULES else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(_MOVED_MODULES[spec.name])  # the module itself, under its old name too

    def exec_module(self, module: ModuleType) -> None:
        pass  # imported already, by create_module


if not any(isinstance(finder, _Forwarding) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Forwarding())  # first: the old name means the moved module, whatever else is found

#: Features that plug into the core through its hook lists (``_attach.ATTACH_HOOKS``, ``_aware.NO_ORIGINAL``,
#: ``_explain.ROW_SOURCES`` and ``UNGOVERNED_SOURCES``) when imported: imported here, with the first name
#: that needs torch, so that they are in place before any module is bound or explained.
_FEATURES = ("._transformers", ".training", ".batching")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:
        from ._values._errors import warn_at_caller

        where = f"kernelpolicy.{_MOVED[name]}"
        warn_at_caller(
            f"kernelpolicy.{name} moved to {where}.{name}; the top-level name goes in 0.2", DeprecationWarning
        )
        return getattr(importlib.import_module(where), name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelpolicy' has no attribute {name!r}")
    for feature in _FEATURES:
        importlib.import_module(feature, __name__)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBMODULES])


__all__ = [
    "KernelMismatchError",
    "KernelUnavailableError",
    "Policy",
    "PolicyError",
    "attach",
    "auto_attach",
    "current_policy",
    "explain",
    "kernel_accepts",
    "kernel_policy",
    "kernelize",
    "kernels_disabled",
    "propagate",
    "record_calls",
    "replace_kernel_forward_from_hub",
    "reset_failures",
    "set_default_policy",
    "use_kernel_forward_from_hub",
    "warmup",
    "will_use_kernel",
]

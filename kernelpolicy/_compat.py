"""What kernelpolicy needs of the installed torch and kernels: releases and private names.

This module owns the supported release ranges (:data:`SUPPORTED`, the same
as ``pyproject.toml``'s and the CI matrix's), checked by
:func:`check_torch` when the layer machinery loads and by :func:`kernels`
on first use of ``kernels``, and :data:`INTERNALS`, the one list of every private name
kernelpolicy relies on, and :func:`probe`, which looks each of them up in the
installed packages (by attribute, never by version string). Code elsewhere
that reads a private name names it here, so that a release that moves one is
caught by ``python -m kernelpolicy doctor`` and by ``tests/test_compat.py``,
which name what moved, and not in a user's forward.

An entry with several names is satisfied by the first one present (a name
that moved between releases); ``fallback`` says what kernelpolicy does when
none is, or is None when the feature cannot work without it.

>>> from kernelpolicy._compat import probe
>>> all(found.present for found in probe())
True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import warnings
from importlib import metadata
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "INTERNALS",
    "SUPPORTED",
    "Found",
    "Internal",
    "UnsupportedVersionError",
    "check_torch",
    "check_version",
    "kernels",
    "lookup",
    "probe",
]

#: Release ranges kernelpolicy is tested with, ``(lowest, first untested)``:
#: older releases are refused, newer ones warn once (run the doctor).
SUPPORTED: Final[dict[str, tuple[str, str]]] = {
    "torch": ("2.9", "2.16"),
    "kernels": ("0.16", "0.18"),
}


class UnsupportedVersionError(ImportError):
    """An installed release older than kernelpolicy supports."""


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_version(package: str, installed: str) -> None:
    """Refuse a release older than :data:`SUPPORTED` says, warn once for one newer than tested.

    >>> check_version("kernels", "0.12.3")
    Traceback (most recent call last):
    ...
    kernelpolicy._compat.UnsupportedVersionError: kernelpolicy needs kernels>=0.16,<0.18 (tested); installed: kernels 0.12.3. Install a supported release: pip install 'kernels>=0.16,<0.18'
    """
    low, high = SUPPORTED[package]
    spec = f"{package}>={low},<{high}"
    release = _release(installed)
    if release < _release(low):
        raise UnsupportedVersionError(
            f"kernelpolicy needs {spec} (tested); installed: {package} {installed}. "
            f"Install a supported release: pip install '{spec}'"
        )
    if release >= _release(high) and package not in _warned:
        _warned.add(package)
        warnings.warn(
            f"kernelpolicy is tested with {spec}; installed: {package} {installed}. "
            "Run `python -m kernelpolicy doctor` to check this release.",
            stacklevel=3,
        )


_warned: set[str] = set()


def check_torch() -> None:
    """:func:`check_version` for the imported torch."""
    import torch

    check_version("torch", str(torch.__version__))


@functools.cache
def kernels() -> ModuleType:
    """The ``kernels`` package, once its release is checked (a refused release raises at every call)."""
    module = importlib.import_module("kernels")
    check_version("kernels", metadata.version("kernels"))
    return module


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private dependency: what it is for, the names that provide it, and the fallback."""

    used_for: str
    names: tuple[str, ...]
    fallback: str | None = None


@dataclasses.dataclass(frozen=True)
class Found:
    """What :func:`probe` found for one :class:`Internal`: the first name present, or None."""

    internal: Internal
    name: str | None

    @property
    def present(self) -> bool:
        return self.name is not None

    def __str__(self) -> str:
        if self.name is not None:
            return f"{self.internal.used_for}: {self.name}"
        names = " or ".join(self.internal.names)
        effect = f"falls back to {self.internal.fallback}" if self.internal.fallback else "cannot work"
        return f"{self.internal.used_for}: MISSING {names}; kernelpolicy {effect}"


_FX = "torch.fx._symbolic_trace"
_MODULE = "torch.nn.modules.module"

#: Hot-path trace checks (see ``_state``).
COMPILING_FLAG = Internal(
    "compile and non-strict export flag, read by the forwards",
    ("torch.compiler._is_compiling_flag",),
    "torch.compiler.is_compiling() (a function call more per forward)",
)
EXPORTING_FLAG = Internal(
    "non-strict export flag, read by execution_state",
    ("torch.compiler._is_exporting_flag",),
    "torch.compiler.is_exporting()",
)
FX_TRACING = Internal(
    "fx symbolic tracing flag, read by the forwards",
    # torch <= 2.13: a module global; torch >= 2.14: a thread-local whose attribute ``flag`` is set by
    # ``_set_is_fx_tracing`` (absent in a thread that never traced).
    (f"{_FX}._is_fx_tracing_flag", f"{_FX}._is_fx_tracing_tls"),
    f"{_FX}.is_fx_symbolic_tracing() (slower; False under non-strict export, which the compile flag covers)",
)
JIT_TRACING_STATE = Internal(
    "torch.jit.trace state (nn.Module call path and policy-aware _slow_forward)",
    ("torch._C._get_tracing_state",),
)
JIT_SCOPES = Internal(
    "module scopes in jit-traced graphs",
    ("torch.jit._trace._trace_module_map",),
    "jit graphs of policy-aware layers lose their module scope names",
)
SLOW_FORWARD = Internal("calls under torch.jit.trace route through it", ("torch.nn.Module._slow_forward",))
CALL_PATH = tuple(
    Internal("module(...) fast path (FAST_CALL)", (name,), "module(...) goes through nn.Module.__call__")
    for name in (
        f"{_MODULE}.Module._wrapped_call_impl",
        f"{_MODULE}.Module._call_impl",
        f"{_MODULE}._global_forward_hooks",
        f"{_MODULE}._global_forward_pre_hooks",
        f"{_MODULE}._global_backward_hooks",
        f"{_MODULE}._global_backward_pre_hooks",
    )
)
GRAPH_BREAK = Internal(
    "require under torch.compile: a graph break that carries the error", ("torch._dynamo.graph_break",)
)
#: Not a name to look up but an attribute TorchDynamo reads on functions (``torch.compiler.disable``
#: sets it); ``_dispatch`` sets it on the function that raises ``require``'s error under compile.
#: ``tests/test_tracing.py`` (require, fullgraph=False) fails if Dynamo stops honouring it.
DYNAMO_DISABLE_MARK = "_torchdynamo_disable"
#: Likewise: the mark ``torch._dynamo.assume_constant_result`` sets (Dynamo calls such a function at trace
#: time and folds its result in without a guard); ``_persisted`` sets it on its trace-time predicates.
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"
#: ``torch._dynamo.config``'s switch of caching precompile, read by ``_persisted`` (a torch without it has
#: no caching precompile, so a missing name is no fault and not in :data:`INTERNALS`).
CACHING_PRECOMPILE = "caching_precompile"
TRACING_CONTEXT = Internal(
    "persisted programs: one policy check per layer name and traced frame (TorchDynamo's context of the trace)",
    ("torch._guards.TracingContext.try_get",),
    "a persisted program checks the policy after every policy-aware layer (about 5 us each)",
)
DYNAMO_COUNTERS = Internal("doctor and tests count graph breaks", ("torch._dynamo.utils.counters",))
FUNCTORCH_STACK = Internal(
    "verify: whether a torch.func transform (vmap, grad, ...) runs the call",
    ("torch._C._functorch.peek_interpreter_stack",),
    "verify compares under torch.func transforms too (under vmap that comparison fails)",
)
KERNELS_LAYER_CACHE = Internal(
    "explain: which kernel repository a bound kernel came from; the warning about modules kernels bound "
    "before kernelpolicy looked",
    ("kernels.layer.layer._CACHED_LAYER",),
    "explain shows the kernel class without its repository; modules bound before go unnoticed",
)
KERNELS_BIND = Internal(
    "auto_attach, and the warning about modules kernels bound outside kernelpolicy: the function every "
    "kernelize path binds a layer's forward with, as _replace_forward(module, layer)",
    ("kernels.layer.layer._replace_forward",),
    "attach(model) by hand (auto_attach raises; no warning about modules left unattached)",
)
KERNELIZE_MODEL = Internal(
    "auto_attach names modules and runs attach's model features: kernels' kernelize, whose argument "
    "'model' is read off its frame",
    ("kernels.layer.kernelize.kernelize",),
    "modules auto_attach makes policy-aware without a name, hub attention or checkpointing",
)

#: Every private name kernelpolicy reads.
INTERNALS: tuple[Internal, ...] = (
    COMPILING_FLAG,
    EXPORTING_FLAG,
    FX_TRACING,
    JIT_TRACING_STATE,
    JIT_SCOPES,
    SLOW_FORWARD,
    *CALL_PATH,
    GRAPH_BREAK,
    TRACING_CONTEXT,
    DYNAMO_COUNTERS,
    FUNCTORCH_STACK,
    KERNELS_LAYER_CACHE,
    KERNELS_BIND,
    KERNELIZE_MODEL,
)

_MISSING = object()


def lookup(dotted: str) -> Any:
    """The object at ``dotted`` (a module path, then attributes), or raise ``LookupError`` naming it."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute, _MISSING)
            if value is _MISSING:
                raise LookupError(f"{dotted}: {'.'.join(parts[:split])} has no attribute path {attribute!r}")
        return value
    raise LookupError(f"{dotted}: no module {parts[0]!r}")


def first_present(internal: Internal) -> str | None:
    """The first of ``internal.names`` present in the installed packages, or None."""
    for name in internal.names:
        try:
            lookup(name)
        except LookupError:
            continue
        return name
    return None


def probe() -> tuple[Found, ...]:
    """Look up every entry of :data:`INTERNALS`."""
    return tuple(Found(internal, first_present(internal)) for internal in INTERNALS)

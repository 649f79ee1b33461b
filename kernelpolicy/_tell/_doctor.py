"""``python -m kernelpolicy doctor``: check kernelpolicy's footing on the installed torch.

This module owns :func:`doctor`. Three things rest on details of torch, so
the doctor checks them for real on this install:

- the private names kernelpolicy reads (``_compat.INTERNALS``): each one
  present, or what kernelpolicy falls back to;
- trace-state detection (``_state``): ``execution_state()`` inside a forward
  run by ``torch.compile``, ``torch.export`` (strict and non-strict),
  ``torch.fx.symbolic_trace`` and ``torch.jit.trace`` names that tracer;
- the compile path, which rests on TorchDynamo tracing and guarding a read
  of ``property(ContextVar.get)`` (see ``_active``): one compiled model,
  ``fullgraph=True``, called under alternating policies in this thread and in
  a fresh thread, must follow each policy with no graph break, no stale graph
  and exactly one compile per distinct policy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
import threading
import types
from importlib import metadata
from typing import Any

import torch
from torch import nn

from .._attach._attach import attach
from .._compat._compat import probe
from .._compat._versions import SUPPORTED
from .._context import _state
from .._context._scope import kernel_policy, kernels_disabled
from .._forward._call_fold import _CHECKED_CALL_NAMES, FAST_CALL, torch_call_names

__all__ = ["DoctorReport", "doctor"]

MECHANISM = (
    "policy read as DEFAULTS.active._current, a property whose getter is ContextVar.get "
    "(traced and guarded by TorchDynamo; no direct ContextVar.get call in traced code)"
)


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found; ``ok`` is True when every check passed."""

    versions: dict[str, str]
    #: Whether transformers runs hub kernels with the installed kernels, and why (a line for users).
    transformers: str
    mechanism: str
    native_contextvar_get: bool
    fast_call: str
    internals: tuple[str, ...]
    readers: dict[str, str]
    checks: tuple[tuple[str, bool, str], ...]

    @property
    def ok(self) -> bool:
        return all(passed for _, passed, _ in self.checks)

    def __str__(self) -> str:
        """The verdict for users: versions, transformers' integration, one line per check."""
        lines = [
            "kernelpolicy doctor",
            "  " + ", ".join(f"{name} {version}" for name, version in self.versions.items()),
        ]
        lines.append(f"  transformers: {self.transformers}")
        lines += [f"  [{'ok' if passed else 'FAIL'}] {name}" for name, passed, _ in self.checks]
        lines.append(
            "result: "
            + (
                "all checks passed: policies reach eager, traced and compiled calls on this torch"
                if self.ok
                else "SOME CHECKS FAILED (python -m kernelpolicy doctor --verbose shows why)"
            )
        )
        return "\n".join(lines)

    def verbose(self) -> str:
        """Everything, for maintainers: the mechanism, the private names read and each check's detail."""
        lines = ["kernelpolicy doctor"]
        lines += [f"  {name}: {version}" for name, version in self.versions.items()]
        lines.append(f"  transformers: {self.transformers}")
        lines.append(f"  mechanism: {self.mechanism}")
        native = "yes" if self.native_contextvar_get else "no (not needed)"
        lines.append(f"  Dynamo traces ContextVar.get natively: {native}")
        lines.append(f"  module(...) fast path: {self.fast_call}")
        lines.append("  trace-state readers: " + ", ".join(f"{k}: {v}" for k, v in self.readers.items()))
        lines.append("  private names read:")
        lines += [f"    {line}" for line in self.internals]
        for name, passed, detail in self.checks:
            lines.append(f"  [{'ok' if passed else 'FAIL'}] {name}: {detail}")
        lines.append("result: " + ("all checks passed" if self.ok else "SOME CHECKS FAILED"))
        return "\n".join(lines)


class _DoctorLayer(nn.Module):
    kernel_layer_name = "KernelpolicyDoctor"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _DoctorKernel(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 100


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _native_contextvar_get() -> bool:
    import contextvars

    var: contextvars.ContextVar[int] = contextvars.ContextVar("kernelpolicy_doctor", default=1)

    def read(x: torch.Tensor) -> torch.Tensor:
        return x + var.get()

    try:
        torch.compile(read, backend="eager", fullgraph=True)(torch.zeros(1))
    except Exception:  # noqa: BLE001 - any failure means "not supported"
        return False
    return True


def _fast_call() -> str:
    if FAST_CALL:
        return "on (policy-aware classes fold nn.Module.__call__ and _call_impl into one frame)"
    names = torch_call_names()
    closest = min(_CHECKED_CALL_NAMES, key=lambda checked: len(checked ^ names))
    changed = sorted(names ^ closest)
    return (
        f"off: this torch's nn.Module call path differs from the one checked in names {changed}; "
        "module(...) goes through nn.Module.__call__ (correct, one Python frame slower)"
    )


_STATES = ("eager", "compile", "export", "jit", "fx")


class _StateProbe(nn.Module):
    """Adds the index of :func:`execution_state` in ``_STATES``: a constant each tracer bakes into its program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _STATES.index(_state.execution_state())


def _traced_states() -> dict[str, str]:
    """What ``execution_state()`` says inside a forward run by each tracer (its program's output)."""
    x = torch.zeros(1)
    runs: dict[str, Any] = {
        "eager": lambda: _StateProbe()(x),
        "compile": lambda: torch.compile(_StateProbe(), backend="eager", fullgraph=True)(x),
        "export": lambda: torch.export.export(_StateProbe(), (x,), strict=True).module()(x),
        "export (non-strict)": lambda: torch.export.export(_StateProbe(), (x,), strict=False).module()(x),
        "fx": lambda: torch.fx.symbolic_trace(_StateProbe())(x),
        "jit": lambda: torch.jit.trace(_StateProbe(), (x,), check_trace=False)(x),  # type: ignore[no-untyped-call]
    }
    seen: dict[str, str] = {}
    for tracer, run in runs.items():
        try:
            seen[tracer] = _STATES[int(run()[0])]
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            seen[tracer] = f"{type(exc).__name__}: {exc}"
    return seen


def _transformers_integration() -> str:
    """Whether transformers' hub-kernel integration is on with the installed kernels, and why not."""
    if importlib.util.find_spec("transformers") is None:
        return "not installed"
    try:
        from transformers.utils import import_utils
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"{_version('transformers')}, cannot be imported here ({type(exc).__name__}: {exc})"
    available = getattr(import_utils, "is_kernels_available", None)
    if available is None:
        return f"{_version('transformers')}, has no hub-kernel integration"
    versions = f"transformers {_version('transformers')} with kernels {_version('kernels')}"
    if available():
        return (
            f"hub kernels on ({versions}; kernelpolicy.auto_attach() before use_kernels=True, or attach(model) after)"
        )
    bounds = {
        name: parameter.default
        for name, parameter in inspect.signature(available).parameters.items()
        if parameter.default is not parameter.empty
    }
    wants = (
        f" (it enables them only with kernels >= {bounds['MIN_VERSION']}, < {bounds['MAX_VERSION']})"
        if {
            "MIN_VERSION",
            "MAX_VERSION",
        }
        <= bounds.keys()
        else ""
    )
    return (
        f"hub kernels OFF: {versions}{wants}; use_kernels=True silently does nothing. "
        f"kernelpolicy supports kernels >= {SUPPORTED['kernels'][0]}, < {SUPPORTED['kernels'][1]} "
        "(docs/transformers.md lists the transformers releases tested)"
    )


def _persistence() -> str:
    """Which persistence settings are on, and what each does with a policy (every one follows it or refuses).

    Read with ``getattr``: these are configuration flags, absent from some torch releases (then off). See
    docs/compile.md, "Persisted artifacts".
    """
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    precompile = bool(getattr(torch._dynamo.config, "caching_precompile", False))
    caches = [
        name
        for name, on in (
            ("FX graph cache", getattr(torch._inductor.config, "fx_graph_cache", False)),
            ("AOTAutograd cache", getattr(torch._functorch.config, "enable_autograd_cache", False)),
        )
        if on
    ]
    followed = f"{' and '.join(caches)} on (they follow the caller's policy)" if caches else "no graph cache on"
    if precompile:
        return (
            "Dynamo caching precompile is ON (TORCH_CACHING_PRECOMPILE): the programs it saves carry the policy "
            "they were traced under and refuse a caller whose policy takes another path (ArtifactPolicyError); "
            "compile under each policy you serve before saving (docs/compile.md#persisted-artifacts); " + followed
        )
    return f"caching precompile off; {followed}"


def doctor() -> DoctorReport:
    """Run the checks; see :class:`DoctorReport`."""
    from torch._dynamo.utils import counters

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "kernels": _version("kernels"),
        "kernelpolicy": _version("kernelpolicy"),
    }
    layer = _DoctorLayer()
    layer.forward = types.MethodType(_DoctorKernel.forward, layer)  # type: ignore[method-assign]  # as kernels does
    attach(layer)
    compiles = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiles[0] += 1
        return gm.forward

    torch.compiler.reset()
    breaks_before = sum(counters["graph_break"].values())
    x = torch.zeros(1)
    seen: list[float] = []
    error = ""
    try:
        # inside the try: torch 2.9 with TORCH_CACHING_PRECOMPILE=1 raises here already (reported, not raised)
        compiled = torch.compile(layer, backend=backend, fullgraph=True)
        for scope in (kernel_policy(), kernels_disabled(), kernel_policy("prefer"), kernels_disabled()):
            with scope:
                seen.append(float(compiled(x)[0]))
        thread_seen: list[float] = []

        def in_thread() -> None:
            with kernels_disabled():
                thread_seen.append(float(compiled(x)[0]))
            thread_seen.append(float(compiled(x)[0]))

        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join()
        seen += thread_seen
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        error = f"{type(exc).__name__}: {exc}"
    breaks = sum(counters["graph_break"].values()) - breaks_before
    expected = [100.0, 1.0, 100.0, 1.0, 1.0, 100.0]
    found = probe()
    # transformers' seams have a fallback that tells the user (listed with --verbose); torch's and kernels' fail
    missing = [str(f) for f in found if not f.present and not f.internal.names[0].startswith("transformers.")]
    states = _traced_states()
    wrong_states = {tracer: state for tracer, state in states.items() if state != tracer.split(" ")[0]}
    checks = (
        (
            "private torch and kernels names present",
            not missing,
            "; ".join(missing) or f"all {len(found)} present",
        ),
        (
            "execution_state() names each tracer",
            not wrong_states,
            ", ".join(f"{tracer}: {state}" for tracer, state in (wrong_states or states).items()),
        ),
        ("compiles with fullgraph=True", not error, error or "no error"),
        ("follows the policy of each call", seen == expected, f"outputs {seen}, expected {expected}"),
        ("one compile per distinct policy", compiles[0] == 2, f"{compiles[0]} compiles for 2 policies"),
        ("no graph breaks", breaks == 0, f"{breaks} graph breaks"),
        ("persisted compile artifacts follow the policy or refuse it", True, _persistence()),
    )
    torch.compiler.reset()
    return DoctorReport(
        versions=versions,
        transformers=_transformers_integration(),
        mechanism=MECHANISM,
        native_contextvar_get=_native_contextvar_get(),
        fast_call=_fast_call(),
        internals=tuple(str(f) for f in found),
        readers=dict(_state.READERS),
        checks=checks,
    )

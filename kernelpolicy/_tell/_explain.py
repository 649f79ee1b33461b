"""Introspection: which path each kernel layer of a model would take now.

This module owns :func:`explain` and its rows, and :func:`will_use_kernel`,
the path query for modeling code. Both ask what the forward asks (the same
decision function, ``_dispatch.decide``, with the policy, execution state and
autograd state of the caller; under TorchDynamo the same guarded reads), so
what they say is what a call made at the same place would do.

Features add what they know through two hook lists they append to when
imported (this module imports none of them): :data:`ROW_SOURCES`, rows for
kernels beyond a model's marked modules (transformers' attention kernel), and
:data:`UNGOVERNED_SOURCES`, hub kernels loaded in the process that no policy
reaches (transformers' lazily loaded ones).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._attach._attach import kernel_modules
from .._attach._aware import binding_of, bound_by_hand, bound_forward
from .._context._active import UNRECORDED, current_policy, in_effect
from .._context._scope import _recording_scope
from .._context._state import ExecutionState, execution_state
from .._forward._binding import BINDING, Binding
from .._forward._dispatch import USABLE, autograd_records
from .._forward._sharding import LOCAL_SHARDS, NO_SHARDING, has_dtensor
from .._values._errors import KernelUnavailableError
from .._values._rules import RULES, VARIANT_RULES
from .._values._text import table

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from torch import nn

    from .._forward._dispatch import Path
    from ._accounting import CallCounts

__all__ = ["ROW_SOURCES", "UNGOVERNED_SOURCES", "Explanation", "LayerRow", "Ungoverned", "explain", "will_use_kernel"]


@dataclasses.dataclass(frozen=True)
class Ungoverned:
    """A kernel in a model that no policy reaches (not policy-aware), as :func:`explain` shows it."""

    layer_name: str
    module_class: str
    kernel: str | None
    reason: str

    @property
    def path(self) -> Path:
        return "original" if self.kernel is None else "kernel"


#: ``source(model) -> [(row name, Binding or Ungoverned)]``: kernels beyond the marked modules (feature hooks).
ROW_SOURCES: list[Callable[[nn.Module], Iterable[tuple[str, Binding | Ungoverned]]]] = []
#: ``source() -> kernel names``: hub kernels loaded in this process that no policy reaches (feature hooks).
UNGOVERNED_SOURCES: list[Callable[[], Iterable[str]]] = []


def will_use_kernel(module: nn.Module, *args: Any, **kwargs: Any) -> bool:
    """Whether ``module``'s next call, made here, runs its kernel (False: its original forward, or an error).

    ``args`` and ``kwargs`` are that call's arguments. The answer depends on
    them where a ``kernel_accepts`` rule is declared for the layer (or one of
    its variants), and for a kernel without backward while grad is enabled
    and no parameter requires grad (it does not run a call autograd records).
    Asked without arguments there, where the kernel would otherwise run, it
    raises ``TypeError`` saying so: never a True that the call then belies.

    For the rare parent whose code must differ with the path its child takes
    (a kernel that wants another layout than the original forward): ask
    first, then call. It answers in eager code and under every tracer: under
    ``torch.compile`` (``fullgraph=True`` included) it breaks no graph and
    reads only what the child's compiled forward reads, so the parent's
    branch is guarded on the policy and a policy switch recompiles to the
    other branch; under ``torch.export`` (strict and not), ``torch.jit.trace``
    and FX it answers for the traced call.

    >>> import torch, kernelpolicy
    >>> @kernelpolicy.use_kernel_forward_from_hub("Double")
    ... class Double(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 2 * x
    >>> kernelpolicy.will_use_kernel(Double())  # no kernel bound
    False
    """
    binding = getattr(module, BINDING, None)
    if not isinstance(binding, Binding):
        raise TypeError(
            f"will_use_kernel needs a policy-aware layer (marked with use_kernel_forward_from_hub and bound by "
            f"kernelize or attach), got {type(module).__module__}.{type(module).__qualname__}"
        )
    active = in_effect()
    if _is_dynamo():  # the compiled forward's read: whether the kernel is on, not the mode that spells it
        mode: str = "prefer" if getattr(active.kernel_on, binding.layer_name) else "disable"
        if binding.variants:  # and which variants: the entry (as the slow path reads it)
            mode = getattr(active.variants, binding.layer_name) or mode
        return binding.decide(mode, "compile", args, kwargs)[0] == "kernel"
    entry = getattr(active.modes, binding.layer_name)
    path = binding.decide(UNRECORDED.get(entry, entry), execution_state(), args, kwargs)[0]
    if path == "kernel" and not args and not kwargs:
        depends = _depends_on_arguments(binding)
        if depends is not None:
            raise TypeError(
                f"will_use_kernel: whether {type(module).__qualname__} (kernel layer {binding.layer_name!r}) runs its "
                f"kernel depends on the call's arguments ({depends}); pass them: will_use_kernel(module, *args, **kwargs)"
            )
    return path == "kernel"


def _depends_on_arguments(binding: Binding) -> str | None:
    """Why a call's path depends on its arguments (a rule; a kernel without backward under grad), or None."""
    if binding.layer_name in RULES or any(layer == binding.layer_name for layer, _ in VARIANT_RULES):
        return "a kernel_accepts rule is declared for it"
    if not binding.has_backward and torch.is_grad_enabled() and not autograd_records(binding.module):
        return "its kernel has no backward, grad is enabled and autograd records a call whose arguments require grad"
    return None


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One kernel-capable module and the path its next call would take."""

    name: str
    layer_name: str
    module_class: str
    kernel: str | None
    can_torch_compile: bool
    has_backward: bool
    mode: str  # a mode, or the variants the policy names ("kernel:liger|default")
    path: Path
    reason: str
    policy_aware: bool
    calls: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The rows of :func:`explain`; ``str()`` renders an aligned table."""

    rows: tuple[LayerRow, ...]
    policy: str
    state: ExecutionState
    #: Entries of the policy in effect that name no kernel layer of the model (a typo shows up here).
    unmatched: tuple[str, ...] = ()
    #: Hub kernels loaded in this process that no policy reaches (transformers' ``lazy_load_kernel``).
    ungoverned: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[LayerRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        with_calls = any(row.calls is not None for row in self.rows)
        header: tuple[str, ...] = (
            "module",
            "layer",
            "class",
            "kernel",
            "compile",
            "backward",
            "mode",
            "path",
            "reason",
        )
        header += ("recorded calls",) if with_calls else ()
        body = [
            (
                row.name or "(root)",
                row.layer_name,
                row.module_class.rsplit(".", 1)[-1],
                row.kernel or "-",
                _flag(row, row.can_torch_compile),
                _flag(row, row.has_backward),
                row.mode,
                row.path,
                row.reason,
            )
            + (
                (", ".join(f"{path} {n}" for path, n in sorted((row.calls or {}).items())) or "-",)
                if with_calls
                else ()
            )
            for row in self.rows
        ]
        lines = [f"policy: {self.policy}   state: {self.state}", *table(header, body, rule=True)]
        if self.unmatched:
            lines.append(f"policy entries naming no kernel layer of this model: {', '.join(self.unmatched)}")
        if self.ungoverned:
            lines.append(
                "hub kernels no policy reaches (loaded by transformers' lazy_load_kernel for quantized and MoE "
                f"layers in this process): {', '.join(self.ungoverned)}"
            )
        return "\n".join(lines)


def _flag(row: LayerRow, value: bool) -> str:
    """A kernel's declaration as the table shows it: "-" where no kernel is bound or kernelpolicy cannot see it."""
    if row.kernel is None or not row.policy_aware:
        return "-"
    return "yes" if value else "no"


def explain(
    model: nn.Module, *example_args: Any, calls: CallCounts | None = None, **example_kwargs: Any
) -> Explanation:
    """Describe every kernel-capable module of ``model`` under the policy in effect here.

    With ``calls`` (from :func:`~kernelpolicy.record_calls`), each row also
    shows the calls recorded for that module by path. With example inputs,
    ``model(*example_args, **example_kwargs)`` runs once (without grad) and
    each row is the path that module's first call took and why: what a
    kernel's rule (``kernel_accepts``) says of those inputs, for instance. A
    module these inputs do not reach says so.

    >>> import torch, kernelpolicy
    >>> @kernelpolicy.use_kernel_forward_from_hub("Double")
    ... class Double(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 2 * x
    >>> with kernelpolicy.kernel_policy(Double="require"):
    ...     row, = kernelpolicy.explain(torch.nn.Sequential(Double()))
    >>> row.name, row.mode, row.path, row.reason
    ('0', 'require', 'error', 'no kernel bound')

    Policy entries for layer names the model does not have are listed, so a
    misspelt name does not pass unnoticed:

    >>> with kernelpolicy.kernel_policy(Dobule="disable"):
    ...     kernelpolicy.explain(torch.nn.Sequential(Double())).unmatched
    ('Dobule=disable',)

    Under ``torch.compile`` it is not traced: the graph breaks at the call with a message that points to
    :func:`will_use_kernel` (``fullgraph=True`` fails with it), and it runs eagerly, describing eager calls.
    """
    if _is_dynamo():  # a report of strings, kernels' registries and (with inputs) a model run: nothing to trace
        torch._dynamo.graph_break(msg=EXPLAIN_UNDER_COMPILE)
    policy = current_policy()
    state = execution_state()
    entries = [*_marked(model), *(entry for source in ROW_SOURCES for entry in source(model))]
    observed = _observe(model, example_args, example_kwargs) if example_args or example_kwargs else None
    rows = tuple(
        _row(name, found, policy.entry_for(found.layer_name), state, calls, observed) for name, found in entries
    )
    present = {row.layer_name for row in rows}
    unmatched = tuple(f"{name}={mode}" for name, mode in sorted(policy.layers.items()) if name not in present)
    ungoverned = tuple(name for source in UNGOVERNED_SOURCES for name in source())
    return Explanation(rows=rows, policy=str(policy), state=state, unmatched=unmatched, ungoverned=ungoverned)


EXPLAIN_UNDER_COMPILE = (
    "kernelpolicy.explain() is not traced by torch.compile: it runs eagerly here and describes eager calls. In "
    "compiled code ask kernelpolicy.will_use_kernel(module) (no graph break); call explain(model) outside it"
)


def _marked(model: nn.Module) -> Iterator[tuple[str, Binding | Ungoverned]]:
    """The kernel-capable modules of ``model``: their binding, or what kernels bound without kernelpolicy."""
    for name, module in kernel_modules(model):
        binding = binding_of(module)
        if binding is not None:
            yield name, binding
            continue
        bound = bound_forward(module)
        cls = type(module)
        yield (
            name,
            Ungoverned(
                layer_name=str(cls.kernel_layer_name),  # type: ignore[attr-defined]
                module_class=f"{cls.__module__}.{cls.__qualname__}",
                kernel=None if bound is None else bound.__qualname__,
                reason="not policy-aware: call kernelpolicy.attach(model)",
            ),
        )


class _FirstCalls:
    """A recorder (as ``record_calls`` installs them) that keeps each module's first path and reason, by identity."""

    def __init__(self) -> None:
        self.first: dict[int, tuple[Path, str]] = {}

    def add(
        self, module: nn.Module, module_name: str | None, layer_name: str, path: Path, reason: str, raised: str = ""
    ) -> None:
        self.first.setdefault(id(module), (path, reason))


NOT_REACHED = "not called by these inputs"


def _observe(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[int, tuple[Path, str]]:
    """``id(module)`` -> the path and reason of that module's first call in ``model(*args, **kwargs)``."""
    recorder = _FirstCalls()
    try:
        with torch.no_grad(), _recording_scope(None, recording=True, recorders=(recorder,)):
            model(*args, **kwargs)
    except KernelUnavailableError:
        pass  # recorded as that layer's "error"; the layers after it were not reached
    return recorder.first


def _row(
    name: str,
    found: Binding | Ungoverned,
    mode: str,
    state: ExecutionState,
    recorded: CallCounts | None,
    observed: dict[int, tuple[Path, str]] | None = None,
) -> LayerRow:
    if isinstance(found, Ungoverned):
        return LayerRow(
            name=name,
            layer_name=found.layer_name,
            module_class=found.module_class,
            kernel=found.kernel,
            can_torch_compile=False,
            has_backward=True,
            mode=mode,
            path=found.path,
            reason=found.reason,
            policy_aware=False,
        )
    if observed is not None:
        path, reason = observed.get(id(found.module), (found.decide(mode, state)[0], NOT_REACHED))
    else:
        path, reason = _on_dtensor(found, mode, *found.decide(mode, state))
        rule = RULES.get(found.layer_name)
        if rule is not None and path == "kernel" and reason == USABLE:
            reason = f"{USABLE} for calls its rule accepts ({rule.describe()})"
        if found.failures and found.stopped is None:
            reason = f"{reason}; {found.failures} failure(s) so far under fallback_on (last: {found.last_failure})"
    assigned = _assigned(found)
    return LayerRow(
        name=name,
        layer_name=found.layer_name,
        module_class=found.module_class,
        kernel=found.kernel_name(),
        can_torch_compile=found.can_torch_compile,
        has_backward=found.has_backward,
        mode=mode,
        path=path,
        reason=reason if assigned is None else f"{reason}; {assigned}",
        policy_aware=True,
        calls=None if recorded is None else recorded.for_module(found.module),
    )


def _assigned(binding: Binding) -> str | None:
    """What was assigned as ``module.forward`` by hand, when the policy treats it in a way to say (issue 41).

    A function bound to the module as a method is kernels' form: it is the module's kernel (not run under
    ``disable``). Anything else assigned (a plain function, a ``functools.partial``, accelerate's hook) wraps
    the policy's path and runs under every mode.
    """
    if binding.wrapper is not None:
        wrapped = getattr(binding.wrapper, "func", binding.wrapper)  # a functools.partial: the function it calls
        name = getattr(wrapped, "__qualname__", type(wrapped).__qualname__)
        return f"module.forward is {name}: a wrapper around this path, run under every mode"
    if bound_by_hand(binding.module):
        return "kernel bound by hand (module.forward = MethodType(f, module)): the kernel to the policy, not run under disable"
    return None


def _on_dtensor(binding: Binding, mode: str, path: Path, reason: str) -> tuple[Path, str]:
    """The row of a kernel layer that has met DTensor arguments or parameters (see ``Binding.unsupported``)."""
    if path != "kernel":
        return path, reason
    parameters = has_dtensor(binding.module)
    if binding.dtensor_failure is None and not parameters:
        return path, reason
    if binding.layer_name in LOCAL_SHARDS:
        return path, f"{reason}; on DTensor without a sharding strategy it runs on local shards"
    if binding.dtensor_failure is None:
        return path, f"{reason} if its op has a sharding strategy for these DTensor parameters"
    if parameters:
        return ("error" if mode == "require" else "original"), f"{NO_SHARDING}: {binding.dtensor_failure}"
    return path, f"{reason} on plain tensors; on DTensor inputs: {NO_SHARDING}"


# The public name (kernelpolicy.types), set after the class is built: a dataclass resolves its annotations
# in the module its __module__ names, which is imported only on demand.
LayerRow.__module__ = "kernelpolicy.types"
Explanation.__module__ = "kernelpolicy.types"

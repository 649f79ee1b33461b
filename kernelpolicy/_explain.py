"""Introspection: which path each kernel layer of a model would take now.

This module owns :func:`explain` and its rows, and :func:`will_use_kernel`,
the path query for modeling code. Both ask what the forward asks (the same
decision function, ``_dispatch.decide``, with the policy, execution state and
autograd state of the caller; under TorchDynamo the same guarded reads), so
what they say is what a call made at the same place would do.
"""

from __future__ import annotations

import dataclasses
import types
from typing import TYPE_CHECKING, Any

from torch.compiler import is_dynamo_compiling as _is_dynamo

from ._active import DEFAULTS, UNRECORDED, current_policy
from ._binding import BINDING, binding_of, kernel_modules
from ._dispatch import NO_SHARDING, Binding, autograd_records, has_dtensor
from ._state import ExecutionState, execution_state
from ._transformers import ATTENTION, ROW, hub_attention_of, lazily_loaded
from .distributed import local_shard_layers

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch import nn

    from ._accounting import CallCounts
    from ._dispatch import Path
    from ._policy import PolicyMode

__all__ = ["Explanation", "LayerRow", "explain", "will_use_kernel"]


def will_use_kernel(module: nn.Module, *args: Any, **kwargs: Any) -> bool:
    """Whether ``module``'s next call, made here, runs its kernel (False: its original forward, or an error).

    ``args`` and ``kwargs`` are that call's arguments. Only a kernel without
    backward depends on them (it does not run a call autograd records: grad
    enabled and an argument or parameter requiring grad); without them the
    answer is for arguments that need no grad.

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
    active = DEFAULTS.active._current
    if _is_dynamo():  # as the compiled forward: the kernel is on, traceable, and has what autograd needs
        return (
            binding.kernel is not None
            and binding.can_torch_compile
            and bool(getattr(active.kernel_on, binding.layer_name))
            and (binding.has_backward or not autograd_records(module, args, kwargs))
        )
    entry = getattr(active.modes, binding.layer_name)
    return binding.decide(UNRECORDED.get(entry, entry), execution_state(), args, kwargs)[0] == "kernel"


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One kernel-capable module and the path its next call would take."""

    __module__ = "kernelpolicy"  # the public name (see kernelpolicy/__init__.py)

    name: str
    layer_name: str
    module_class: str
    kernel: str | None
    can_torch_compile: bool
    has_backward: bool
    mode: PolicyMode
    path: Path
    reason: str
    policy_aware: bool
    calls: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The rows of :func:`explain`; ``str()`` renders an aligned table."""

    __module__ = "kernelpolicy"  # the public name (see kernelpolicy/__init__.py)

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
                "yes" if row.can_torch_compile else "no",
                "yes" if row.has_backward else "no",
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
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        lines = [f"policy: {self.policy}   state: {self.state}"]
        for line in [header, tuple("-" * w for w in widths), *body]:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if self.unmatched:
            lines.append(f"policy entries naming no kernel layer of this model: {', '.join(self.unmatched)}")
        if self.ungoverned:
            lines.append(
                "hub kernels no policy reaches (loaded by transformers' lazy_load_kernel for quantized and MoE "
                f"layers in this process): {', '.join(self.ungoverned)}"
            )
        return "\n".join(lines)


def explain(model: nn.Module, *, calls: CallCounts | None = None) -> Explanation:
    """Describe every kernel-capable module of ``model`` under the policy in effect here.

    With ``calls`` (from :func:`~kernelpolicy.record_calls`), each row also
    shows the calls recorded for that module by path.

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
    """
    policy = current_policy()
    state = execution_state()
    recorded = calls.by_module() if calls is not None else None
    rows = []
    for name, module in kernel_modules(model):
        layer_name = str(type(module).kernel_layer_name)  # type: ignore[attr-defined]
        mode = policy.mode_for(layer_name)
        binding = binding_of(module)
        if binding is not None:
            rows.append(_row(name, binding, mode, state, recorded))
        else:
            bound = module.__dict__.get("forward")
            has_kernel = isinstance(bound, types.MethodType) and bound.__func__ is not type(module).forward
            cls = type(module)
            rows.append(
                LayerRow(
                    name=name,
                    layer_name=layer_name,
                    module_class=f"{cls.__module__}.{cls.__qualname__}",
                    kernel=getattr(bound, "__qualname__", None) if has_kernel else None,
                    can_torch_compile=False,
                    has_backward=True,
                    mode=mode,
                    path="kernel" if has_kernel else "original",
                    reason="not policy-aware: call kernelpolicy.attach(model)",
                    policy_aware=False,
                )
            )
    attention = hub_attention_of(model)
    if attention is not None:
        kernel_name, hub = attention
        mode = policy.mode_for(ATTENTION)
        hub_binding = binding_of(hub) if hub is not None else None
        if hub_binding is not None:
            rows.append(_row(ROW, hub_binding, mode, state, recorded))
        else:
            rows.append(
                LayerRow(
                    name=ROW,
                    layer_name=ATTENTION,
                    module_class="transformers ALL_ATTENTION_FUNCTIONS",
                    kernel=kernel_name,
                    can_torch_compile=False,
                    has_backward=True,
                    mode=mode,
                    path="kernel",
                    reason="not policy-aware (registered by transformers since): call kernelpolicy.attach(model)",
                    policy_aware=False,
                )
            )
    present = {row.layer_name for row in rows}
    unmatched = tuple(f"{name}={mode}" for name, mode in sorted(policy.layers.items()) if name not in present)
    return Explanation(
        rows=tuple(rows), policy=str(policy), state=state, unmatched=unmatched, ungoverned=lazily_loaded()
    )


def _row(
    name: str, binding: Binding, mode: PolicyMode, state: ExecutionState, recorded: dict[str, dict[str, int]] | None
) -> LayerRow:
    path, reason = _on_dtensor(binding, mode, *binding.decide(mode, state))
    return LayerRow(
        name=name,
        layer_name=binding.layer_name,
        module_class=binding.module_class,
        kernel=binding.kernel_name(),
        can_torch_compile=binding.can_torch_compile,
        has_backward=binding.has_backward,
        mode=mode,
        path=path,
        reason=reason,
        policy_aware=True,
        calls=None if recorded is None else recorded.get(name, {}),
    )


def _on_dtensor(binding: Binding, mode: PolicyMode, path: Path, reason: str) -> tuple[Path, str]:
    """The row of a kernel layer that has met DTensor arguments or parameters (see ``Binding.unsupported``)."""
    if path != "kernel":
        return path, reason
    parameters = has_dtensor(binding.module)
    if binding.dtensor_failure is None and not parameters:
        return path, reason
    if binding.layer_name in local_shard_layers():
        return path, f"{reason}; on DTensor without a sharding strategy it runs on local shards"
    if binding.dtensor_failure is None:
        return path, f"{reason} if its op has a sharding strategy for these DTensor parameters"
    if parameters:
        return ("error" if mode == "require" else "original"), f"{NO_SHARDING}: {binding.dtensor_failure}"
    return path, f"{reason} on plain tensors; on DTensor inputs: {NO_SHARDING}"

"""Mixed calls: one forward call whose rows follow several policies (one continuous-batching step for all).

This module owns:

- the row declarations (:func:`declare_rows`, :data:`ROWS`): how a kernel layer's output rows depend on its
  input rows, so that rows of different policies may share one call. ``"token"``: each row on its own (norms,
  activations, MLPs, MoE, rotary embedding); ``"request"``: the rows of one request together (attention over
  a request's own tokens, by the batch's sequence boundaries). A layer declared by neither is never mixed:
  the batching scheduler groups the steps where its paths would differ (``kernelpolicy.batching``);
- how the paths of a mixed call are joined (:data:`JOINS`): ``"select"`` runs each path on every row and
  keeps each row's own (``torch.where``: static shapes, what compiled programs and CUDA graphs need);
  ``"split"`` runs each path on its own rows only (less work, shapes that vary from step to step);
- :class:`Step` and :class:`Members`, what a mixed step carries: its policies by slot, each row's slot as a
  tensor (a per-batch input, so one compiled program serves every mix), per slot the recorders of its
  requests; :func:`mixed_scope`, the scope a step runs in;
- :func:`run_mixed`, one call of a layer whose entries differ between the step's policies.

In eager code each group of rows (the policies that agree on the layer) runs the module's own dispatch under
its policy, so ``require``, ``verify``, ``fallback_on``, variants and ``record_calls`` behave per group as
they do for a whole call; an error a group raises comes out as :class:`MixedCallError` naming the group's
policies, so the batching fails only their requests. A group's error is its own rows' only: a group that ran
on every row (a select join) and raised runs again on its own rows (rows by token), and a group whose policy
may fall back (``fallback_on``) runs on its own rows from the start, so that another group's rows never make
its kernel fail, fall back or trip. Under TorchDynamo the program computes the kernel and
the original on every row and selects by a per-slot table (an input too): no guard depends on the mix.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol, final

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._context._active import _SCOPED, RECORDERS, Active, activate_mixed, in_effect, known_layers
from .._context._scope import _recording_scope
from .._values._errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from torch import nn

    from .._values._policy import Policy

__all__ = [
    "JOINS",
    "ROWS",
    "Mixed",
    "MixedCallError",
    "Rows",
    "Step",
    "declare_rows",
    "mixable",
    "mixed_scope",
    "run_mixed",
]

Kind = Literal["token", "request"]
Join = Literal["select", "split"]


class Mixed(Protocol):
    """What a mixed call reads of its module's binding (``_binding.Binding``, a layer above, satisfies it).

    ``variants`` maps names to ``_binding.Kernel`` there (a layer above): here only whether there are any.
    """

    @property
    def module(self) -> nn.Module: ...
    @property
    def layer_name(self) -> str: ...
    @property
    def original(self) -> Callable[..., Any]: ...
    @property
    def kernel(self) -> Callable[..., Any] | None: ...
    @property
    def variants(self) -> Mapping[str, object]: ...
    @property
    def can_torch_compile(self) -> bool: ...
    @property
    def dispatcher(self) -> Any: ...
    def has_aware_children(self) -> bool: ...


KINDS: Final = ("token", "request")
JOINS: Final = ("select", "split")


class Rows(NamedTuple):
    """How a kernel layer's rows may be mixed: ``by`` (token or request), the row axis of its tensors, the join."""

    by: Kind
    #: The axis of the rows (tokens) in the layer's tensor arguments and outputs, counted from the end.
    dim: int = -2
    #: How eager calls join the paths; compiled programs always select (static shapes).
    join: Join = "select"


#: Kernel layer name -> its declaration. The layers transformers maps to hub kernels come declared; the joins
#: are chosen by ``python -m benchmarks.mixing`` (docs/serving.md, "What mixing costs").
ROWS: dict[str, Rows] = {
    **{
        name: Rows("token")
        for name in (
            "RMSNorm",
            "RMSNormGated",
            "RMSNormZeroCentered",
            "LayerNorm",
            "SiLU",
            "GeLU",
            "GeluTanh",
            "FastGELU",
            "QuickGELU",
            "NewGELU",
            "rotary_pos_emb",
        )
    },
    **{name: Rows("token", join="split") for name in ("MLP", "LlamaMLP", "MegaBlocksMoeMLP", "SoftmaxTopKRouter")},
    # transformers' attention functions return (batch, tokens, heads, head_dim): the rows are axis -3.
    "attention": Rows("request", dim=-3),
}
_LOCK = threading.Lock()


def declare_rows(layer_name: str, by: Kind, *, dim: int = -2, join: Join = "select") -> None:
    """Declare how the rows of kernel layer ``layer_name`` may follow different policies in one call.

    ``by="token"``: each output row depends on its own input row only (a norm, an activation, an MLP).
    ``by="request"``: on the rows of its own request (attention over a request's tokens). ``dim`` is the row
    axis of the layer's tensor arguments and outputs, from the end; ``join`` how eager calls join the paths
    (``"select"``: both paths on every row, then ``torch.where``; ``"split"``: each path on its own rows).
    A layer declared by neither keeps its steps grouped by policy in continuous batching.

    >>> from kernelpolicy.batching import declare_rows
    >>> declare_rows("MyNorm", by="token")
    """
    from .._values._policy import check_layer_name

    check_layer_name(layer_name)
    if by not in KINDS:
        raise PolicyError(f"declare_rows({layer_name!r}): by={by!r} is not one of {', '.join(map(repr, KINDS))}")
    if join not in JOINS:
        raise PolicyError(f"declare_rows({layer_name!r}): join={join!r} is not one of {', '.join(map(repr, JOINS))}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim >= 0:
        raise PolicyError(
            f"declare_rows({layer_name!r}): dim={dim!r} must be a negative int (the row axis from the end)"
        )
    if by == "request" and join == "split":
        raise PolicyError(
            f"declare_rows({layer_name!r}): a layer whose rows go by request joins by 'select' (a split would need "
            "the batch's sequence boundaries cut too)"
        )
    with _LOCK:
        ROWS[layer_name] = Rows(by, dim, join)


def mixable(policies: tuple[Policy, ...], layers: frozenset[str] | None = None) -> bool:
    """Whether rows of ``policies`` may share one call: every known layer they disagree on is declared."""
    names = known_layers() if layers is None else layers
    for name in names:
        if name in ROWS:
            continue
        first = policies[0]
        facts = (first.entry_for(name), first.options)
        if any((policy.entry_for(name), policy.options) != facts for policy in policies[1:]):
            return False
    return True


class MixedCallError(Exception):
    """A group of rows of a mixed call raised ``error``: the requests of ``policies`` failed, no others."""

    def __init__(self, policies: tuple[Policy, ...], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error} (rows of {', '.join(repr(str(p)) for p in policies)})")
        self.policies = policies
        self.error = error


class _Held:
    """A recorder that holds the calls of an attempt on every row until the attempt is known to stand."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add(self, *call: Any) -> None:
        self.calls.append(call)


class _Group(NamedTuple):
    scope: Any  # the scope of the group's first policy (they agree on the layer), with the group's recorders
    policies: tuple[Policy, ...]
    mask: torch.Tensor  # (rows,) bool: the group's rows
    rows: torch.Tensor | None  # the group's rows, where it runs on them only (a split join, or fallback_on)
    recorders: tuple[Any, ...]
    #: For a group that runs on every row of a layer by token: the scope of that attempt, whose calls are held.
    attempt: tuple[Any, _Held] | None


@final
class Step:
    """The rows of one batching manager's current step (one per manager; its steps run in one thread).

    ``policies`` lists every policy the manager has served, by slot (a slot is never reused). ``rows`` holds
    each row's slot (a view of the manager's per-batch buffer: padding rows hold slot 0), ``host_rows`` the
    same on the host, ``recorders`` each slot's requests' recorders.
    """

    __slots__ = ("_plans", "device", "host_rows", "policies", "recorders", "rows", "slot_of", "tables")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.policies: list[Policy] = []
        self.slot_of: dict[Policy, int] = {}
        self.rows = torch.zeros(0, dtype=torch.long, device=device)
        self.host_rows: list[int] = []
        self.recorders: dict[int, tuple[Any, ...]] = {}
        #: The table of each set of slots served together (their owner: this step).
        self.tables: dict[tuple[tuple[int, ...], bool], Active] = {}
        self._plans: dict[tuple[str, bool, bool, tuple[int, ...]], list[_Group]] = {}

    def slot(self, policy: Policy) -> int:
        found = self.slot_of.get(policy)
        if found is None:
            found = self.slot_of[policy] = len(self.policies)
            self.policies.append(policy)
        return found

    def begin(self, rows: torch.Tensor, host_rows: list[int], recorders: dict[int, tuple[Any, ...]]) -> None:
        """A new step: its rows' slots (device and host) and the recorders of each slot's requests."""
        self.rows, self.host_rows, self.recorders = rows, host_rows, recorders
        self._plans.clear()

    def table(self, slots: tuple[int, ...], recording: bool) -> Active:
        """The table of a step serving the policies of ``slots`` (two or more), made once per set."""
        key = (slots, recording)
        found = self.tables.get(key)
        if found is None:
            found = self.tables[key] = activate_mixed(Members(self, slots), recording)
        return found

    def plan(self, binding: Mixed, members: Members, rows: Rows) -> list[_Group]:
        """The groups of rows of ``binding``'s layer in this step (cached per layer for the step)."""
        nested = binding.has_aware_children()
        without_kernel = binding.kernel is None and not binding.variants
        key = (binding.layer_name, nested, without_kernel, members.slots)
        found = self._plans.get(key)
        if found is not None:
            return found
        name = binding.layer_name
        keyed: dict[Any, list[int]] = {}
        for slot in members.slots:
            policy = self.policies[slot]
            entry = policy.entry_for(name)
            if without_kernel and entry != "require":
                entry = "original"  # prefer, disable and verify all run the original here
            # A layer with policy-aware layers inside runs once per policy (they may differ there).
            keyed.setdefault(policy if nested else (entry, policy.options), []).append(slot)
        groups = []
        positions = torch.arange(len(self.host_rows))
        host = torch.tensor(self.host_rows, dtype=torch.long)
        for slots in keyed.values():
            chosen = torch.zeros(len(self.policies), dtype=torch.bool)
            chosen[slots] = True
            host_mask = chosen[host]
            recorders = tuple(dict.fromkeys(r for slot in slots for r in self.recorders.get(slot, ())))
            policy = self.policies[slots[0]]
            own = rows.join == "split" or (rows.by == "token" and bool(policy.fallback_on))
            index = positions[host_mask].to(self.device) if own else None
            scope = _recording_scope(policy, recording=bool(recorders), recorders=recorders)
            attempt = None
            if not own and rows.by == "token":
                held = _Held()
                attempt = (_recording_scope(policy, recording=bool(recorders), recorders=(held,)), held)
            policies = tuple(self.policies[s] for s in slots)
            groups.append(_Group(scope, policies, host_mask.to(self.device), index, recorders, attempt))
        self._plans[key] = groups
        return groups


@final
class Members:
    """What a mixed step's table carries (``Active.mix``): the policies served together and where their rows are."""

    __slots__ = ("kernel_slots", "policies", "slots", "step")

    def __init__(self, step: Step, slots: tuple[int, ...]) -> None:
        self.step = step
        self.slots = slots
        self.policies = tuple(step.policies[slot] for slot in slots)
        #: Per layer name, whether each slot's policy has the kernel on (what a compiled program selects by): made
        #: for every known layer at once, since a program is guarded on which names the dict holds.
        self.kernel_slots: dict[str, torch.Tensor] = {}
        for name in known_layers():
            self.kernel_on(name)

    def kernel_on(self, name: str) -> torch.Tensor:
        found = self.kernel_slots.get(name)
        if found is None:
            policies = self.step.policies
            on = [slot in self.slots and policies[slot].mode_for(name) != "disable" for slot in range(len(policies))]
            found = self.kernel_slots[name] = torch.tensor(on, dtype=torch.bool, device=self.step.device)
        return found


@contextlib.contextmanager
def mixed_scope(active: Active, recorders: tuple[Any, ...]) -> Iterator[None]:
    """Put a step's table (plain or mixed) in effect for the step, with the recorders of its requests."""
    token = _SCOPED.set(active)
    recording = RECORDERS.set(recorders)
    try:
        yield
    finally:
        RECORDERS.reset(recording)
        _SCOPED.reset(token)


def run_mixed(binding: Mixed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of ``binding``'s module whose rows follow different paths (its entry is ``MIXED``)."""
    members: Members = in_effect().mix
    rows = ROWS.get(binding.layer_name, Rows("request"))  # an undeclared layer is grouped by the scheduler
    step = members.step
    if _is_dynamo():
        original = binding.original(binding.module, *args, **kwargs)
        if binding.kernel is None or not binding.can_torch_compile:
            return original
        on = members.kernel_on(binding.layer_name)[step.rows]
        return _select(on, binding.kernel(binding.module, *args, **kwargs), original, rows.dim)
    groups = step.plan(binding, members, rows)
    if len(groups) == 1:  # the policies differ on the layer, not on its path here (no kernel bound, say)
        try:
            with groups[0].scope:
                return binding.dispatcher(*args, **kwargs)
        except Exception as error:
            raise MixedCallError(groups[0].policies, error) from error
    count = len(step.host_rows)
    ran = [_run_group(binding, group, args, kwargs, rows.dim, count) for group in groups]
    whole = [(group.mask, output) for group, (index, output) in zip(groups, ran, strict=True) if index is None]
    parts = [(index, output) for index, output in ran if index is not None]
    if whole:
        out = whole[-1][1]
        for mask, output in whole[-2::-1]:
            out = _select(mask, output, out, rows.dim)
        return _put(out, parts, rows.dim) if parts else out
    return _joined(parts, rows.dim, count)


def _run_group(
    binding: Mixed, group: _Group, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, count: int
) -> tuple[torch.Tensor | None, Any]:
    """One group's call: its rows (None: every row) and its output; its error as :class:`MixedCallError`."""
    index = group.rows
    try:
        if group.attempt is not None:  # every row, the calls held: another group's rows may make the kernel raise
            scope, held = group.attempt
            held.calls.clear()
            try:
                with scope:
                    output = binding.dispatcher(*args, **kwargs)
            except Exception:  # noqa: BLE001  # retried below on its own rows, where it stands or is raised
                index = torch.nonzero(group.mask).flatten()  # again on its own rows: the error is theirs, or none
            else:
                for recorder in group.recorders:
                    for call in held.calls:
                        recorder.add(*call)
                return None, output
        with group.scope:
            if index is None:
                return None, binding.dispatcher(*args, **kwargs)
            call_args, call_kwargs = _taken(args, kwargs, index, dim, count)
            return index, binding.dispatcher(*call_args, **call_kwargs)
    except Exception as error:
        raise MixedCallError(group.policies, error) from error


def _select(mask: torch.Tensor, chosen: Any, other: Any, dim: int) -> Any:
    """``chosen`` where ``mask`` (one entry per row along ``dim``), else ``other``; through tuples and lists."""
    if isinstance(chosen, torch.Tensor):
        shape = [1] * chosen.dim()
        shape[dim] = mask.shape[0]
        return torch.where(mask.view(shape), chosen, other)
    if isinstance(chosen, (tuple, list)):
        return type(chosen)(_select(mask, a, b, dim) for a, b in zip(chosen, other, strict=True))
    return chosen


def _taken(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: torch.Tensor, dim: int, count: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with the rows of ``index`` only (tensors with ``count`` rows along ``dim``)."""

    def take(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= -dim and value.shape[dim] == count:
            return value.index_select(value.dim() + dim, index)
        return value

    return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}


def _joined(parts: list[tuple[torch.Tensor, Any]], dim: int, count: int) -> Any:
    """The outputs of groups that ran on their own rows (``(rows, output)``), put back in row order."""
    first = parts[0][1]
    if isinstance(first, torch.Tensor):
        shape = list(first.shape)
        axis = first.dim() + dim
        shape[axis] = count
        out = first.new_empty(shape)
        for index, output in parts:
            out.index_copy_(axis, index, output)
        return out
    if isinstance(first, (tuple, list)):
        return type(first)(_joined(_field(parts, i), dim, count) for i in range(len(first)))
    return first


def _put(out: Any, parts: list[tuple[torch.Tensor, Any]], dim: int) -> Any:
    """``out`` with the rows of each part replaced by its output (a new tensor: ``out`` may be a module's)."""
    if isinstance(out, torch.Tensor):
        for index, output in parts:
            out = out.index_copy(out.dim() + dim, index, output)
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_put(value, _field(parts, i), dim) for i, value in enumerate(out))
    return out


def _field(parts: list[tuple[torch.Tensor, Any]], i: int) -> list[tuple[torch.Tensor, Any]]:
    return [(index, output[i]) for index, output in parts]

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
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol, final

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._context._active import _SCOPED, RECORDERS, Active, activate_mixed, in_effect, known_layers
from .._context._scope import _recording_scope
from .._values._errors import PolicyError
from .._values._policy import VARIANTS
from .._values._tensors import map_tensors, tensors_in

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator, Mapping

    from torch import nn

    from .._values._policy import Policy

__all__ = [
    "JOINS",
    "ROWS",
    "Mixed",
    "MixedCallError",
    "Rows",
    "Step",
    "UnsplittableCall",
    "declare_rows",
    "mixable",
    "mixed_scope",
    "row_axis",
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
    def decide(
        self, mode: str, state: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[str, str]: ...
    def choose(
        self, entry: str, state: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[str, str, Callable[..., Any] | None, str | None]: ...


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


def mixable(policies: tuple[Policy, ...], layers: frozenset[str] | None = None, grouped: Collection[str] = ()) -> bool:
    """Whether rows of ``policies`` may share one call: every known layer they disagree on is declared (and not
    in ``grouped``: layers found unsplittable, kept apart as if undeclared)."""
    names = known_layers() if layers is None else layers
    for name in names:
        if name in ROWS and name not in grouped:
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
    own: torch.Tensor  # the group's rows, always (what its path may write back)
    recorders: tuple[Any, ...]
    #: For a group that runs on every row of a layer by token: the scope of that attempt, whose calls are held.
    attempt: tuple[Any, _Held] | None


@final
class Step:
    """The rows of one batching manager's current step (one per manager; its steps run in one thread).

    ``policies`` holds the policy of each slot: a slot is taken by a policy while requests of it are in flight,
    then freed (:meth:`release`) for another; its tables go with it. ``rows`` holds each row's slot (a view of
    the manager's per-batch buffer: padding rows hold the last row's slot), ``host_rows`` the same on the host,
    ``recorders`` each slot's requests' recorders. Per-slot tensors have ``capacity`` entries (doubled when the
    policies in flight outgrow it), so their shapes, and compiled programs, rarely change.
    """

    __slots__ = (
        "_plans",
        "capacity",
        "device",
        "free",
        "host_rows",
        "policies",
        "recorders",
        "rows",
        "slot_of",
        "tables",
    )

    #: The most tables a step keeps (the sets of policies served together most recently).
    MOST_TABLES: Final = 64

    def __init__(self, device: torch.device) -> None:
        if not _UNTRACED:
            compiler: Any = torch.compiler  # disable: untyped in some torch releases (mypy strict on each)
            _UNTRACED.append(compiler.disable(_run_eager, recursive=True))
        self.device = device
        self.policies: list[Policy] = []
        self.slot_of: dict[Policy, int] = {}
        self.free: list[int] = []
        self.capacity = 8
        self.rows = torch.zeros(0, dtype=torch.long, device=device)
        self.host_rows: list[int] = []
        self.recorders: dict[int, tuple[Any, ...]] = {}
        #: The table of each set of slots served together (their owner: this step), the most recent last.
        self.tables: dict[tuple[tuple[int, ...], bool], Active] = {}
        self._plans: dict[tuple[str, bool, bool, tuple[int, ...]], list[_Group]] = {}

    def slot(self, policy: Policy) -> int:
        """The slot of ``policy``: its own while it has one, else a free one, else a new one."""
        found = self.slot_of.get(policy)
        if found is None:
            if self.free:
                found = self.free.pop()
                self.policies[found] = policy
            else:
                found = len(self.policies)
                self.policies.append(policy)
                if found >= self.capacity:
                    self.capacity *= 2
                    self.tables.clear()  # their per-slot tensors are too short now
            self.slot_of[policy] = found
        return found

    def release(self, alive: Collection[Policy]) -> None:
        """Free the slots of the policies not in ``alive`` (no request of theirs in flight), and their tables."""
        gone = {slot for policy, slot in self.slot_of.items() if policy not in alive}
        if not gone:
            return
        for slot in gone:
            del self.slot_of[self.policies[slot]]
        self.free.extend(sorted(gone, reverse=True))
        self.tables = {key: table for key, table in self.tables.items() if gone.isdisjoint(key[0])}

    def begin(self, rows: torch.Tensor, host_rows: list[int], recorders: dict[int, tuple[Any, ...]]) -> None:
        """A new step: its rows' slots (device and host) and the recorders of each slot's requests."""
        self.rows, self.host_rows, self.recorders = rows, host_rows, recorders
        self._plans.clear()

    def table(self, slots: tuple[int, ...], recording: bool) -> Active:
        """The table of a step serving the policies of ``slots`` (two or more), made once per set while they last."""
        key = (slots, recording)
        found = self.tables.pop(key, None)
        if found is None:
            found = activate_mixed(Members(self, slots), recording)
            while len(self.tables) >= self.MOST_TABLES:
                del self.tables[next(iter(self.tables))]
        self.tables[key] = found  # the most recent last
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
            # A layer with policy-aware layers inside runs once per policy (they may differ there); without a
            # kernel, prefer, disable and verify all run the original, whatever their options.
            path: Any = policy if nested else (entry, policy.options)
            if without_kernel and entry != "require" and not nested:
                path = "original"
            keyed.setdefault(path, []).append(slot)
        groups = []
        positions = torch.arange(len(self.host_rows))
        host = torch.tensor(self.host_rows, dtype=torch.long)
        for slots in keyed.values():
            chosen = torch.zeros(len(self.policies), dtype=torch.bool)
            chosen[slots] = True
            host_mask = chosen[host]
            recorders = tuple(dict.fromkeys(r for slot in slots for r in self.recorders.get(slot, ())))
            policy = self.policies[slots[0]]
            # A group runs on its own rows where the join splits, and where running on others' rows would cost
            # or count what is its own: verify runs the original too, fallback_on counts failures.
            own = rows.join == "split" or (
                rows.by == "token"
                and (bool(policy.fallback_on) or (policy.mode_for(name) == "verify" and not without_kernel))
            )
            own_rows = positions[host_mask].to(self.device)
            index = own_rows if own else None
            scope = _recording_scope(policy, recording=bool(recorders), recorders=recorders)
            attempt = None
            if not own and rows.by == "token":
                held = _Held()
                attempt = (_recording_scope(policy, recording=bool(recorders), recorders=(held,)), held)
            policies = tuple(self.policies[s] for s in slots)
            groups.append(_Group(scope, policies, host_mask.to(self.device), index, own_rows, recorders, attempt))
        self._plans[key] = groups
        return groups


@final
class Members:
    """What a mixed step's table carries (``Active.mix``): the policies served together and where their rows are."""

    __slots__ = ("_entries", "entry_slots", "kernel_slots", "policies", "slots", "step")

    def __init__(self, step: Step, slots: tuple[int, ...]) -> None:
        self.step = step
        self.slots = slots
        self.policies = tuple(step.policies[slot] for slot in slots)
        #: Per layer name, whether each slot's policy has the kernel on (what a compiled program selects by): made
        #: for every known layer at once, since a program is guarded on which names the dict holds.
        self.kernel_slots: dict[str, torch.Tensor] = {}
        #: Per layer name, each slot's entry index (what a compiled program selects by), made likewise.
        self.entry_slots: dict[str, torch.Tensor] = {}
        self._entries: dict[str, tuple[str, ...]] = {}
        for name in known_layers():
            self.kernel_on(name)
            self.entry_index(name)

    def entries(self, name: str) -> tuple[str, ...]:
        """The distinct entries the policies give layer ``name``, sorted (what a compiled mixed call computes)."""
        found = self._entries.get(name)
        if found is None:
            found = self._entries[name] = tuple(sorted({policy.entry_for(name) for policy in self.policies}))
        return found

    def entry_index(self, name: str) -> torch.Tensor:
        """Per slot, the index of its policy's entry for layer ``name`` in :meth:`entries` (0 for other slots)."""
        found = self.entry_slots.get(name)
        if found is None:
            entries = self.entries(name)
            index = [0] * self.step.capacity
            for slot, policy in zip(self.slots, self.policies, strict=True):
                index[slot] = entries.index(policy.entry_for(name))
            found = self.entry_slots[name] = torch.tensor(index, dtype=torch.long, device=self.step.device)
        return found

    def kernel_on(self, name: str) -> torch.Tensor:
        found = self.kernel_slots.get(name)
        if found is None:
            on = [False] * self.step.capacity
            for slot, policy in zip(self.slots, self.policies, strict=True):
                on[slot] = policy.mode_for(name) != "disable"
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


class UnsplittableCall(Exception):  # noqa: N818  # a signal to the batching seam, not an error of the user's
    """A mixed call whose shapes do not show the step's rows: no row of it is joined, the step runs again.

    Raised before any caller's tensor is written. ``size`` is the step's row count where a tensor has several axes
    of that size (a step of another row count, or one policy at a time, is right); None where a value shows no
    row at all (an output without an axis of the step's rows that differs between the paths).
    """

    def __init__(self, layer_name: str, reason: str, size: int | None) -> None:
        super().__init__(f"kernel layer {layer_name!r}: the rows of a mixed call cannot be told apart: {reason}")
        self.layer_name = layer_name
        self.size = size


def row_axis(tensor: torch.Tensor, count: int, layer_name: str) -> int | None:
    """The one axis of ``tensor`` of size ``count`` (the step's rows), None if it has none.

    Several such axes (a step of 4 rows through a per-head norm of 4 heads): :class:`UnsplittableCall`.
    """
    found = None
    for axis, size in enumerate(tensor.shape):
        if size == count:
            if found is not None:
                raise UnsplittableCall(layer_name, f"{count} rows and a tensor of shape {tuple(tensor.shape)}", count)
            found = axis
    return found


def run_mixed(binding: Mixed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of ``binding``'s module whose rows follow different paths (its entry is ``MIXED``).

    The rows are found from the call: the axis of each tensor whose size is the step's row count. Each group runs
    on inputs of its own (clones, or its own rows), and what a path wrote in place reaches a caller's tensor on
    that path's rows only.
    """
    members: Members = in_effect().mix
    if _is_dynamo():
        return _run_compiled(binding, members, args, kwargs)
    return _run_eager(binding, members, args, kwargs)


def _run_eager(binding: Mixed, members: Members, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A mixed call in eager code: each group of rows through the layer's own dispatch under its policy."""
    rows = ROWS.get(binding.layer_name, Rows("request"))  # an undeclared layer is grouped by the scheduler
    step, name = members.step, binding.layer_name
    groups = step.plan(binding, members, rows)
    if len(groups) == 1:  # the policies differ on the layer, not on its path here (no kernel bound, say)
        try:
            with groups[0].scope:
                return binding.dispatcher(*args, **kwargs)
        except Exception as error:
            raise MixedCallError(groups[0].policies, error) from error
    count = len(step.host_rows)
    call = _Call(name, count, args, kwargs)
    ran = [_run_group(binding, group, call) for group in groups]
    try:
        out = _joined_groups(name, count, groups, ran)
    except UnsplittableCall:
        if all(index is None for index, _ in ran):
            raise
        # Outputs of groups run on their own rows that do not show which axis those are (one row each, and an axis
        # of one): every group on every row instead, joined by mask. Their calls were recorded the first time.
        call.discard(0)
        groups = [
            group._replace(
                rows=None, attempt=None, scope=_recording_scope(group.policies[0], recording=False, recorders=())
            )
            for group in groups
        ]
        out = _joined_groups(name, count, groups, [_run_group(binding, group, call) for group in groups])
    call.write_back()
    return out


def _run_compiled(binding: Mixed, members: Members, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A mixed call where TorchDynamo traces: each entry's path chosen while tracing, as a call of one policy
    chooses it (variants, ``kernel_accepts`` rules, traceability; ``verify`` is ``prefer`` under a tracer), every
    path computed on every row, each row's selected by its slot (an input: the mix changes, the program stays).

    An entry that cannot run here (``require`` without a kernel that compiles) raises while tracing: TorchDynamo
    then runs the frame eagerly, where the call fails those rows' requests only (a ``fullgraph=True`` step fails).
    """
    name, step = binding.layer_name, members.step
    functions: list[Callable[..., Any] | None] = []  # per entry of ``members.entries(name)``; None: the original
    for entry in members.entries(name):
        if entry == "disable":
            functions.append(None)
            continue
        if entry.startswith(VARIANTS):
            path, _, function, _ = binding.choose(entry, "compile", args, kwargs)
        else:
            path = binding.decide(entry, "compile", args, kwargs)[0]
            function = binding.kernel if path == "kernel" else None
        if path == "error":  # a graph break: this call runs eagerly, where these rows' requests fail
            return _UNTRACED[0](binding, members, args, kwargs)
        functions.append(function)
    distinct = list(dict.fromkeys(functions))
    if len(distinct) == 1:
        function = distinct[0]
        return (binding.original if function is None else function)(binding.module, *args, **kwargs)
    lookup = torch.tensor([distinct.index(f) for f in functions], dtype=torch.long, device=step.device)
    choice = lookup[members.entry_index(name)[step.rows]]
    outputs = [
        (binding.original if function is None else function)(binding.module, *args, **kwargs) for function in distinct
    ]
    count = step.rows.shape[0]
    if not all(_shows_rows(value, count) for value in (args, kwargs, *outputs)):
        return _UNTRACED[0](binding, members, args, kwargs)  # it says why, or finds the rows by running
    whole = [(choice == k, output) for k, output in enumerate(outputs[:-1])]
    return _joined(name, count, [*whole, (None, outputs[-1])], [])


def _shows_rows(value: Any, count: int) -> bool:
    """Whether no tensor in ``value`` has several axes of the step's ``count`` rows (checked while tracing)."""
    return all(sum(size == count for size in tensor.shape) <= 1 for tensor in tensors_in(value))


#: :func:`_run_eager` under ``torch.compiler.disable``, called where TorchDynamo traces (a graph break, then the
#: call runs eagerly): made with the first :class:`Step` (it imports TorchDynamo, over a second).
_UNTRACED: list[Callable[[Mixed, Members, tuple[Any, ...], dict[str, Any]], Any]] = []


def _joined_groups(name: str, count: int, groups: list[_Group], ran: list[tuple[torch.Tensor | None, Any]]) -> Any:
    """The outputs of a mixed call's groups, joined per row (see :func:`_joined`)."""
    whole = [(group.mask, output) for group, (index, output) in zip(groups, ran, strict=True) if index is None]
    parts = [(index, output) for index, output in ran if index is not None]
    if not whole:
        return _joined(name, count, [], parts)
    return _joined(name, count, [*whole[:-1], (None, whole[-1][1])], parts)


class _Call:
    """The arguments of one mixed call, as each group gets them (clones, or its own rows), and what each wrote."""

    __slots__ = ("args", "count", "kwargs", "name", "written")

    def __init__(self, name: str, count: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.name, self.count, self.args, self.kwargs = name, count, args, kwargs
        #: Per copy of a caller's tensor: (the tensor, the copy, the copy's version when made, the group's rows,
        #: whether the copy holds every row).
        self.written: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, bool]] = []

    def own(self, rows: torch.Tensor, every_row: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A group's arguments: each tensor with the step's rows cloned (``every_row``) or cut to ``rows``."""

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if self.count not in tensor.shape:
                return tensor  # no row of the step (a table, positions of another length): the same for each group
            if every_row:
                made = tensor.clone()
            else:
                axis = row_axis(tensor, self.count, self.name)
                made = tensor if axis is None else tensor.index_select(axis, rows)
            self.written.append((tensor, made, made._version, rows, every_row))
            return made

        return map_tensors(self.args, copy), map_tensors(self.kwargs, copy)

    def discard(self, mark: int) -> None:
        """Forget the copies made since ``mark`` (a group's attempt that raised: it runs again on its own rows)."""
        del self.written[mark:]

    def write_back(self) -> None:
        """What a path wrote in place into a copy of a caller's tensor, back into it on the group's rows only."""
        for tensor, made, version, rows, every_row in self.written:
            if made._version == version:
                continue
            axis = row_axis(tensor, self.count, self.name)
            if axis is None:
                continue
            with torch.no_grad():
                tensor.index_copy_(axis, rows, made.index_select(axis, rows) if every_row else made)
        self.written.clear()


def _run_group(binding: Mixed, group: _Group, call: _Call) -> tuple[torch.Tensor | None, Any]:
    """One group's call: its rows (None: every row) and its output; its error as :class:`MixedCallError`."""
    index, own_rows = group.rows, group.own
    try:
        if group.attempt is not None:  # every row, the calls held: another group's rows may make the kernel raise
            scope, held = group.attempt
            held.calls.clear()
            mark = len(call.written)
            try:
                args, kwargs = call.own(own_rows, True)
                with scope:
                    output = binding.dispatcher(*args, **kwargs)
            except UnsplittableCall:
                raise
            except Exception:  # noqa: BLE001  # retried below on its own rows, where it stands or is raised
                call.discard(mark)
                index = own_rows  # again on its own rows: the error is theirs, or none
            else:
                for recorder in group.recorders:
                    for made in held.calls:
                        recorder.add(*made)
                return None, output
        with group.scope:
            if index is None:
                args, kwargs = call.own(own_rows, True)
                return None, binding.dispatcher(*args, **kwargs)
            args, kwargs = call.own(index, False)
            return index, binding.dispatcher(*args, **kwargs)
    except UnsplittableCall:
        raise
    except Exception as error:
        raise MixedCallError(group.policies, error) from error


def _joined(
    name: str, count: int, whole: list[tuple[torch.Tensor | None, Any]], parts: list[tuple[torch.Tensor, Any]]
) -> Any:
    """The outputs of the groups joined per row, through tensors, tuples (named too), lists, dicts and dataclasses.

    ``whole``: the outputs of groups that ran on every row, each with its rows' mask, the last one (mask None)
    the base; ``parts``: the outputs of groups that ran on their own rows, with those rows.
    """
    values = [output for _, output in whole] + [output for _, output in parts]
    first = values[0]

    def fields(key: Any) -> tuple[list[tuple[torch.Tensor | None, Any]], list[tuple[torch.Tensor, Any]]]:
        return [(mask, key(output)) for mask, output in whole], [(index, key(output)) for index, output in parts]

    def each(items: list[Any]) -> list[Any]:
        return [_joined(name, count, *fields(lambda output, i=i: output[i])) for i in range(len(items))]

    if isinstance(first, torch.Tensor):
        if not all(isinstance(value, torch.Tensor) for value in values):
            raise UnsplittableCall(name, "a path returned a tensor where another did not", None)
        return _joined_tensor(name, count, whole, parts)
    if isinstance(first, (tuple, list)):
        if any(type(value) is not type(first) or len(value) != len(first) for value in values):
            raise UnsplittableCall(name, "the paths returned sequences of different types or lengths", None)
        joined = each(list(first))
        if isinstance(first, tuple):
            return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
        return joined
    if isinstance(first, dict):
        keys = list(first)
        if any(type(value) is not type(first) or list(value) != keys for value in values):
            raise UnsplittableCall(name, "the paths returned mappings of different types or keys", None)
        mapping = {key: _joined(name, count, *fields(lambda output, key=key: output[key])) for key in keys}
        if type(first) is dict:
            return mapping
        if all(isinstance(key, str) for key in keys):
            return type(first)(**mapping)
        return type(first)(mapping)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if any(type(value) is not type(first) for value in values):
            raise UnsplittableCall(name, "the paths returned different types", None)
        changes = {
            field.name: _joined(name, count, *fields(lambda output, n=field.name: getattr(output, n)))
            for field in dataclasses.fields(first)
            if field.init
        }
        return dataclasses.replace(first, **changes)
    if all(value is first or _equal(value, first) for value in values[1:]):
        return first
    raise UnsplittableCall(name, f"the paths returned different values of {type(first).__name__}, not rows", None)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  # a value without a plain equality is not the same value
        return False


def _joined_tensor(
    name: str, count: int, whole: list[tuple[torch.Tensor | None, Any]], parts: list[tuple[torch.Tensor, Any]]
) -> torch.Tensor:
    """One tensor of the outputs joined on its axis of the step's rows (see :func:`_joined`)."""
    if whole:
        base: torch.Tensor = whole[-1][1]
        axis = row_axis(base, count, name)
        if axis is None or any(output.shape != base.shape for _, output in whole):
            return _same(name, [output for _, output in whole] + [output for _, output in parts])
        shape = [1] * base.dim()
        shape[axis] = count
        out = base
        for mask, output in whole[-2::-1]:
            assert mask is not None
            out = torch.where(mask.view(shape), output, out)
        for index, output in parts:
            if output.dim() != base.dim() or output.shape[axis] != index.shape[0]:
                raise UnsplittableCall(name, f"a group's output of shape {tuple(output.shape)}", None)
            out = out.index_copy(axis, index, output)  # a new tensor: ``out`` may be a module's own
        return out
    outputs: list[torch.Tensor] = [output for _, output in parts]
    first = outputs[0]
    fits = [
        axis
        for axis in range(first.dim())
        if all(o.dim() == first.dim() for o in outputs)
        and sum(o.shape[axis] for o in outputs) == count
        and all(
            o.shape[a] == first.shape[a] and o.shape[axis] == i.shape[0]
            for i, o in parts
            for a in range(first.dim())
            if a != axis
        )
    ]
    if len(fits) != 1:
        if not fits:
            return _same(name, outputs)
        raise UnsplittableCall(name, f"{count} rows and outputs of shapes {[tuple(o.shape) for o in outputs]}", count)
    axis = fits[0]
    shape = list(first.shape)
    shape[axis] = count
    out = first.new_empty(shape)
    for index, output in parts:
        out.index_copy_(axis, index, output)
    return out


def _same(name: str, outputs: list[torch.Tensor]) -> torch.Tensor:
    """An output without the step's rows: one value for the whole call, which every path must agree on."""
    first = outputs[0]
    if all(o.shape == first.shape and torch.equal(o, first) for o in outputs[1:]):
        return first
    raise UnsplittableCall(
        name, f"an output of shape {tuple(first.shape)} without the step's rows differs by path", None
    )

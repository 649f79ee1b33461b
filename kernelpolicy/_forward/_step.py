"""A continuous-batching step whose rows follow several policies: its slots, its tables and its groups of rows.

This module owns :class:`Step` (one per batching manager: each row's slot as a tensor, a per-batch input, so one
compiled program serves every mix; a slot is a policy's while requests of it are in flight), :class:`Members` (what
a mixed step's table carries: the policies served together, per layer whose slots have the kernel on and which entry
each slot's policy gives), the row declarations' type :class:`Rows`, and :meth:`Step.plan`, the groups of rows of a
mixed call (the policies that agree on the layer) with the scope each runs in (:class:`GroupScope`). A step's groups
are made at its first call of each layer and kept for the steps after it while its rows, their slots' policies and
their recorders stay the same (a decode step is most often its predecessor's rows again): a mixed call then pays
for no mask, index or scope of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol, final

import torch

from .._context._active import _SCOPED, DEFAULTS, RECORDERS, Active, activate_mixed, known_layers
from .._context._scope import _recording_scope

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping
    from contextvars import Token

    from torch import nn

    from .._values._policy import Policy

__all__ = ["Group", "GroupScope", "Held", "Join", "Kind", "Members", "Mixed", "Rows", "Step"]

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
    @property
    def direct_kernel(self) -> Callable[..., Any] | None: ...
    def has_aware_children(self) -> bool: ...
    def decide(
        self, mode: str, state: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[str, str]: ...
    def choose(
        self, entry: str, state: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[str, str, Callable[..., Any] | None, str | None]: ...


class Rows(NamedTuple):
    """How a kernel layer's rows may be mixed: ``by`` (token or request) and the join of eager calls."""

    by: Kind
    #: Declared before rows were found from each call (``_row_join``): kept for those declarations, not read.
    dim: int = -2
    #: How eager calls join the paths; compiled programs always select (static shapes).
    join: Join = "select"


class Held:
    """A recorder that holds the calls of an attempt on every row until the attempt is known to stand."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add(self, *call: Any) -> None:
        self.calls.append(call)


class GroupScope:
    """A group's policy and recorders in effect for its calls: ``kernel_policy(policy)`` (checked and resolved as it
    is) once for the step's plan, since a group's call is always entered in the step's table and records as the
    group does; entering it then sets two context variables. Re-entrant (a layer called inside itself)."""

    __slots__ = ("_active", "_scope", "_tokens", "recorders")

    def __init__(self, policy: Policy, recording: bool, recorders: tuple[Any, ...]) -> None:
        self._scope = _recording_scope(policy, recording=recording, recorders=recorders)
        self.recorders = recorders
        self._active: Active | None = None
        self._tokens: list[tuple[Token[Active], Token[tuple[Any, ...]]]] = []

    def __enter__(self) -> None:
        active = self._active
        if active is None:
            active = self._active = self._scope.entered(DEFAULTS.active._current)
        self._tokens.append((_SCOPED.set(active), RECORDERS.set(self.recorders)))

    def __exit__(self, *exc_info: object) -> None:
        scoped, recorders = self._tokens.pop()
        RECORDERS.reset(recorders)
        _SCOPED.reset(scoped)


class Group(NamedTuple):
    scope: GroupScope  # the scope of the group's first policy (they agree on the layer), with the group's recorders
    policies: tuple[Policy, ...]
    mask: torch.Tensor  # (rows,) bool: the group's rows
    rows: torch.Tensor | None  # the group's rows, where it runs on them only (a split join, or fallback_on)
    own: torch.Tensor  # the group's rows, always (what its path may write back)
    recorders: tuple[Any, ...]
    #: For a group that runs on every row of a layer by token: the scope of that attempt, whose calls are held.
    attempt: tuple[GroupScope, Held] | None
    #: What its path is (entry and options, or its policy where the layer has policy-aware layers inside): the key
    #: of what the path was seen writing (``_mixing._WRITES``).
    path: Any = None
    #: ``mask`` shaped to select along an output's row axis, per (the output's dimensions, its row axis).
    views: dict[tuple[int, int], torch.Tensor] | None = None
    #: What the group's path is whatever the call's arguments, where its forward would decide nothing per call
    #: (no recorder, no ``fallback_on``, no layer inside that reads the policy): ``"original"``, or ``"kernel"``
    #: (the binding's ``direct_kernel``, if it has one when called); None: through its scope and forward.
    direct: Literal["kernel", "original"] | None = None


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
        "_rows_of",
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
        #: The groups of each layer's calls (:meth:`plan`), kept while the step's rows, their slots' policies and
        #: the recorders stay (a decode step is most often its predecessor's rows again).
        self._plans: dict[tuple[Any, ...], list[Group]] = {}
        #: Per set of slots, its rows in this step: a mask and their positions (on the device), kept while the rows are.
        self._rows_of: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

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
            self._plans.clear()  # a slot's policy changed: its groups may
        return found

    def release(self, alive: Collection[Policy]) -> None:
        """Free the slots of the policies not in ``alive`` (no request of theirs in flight), and their tables."""
        gone = {slot for policy, slot in self.slot_of.items() if policy not in alive}
        if not gone:
            return
        for slot in gone:
            del self.slot_of[self.policies[slot]]
        self.free.extend(sorted(gone, reverse=True))
        self._plans.clear()
        self.tables = {key: table for key, table in self.tables.items() if gone.isdisjoint(key[0])}

    def begin(self, rows: torch.Tensor, host_rows: list[int], recorders: dict[int, tuple[Any, ...]]) -> None:
        """A new step: its rows' slots (device and host) and the recorders of each slot's requests."""
        same = host_rows == self.host_rows
        if not same:
            self._rows_of.clear()
        if not same or recorders != self.recorders:
            self._plans.clear()
        self.rows, self.host_rows, self.recorders = rows, host_rows, recorders

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

    def plan(self, binding: Mixed, members: Members, rows: Rows) -> list[Group]:
        """The groups of rows of ``binding``'s layer in this step (kept while the step's rows are, see ``_plans``)."""
        nested = binding.has_aware_children()
        without_kernel = binding.kernel is None and not binding.variants
        key = (binding.layer_name, nested, without_kernel, members.slots, rows)
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
        for slots in keyed.values():
            mask, own_rows = self.rows_of(tuple(slots))
            recorders = tuple(dict.fromkeys(r for slot in slots for r in self.recorders.get(slot, ())))
            policy = self.policies[slots[0]]
            # A group runs on its own rows where the join splits, and where running on others' rows would cost
            # or count what is its own: verify runs the original too, fallback_on counts failures.
            own = rows.join == "split" or (
                rows.by == "token"
                and (bool(policy.fallback_on) or (policy.mode_for(name) == "verify" and not without_kernel))
            )
            index = own_rows if own else None
            scope = GroupScope(policy, bool(recorders), recorders)
            attempt = None
            if not own and rows.by == "token":
                held = Held()
                attempt = (GroupScope(policy, bool(recorders), (held,)), held)
            policies = tuple(self.policies[s] for s in slots)
            entry = policy.entry_for(name)
            written = policy if nested else (entry, policy.options)
            direct = _direct(entry, without_kernel) if not (nested or recorders or policy.fallback_on) else None
            groups.append(Group(scope, policies, mask, index, own_rows, recorders, attempt, written, {}, direct))
        self._plans[key] = groups
        return groups

    def rows_of(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``slots`` in this step: a mask of the step's rows and their positions (on the device)."""
        found = self._rows_of.get(slots)
        if found is None:
            chosen = set(slots)
            mask = [slot in chosen for slot in self.host_rows]
            positions = [i for i, on in enumerate(mask) if on]
            found = self._rows_of[slots] = (
                torch.tensor(mask, dtype=torch.bool, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
            )
        return found


def _direct(entry: str, without_kernel: bool) -> Literal["kernel", "original"] | None:
    """The path a forward takes under ``entry`` whatever the call (in eager code without grad), if it is one."""
    if entry == "disable" or (without_kernel and entry == "prefer"):
        return "original"
    if entry in ("prefer", "require") and not without_kernel:
        return "kernel"
    return None


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

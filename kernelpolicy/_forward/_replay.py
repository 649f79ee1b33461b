"""Recomputation: a forward that PyTorch runs again during ``backward()`` takes the path its first run took.

This module owns what a policy-aware forward does beyond its decision
(:meth:`Replays.check`, called by every forward that has a kernel to choose).
The forward keeps one cache, its ``last`` cell: calls under ``no_grad`` or
``inference_mode`` with the policy table of the previous one cost one identity
test; a call under another table, and every call with grad enabled, is checked.

Activation checkpointing runs a forward again inside ``backward()`` to
recompute what it did not keep: ``torch.utils.checkpoint.checkpoint`` in both
modes, ``checkpoint_sequential``, ``checkpoint_wrapper`` and
``apply_activation_checkpointing``, FSDP2's activation checkpointing and
training frameworks that call them. torch restores the RNG and autocast state
of the forward for it, not context variables: the recomputation runs under the
policy of whoever calls ``backward()``. So the forward records, and the
recomputation replays:

- **Recording.** A call that autograd records (grad enabled, outside a
  backward pass) inside a non-reentrant checkpoint notes the policy in effect
  under that checkpoint's frame (found on torch's saved-tensor hooks), one
  entry per call, kept as long as the frame (that is, the autograd graph)
  lives. A reentrant checkpoint runs its forward pass under ``no_grad``: there
  the policy of the module's last call under ``no_grad`` is what is known, and
  it is also the policy of grad-enabled calls that the cache let through
  unrecorded (the same table as that call's).
- **Replaying.** A call inside a backward pass (``torch._C._current_graph_task_id()``
  is not -1) is a recomputation. It finds the recorded policy: of the same
  call of the same frame (non-reentrant), else the module's last ``no_grad``
  call when a custom autograd function's backward recomputes (reentrant), else
  the one policy of every live frame's record and of the last ``no_grad`` call.
  Where that policy is not the
  one in effect, the call runs under it (a scope, so nested layers and scopes
  inside the forward replay too).
- **Refusing.** Where the forward's path cannot be told (no record of its own,
  and candidates under policies that take different paths), or cannot be
  taken again (a kernel without backward that a reentrant checkpoint's
  ``no_grad`` forward pass ran), the recomputation raises
  :class:`RecomputationError` naming the module, both policies and the fix.

The limit: the policy of a call under ``no_grad`` is known only until the
module's next call under ``no_grad``. A module that runs under ``no_grad`` and
another policy between a reentrant checkpoint's forward pass (or a training
forward that followed a ``no_grad`` call under its own policy) and its
``backward()`` is replayed under that other policy.

:func:`kernelpolicy.training.checkpoint` carries the policy of the call itself
and is exact in every case; inside it, the records agree with its scope.
Under TorchDynamo the recomputation is part of the compiled graph and none of
this runs.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, final

import torch

from .._compat import _compat
from .._context._scope import kernel_policy
from .._values._errors import RecomputationError

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from .._context._active import Active

__all__ = ["GO_ON", "REPLAYING", "Replayed", "Replays"]

#: What :meth:`Replays.check` returns when the forward goes on as usual (no replay).
GO_ON: Final = object()
#: Set while a replayed call runs, so that the forward it calls again does not replay a second time, and
#: while :func:`kernelpolicy.training.checkpoint` runs its function under the policy it carries.
REPLAYING: ContextVar[bool] = ContextVar("kernelpolicy.replaying", default=False)
_NOT_FOUND: Final = object()


class Replayed(Protocol):
    """What :class:`Replays` reads of its module's binding (``_binding.Binding``, a layer above, satisfies it).

    ``decide``'s path is a ``_dispatch.Path`` (a layer above) and its state an ``ExecutionState`` (``_state``,
    a sibling): here only the state this module asks for and the path as the string it compares.
    """

    @property
    def module(self) -> nn.Module: ...
    @property
    def module_name(self) -> str | None: ...
    @property
    def module_class(self) -> str: ...
    @property
    def layer_name(self) -> str: ...
    def decide(
        self, mode: str, state: Literal["eager"], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[str, str]: ...


@final
class _Calls:
    """The policies of one module's calls under one checkpoint frame, in call order, and each backward's cursor."""

    __slots__ = ("cursor", "tables")

    def __init__(self) -> None:
        self.tables: list[Active] = []
        self.cursor: dict[int, int] = {}

    def next(self, graph_task: int) -> Active:
        """The table of the next call that backward ``graph_task`` recomputes (the last one past the end)."""
        index = self.cursor.get(graph_task, 0)
        self.cursor[graph_task] = index + 1
        return self.tables[min(index, len(self.tables) - 1)]


@final
class Replays:
    """What one policy-aware module recorded for the recomputations of its calls (see the module docstring)."""

    __slots__ = ("binding", "cell", "frames", "nograd")

    def __init__(self, binding: Replayed) -> None:
        self.binding = binding
        #: The forward's ``last`` closure cell (set by ``_dispatch.make_forward``): its cache of :meth:`check`.
        self.cell: Any = None
        #: The table of the module's last call under ``no_grad`` that :meth:`check` saw (the same table as every
        #: later ``no_grad`` call until one under another table): what a reentrant checkpoint's forward ran under.
        self.nograd: Active | None = None
        #: Checkpoint frame (a weak reference, gone with the autograd graph) -> the calls recorded under it.
        self.frames: dict[weakref.ref[Any], _Calls] = {}

    def check(self, active: Active, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call the forward's cache does not cover: note, record or replay it; :data:`GO_ON` to go on.

        The forward calls this where ``active`` is not its ``last`` cell (and, for a kernel without backward,
        whenever grad is enabled). Under ``no_grad`` the cell then holds ``active``: the next calls under
        the same table skip this, at the cost of one identity test. With grad enabled the cell is cleared,
        so that every call is checked: recorded per checkpoint frame in a forward pass, replayed in backward.
        """
        cell = self.cell
        if not torch.is_grad_enabled():
            self.nograd = active
            if cell is not None:
                cell.cell_contents = active
            return GO_ON
        if cell is not None:
            cell.cell_contents = None
        graph_task = _graph_task()
        if graph_task == -1:
            frame = _frame_of_hooks(recording=True)  # None at once without saved-tensor hooks
            if frame is not None:
                self._record(frame, active)
            return GO_ON
        if REPLAYING.get():
            return GO_ON
        table = self._replayed(graph_task, active, args, kwargs)
        if table is None or table.policy == active.policy:
            return GO_ON
        token = REPLAYING.set(True)
        try:
            with kernel_policy(table.policy):
                return self.binding.module.forward(*args, **kwargs)
        finally:
            REPLAYING.reset(token)

    def _record(self, frame: object, active: Active) -> None:
        key = weakref.ref(frame)
        calls = self.frames.get(key)
        if calls is None:
            frames = self.frames
            calls = frames[weakref.ref(frame, lambda ref: frames.pop(ref, None))] = _Calls()
        calls.tables.append(active)

    def _replayed(
        self, graph_task: int, active: Active, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Active | None:
        """The table the forward being recomputed ran under; None where nothing was recorded for it."""
        frame = _frame_of_hooks(recording=False)
        if frame is not None:
            calls = self.frames.get(weakref.ref(frame))
            if calls is not None:
                return calls.next(graph_task)
        elif (node := _compat.resolve(_compat.AUTOGRAD_NODE)) is not None and isinstance(
            node(), torch.autograd.function.BackwardCFunction
        ):
            return self._reentrant(active, args, kwargs)
        # Calls the forward's cache let through unrecorded ran under the table of the last no_grad call.
        live = [calls.tables[-1] for calls in self.frames.values() if calls.tables]
        if self.nograd is not None:
            live.append(self.nograd)
        layer = self.binding.layer_name
        entries = {table.policy.entry_for(layer): table for table in live}
        if len(entries) > 1:
            first, second = list(entries.values())[:2]
            raise self._error(
                f"its forward passes still to be recomputed ran under {first.policy} and {second.policy}, "
                "which take different paths, and this recomputation cannot tell which it replays",
                "checkpoint with kernelpolicy.training.checkpoint (it carries each checkpoint's policy), "
                "or call backward() before a forward under another policy",
            )
        return live[-1] if live else None

    def _reentrant(self, active: Active, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Active | None:
        """A custom autograd function's backward recomputes (a reentrant checkpoint): the last ``no_grad`` call's table.

        Raises where that call took a kernel without backward, which the recomputation (with grad) cannot.
        """
        binding = self.binding
        table = self.nograd
        if table is None:
            return None
        entry = table.policy.entry_for(binding.layer_name)
        with torch.no_grad():
            before, _ = binding.decide(entry, "eager", args, kwargs)
        now, reason = binding.decide(entry, "eager", args, kwargs)
        if before == "kernel" and now != "kernel":
            raise self._error(
                f"its forward pass ran the kernel under {table.policy} with grad disabled (a reentrant checkpoint), "
                f"and with grad enabled it cannot: {reason} (the recomputation runs under {active.policy})",
                "checkpoint with kernelpolicy.training.checkpoint (its forward pass gives way too) "
                "or with use_reentrant=False",
            )
        return table

    def _error(self, why: str, fix: str) -> RecomputationError:
        binding = self.binding
        where = f"module {binding.module_name!r}" if binding.module_name else "a module"
        return RecomputationError(
            f"the recomputation in backward() of {where} ({binding.module_class}, kernel layer "
            f"{binding.layer_name!r}) would take another path than its forward pass: {why}. Fix: {fix}."
        )


def _resolve_graph_task() -> int:
    """torch's id of the backward pass running this call, -1 outside one: :data:`_graph_task` at its first call."""
    global _graph_task
    found = _compat.resolve(_compat.GRAPH_TASK_ID)
    _graph_task = found if found is not None else _outside_backward
    return _graph_task()


def _outside_backward() -> int:
    return -1


def _resolve_top_hooks(ignore_is_tracing: bool) -> tuple[Any, Any] | None:
    """torch's innermost saved-tensor hooks, or None: :data:`_top_hooks` at its first call (missing: never any)."""
    global _top_hooks
    found = _compat.resolve(_compat.SAVED_TENSOR_HOOKS)
    _top_hooks = found if found is not None else _no_hooks
    return _top_hooks(ignore_is_tracing)


def _no_hooks(ignore_is_tracing: bool) -> None:
    return None


def _frame_of_hooks(recording: bool) -> object | None:
    """The checkpoint frame whose saved-tensor hooks are innermost (recorded or recomputed), or None.

    Recording without torch's frame class (a release that moved it): the innermost unpack hook stands in,
    which lives as long as the saved tensors of the graph it packed.
    """
    hooks = _top_hooks(False)
    if hooks is None:
        return None
    frame_class = _READERS.get("frame", _NOT_FOUND)
    if frame_class is _NOT_FOUND:
        frame_class = _READERS["frame"] = _compat.resolve(_compat.CHECKPOINT_FRAME)
    if frame_class is None:
        return hooks[1] if recording else None
    return _find_frame(hooks[0], frame_class, 3)


def _find_frame(function: Any, frame_class: type, depth: int) -> object | None:
    """The frame that ``function``'s closure holds, directly, by weak reference or through a wrapped function."""
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, weakref.ref):
            value = value()
        if isinstance(value, frame_class):
            return value
        if depth > 1 and callable(value):
            found = _find_frame(value, frame_class, depth - 1)
            if found is not None:
                return found
    return None


#: The readers of torch's state the replay uses, each resolved (and told of, if missing) at its first call.
_graph_task: Callable[[], int] = _resolve_graph_task
_top_hooks: Callable[[bool], tuple[Any, Any] | None] = _resolve_top_hooks
#: torch's checkpoint frame class, resolved at the first call of :func:`_frame_of_hooks` (None: missing).
_READERS: dict[str, Any] = {}

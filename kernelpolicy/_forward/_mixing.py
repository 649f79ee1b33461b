"""Mixed calls: one forward call whose rows follow several policies (one continuous-batching step for all).

This module owns:

- the row declarations (:func:`declare_rows`, :data:`ROWS`): how a kernel layer's output rows depend on its
  input rows, so that rows of different policies may share one call. ``"token"``: each row on its own (norms,
  activations, MLPs, MoE, rotary embedding); ``"request"``: the rows of one request together (attention over
  a request's own tokens, by the batch's sequence boundaries). A layer declared by neither is never mixed:
  the batching scheduler groups the steps where its paths would differ (``kernelpolicy.batching``). A
  declaration says how rows depend on each other, never where they are: that is found from each call
  (``_row_join``);
- how eager calls join the paths (:data:`JOINS`): ``"select"`` runs each path on every row (on clones) and keeps
  each row's own; ``"split"`` runs each path on its own rows only (less work, shapes that vary per step);
- :func:`mixed_scope`, the scope a step runs in, and :func:`run_mixed`, one call of a layer whose entries differ
  between the step's policies (a step's slots, tables and groups of rows: ``_step``).

In eager code each group of rows (the policies that agree on the layer) runs the module's own dispatch under
its policy, so ``require``, ``verify``, ``fallback_on``, variants and ``record_calls`` behave per group as
they do for a whole call; an error a group raises comes out as :class:`MixedCallError` naming the group's
policies, so the batching fails only their requests. A group's error is its own rows' only: a group that ran
on every row (a select join) and raised runs again on its own rows (rows by token), and a group whose policy
may fall back (``fallback_on``) or verifies runs on its own rows from the start, so that another group's rows
never make its kernel fail, fall back or trip, nor cost its comparison. Under TorchDynamo each distinct entry's
path is chosen while tracing and computed on every row, and each row's is selected by its slot's entry index (an
input): no guard depends on the mix. A call whose shapes do not show its rows raises
:class:`~kernelpolicy._forward._row_join.UnsplittableCall` for the batching seam, which runs the step one policy at a
time.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any, Final

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._context._active import _SCOPED, RECORDERS, Active, in_effect, known_layers
from .._values._errors import PolicyError
from .._values._policy import VARIANTS
from ._row_join import GroupInputs, UnsplittableCall, joined, row_axis, shows_rows
from ._step import Group, GroupScope, Join, Kind, Members, Mixed, Rows, Step

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator

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
    "kept_apart",
    "mixable",
    "mixed_scope",
    "row_axis",
    "run_mixed",
]


KINDS: Final = ("token", "request")
JOINS: Final = ("select", "split")


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
    "attention": Rows("request"),
}
_LOCK = threading.Lock()


def declare_rows(layer_name: str, by: Kind, *, dim: int = -2, join: Join = "select") -> None:
    """Declare how the rows of kernel layer ``layer_name`` may follow different policies in one call.

    ``by="token"``: each output row depends on its own input row only (a norm, an activation, an MLP).
    ``by="request"``: on the rows of its own request (attention over a request's tokens): such a layer, like one
    declared by neither, keeps the policies whose paths differ on it in steps of their own. ``join`` is how eager
    calls join the paths (``"select"``: each path on every row, on clones; ``"split"``: each on its own rows).
    Where the rows are is found from each call (``_row_join``); ``dim`` is checked and no longer read.

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
        if not kept_apart(name, grouped):
            continue
        first = policies[0]
        facts = (first.entry_for(name), first.options)
        if any((policy.entry_for(name), policy.options) != facts for policy in policies[1:]):
            return False
    return True


def kept_apart(name: str, grouped: Collection[str] = ()) -> bool:
    """Whether rows of policies whose paths differ on layer ``name`` never share a call of it: an undeclared layer, a
    layer whose rows go by request (its kernel would see other requests' rows: their inputs could make it fail, fall
    back or trip for them), or one found unsplittable (in ``grouped``)."""
    declared = ROWS.get(name)
    return declared is None or declared.by == "request" or name in grouped


class MixedCallError(Exception):
    """A group of rows of a mixed call raised ``error``: the requests of ``policies`` failed, no others."""

    def __init__(self, policies: tuple[Policy, ...], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error} (rows of {', '.join(repr(str(p)) for p in policies)})")
        self.policies = policies
        self.error = error


@contextlib.contextmanager
def mixed_scope(active: Active, recorders: tuple[Any, ...]) -> Iterator[None]:
    """Put a step's table (plain or mixed) in effect for the step, with the recorders of its requests."""
    if not _UNTRACED:
        compiler: Any = torch.compiler  # disable: untyped in some torch releases (mypy strict on each)
        _UNTRACED.append(compiler.disable(_run_eager, recursive=True))
    token = _SCOPED.set(active)
    recording = RECORDERS.set(recorders)
    try:
        yield
    finally:
        RECORDERS.reset(recording)
        _SCOPED.reset(token)


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
    if len(groups) > 1 and rows.by == "request":  # kept apart (see kept_apart): this step runs a policy at a time
        raise UnsplittableCall(name, "its rows go by request: each policy's requests run in a step of their own", None)
    if len(groups) == 1:  # the policies differ on the layer, not on its path here (no kernel bound, say)
        group = groups[0]
        try:
            function = _function(binding, group)
            if function is not None:
                try:
                    return function(binding.module, *args, **kwargs)
                except NotImplementedError:
                    if function is binding.original:
                        raise
                    # a kernel that does not support the call: its forward says what that does, below
            with group.scope:
                return binding.dispatcher(*args, **kwargs)
        except Exception as error:
            raise MixedCallError(group.policies, error) from error
    count = len(step.host_rows)
    out = _run_direct(binding, groups, count, args, kwargs)
    if out is not _GENERAL:
        return out
    call = GroupInputs(name, count, args, kwargs)
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
            group._replace(rows=None, attempt=None, scope=GroupScope(group.policies[0], False, ())) for group in groups
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
    if len(distinct) > 1 and kept_apart(name):
        return _UNTRACED[0](binding, members, args, kwargs)  # the eager call says so: the step runs apart
    if len(distinct) == 1:
        function = distinct[0]
        return (binding.original if function is None else function)(binding.module, *args, **kwargs)
    lookup = torch.tensor([distinct.index(f) for f in functions], dtype=torch.long, device=step.device)
    choice = lookup[members.entry_index(name)[step.rows]]
    outputs = [
        (binding.original if function is None else function)(binding.module, *args, **kwargs) for function in distinct
    ]
    count = step.rows.shape[0]
    if not all(shows_rows(value, count) for value in (args, kwargs, *outputs)):
        return _UNTRACED[0](binding, members, args, kwargs)  # it says why, or finds the rows by running
    whole = [(choice == k, output) for k, output in enumerate(outputs[:-1])]
    return joined(name, count, [*whole, (None, outputs[-1])], [])


#: :func:`_run_eager` under ``torch.compiler.disable``, called where TorchDynamo traces (a graph break, then the
#: call runs eagerly): made when the first mixed step is entered (it imports TorchDynamo, over a second).
_UNTRACED: list[Callable[[Mixed, Members, tuple[Any, ...], dict[str, Any]], Any]] = []


#: Per module, per path of a group (its entry and options, or its policy where the layer has policy-aware layers
#: inside), whether that path was seen writing its inputs in place: paths seen not to share the caller's tensors
#: instead of clones (checked after each call: one that writes after all runs its step again, cloned from then on).
_WRITES: weakref.WeakKeyDictionary[nn.Module, dict[Any, bool]] = weakref.WeakKeyDictionary()


def _writes(binding: Mixed, group: Group) -> bool:
    """Whether ``group``'s path gets clones of the caller's tensors: unless it was seen not to write them."""
    seen = _WRITES.get(binding.module)
    return True if seen is None else seen.get(group.path, True)


def _seen(binding: Mixed, group: Group, call: GroupInputs, mark: int, cloned: bool) -> None:
    """Remember whether ``group``'s path wrote its inputs; one given the caller's own that wrote: run apart."""
    try:
        wrote = call.wrote(mark)
    except UnsplittableCall:
        _WRITES.setdefault(binding.module, {})[group.path] = True
        raise
    if cloned:  # the first calls of a path (or one seen writing): what it does now is what it is seen doing
        _WRITES.setdefault(binding.module, {})[group.path] = wrote


def _joined_groups(name: str, count: int, groups: list[Group], ran: list[tuple[torch.Tensor | None, Any]]) -> Any:
    """The outputs of a mixed call's groups, joined per row (see :func:`_joined`)."""
    last = ran[-1][1]
    if isinstance(last, torch.Tensor) and all(index is None for index, _ in ran):
        # Tensors of every row (a select join): each group's rows by its mask, shaped once per output shape.
        shape = last.shape
        if all(isinstance(output, torch.Tensor) and output.shape == shape for _, output in ran):
            axis = row_axis(last, count, name)
            if axis is not None:
                out = last
                for group, (_, output) in zip(groups[-2::-1], ran[-2::-1], strict=True):
                    out = torch.where(_mask_along(group, len(shape), axis), output, out)
                return out
    whole = [(group.mask, output) for group, (index, output) in zip(groups, ran, strict=True) if index is None]
    parts = [(index, output) for index, output in ran if index is not None]
    if not whole:
        return joined(name, count, [], parts)
    return joined(name, count, [*whole[:-1], (None, whole[-1][1])], parts)


def _mask_along(group: Group, dims: int, axis: int) -> torch.Tensor:
    """``group``'s mask shaped to select along ``axis`` of a tensor of ``dims`` dimensions (made once per plan)."""
    assert group.views is not None
    found = group.views.get((dims, axis))
    if found is None:
        shape = [1] * dims
        shape[axis] = group.mask.shape[0]
        found = group.views[dims, axis] = group.mask.view(shape)
    return found


#: What :func:`_run_direct` returns where the call goes the general way.
_GENERAL: Final = object()


def _function(binding: Mixed, group: Group) -> Callable[..., Any] | None:
    """``group``'s path as a function called ``f(module, *args, **kwargs)`` where its forward would decide nothing
    per call (``Group.direct``, and grad off: no recomputation to record), else None."""
    if group.direct is None or torch.is_grad_enabled():
        return None
    return binding.original if group.direct == "original" else binding.direct_kernel


def _run_direct(binding: Mixed, groups: list[Group], count: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A mixed call whose groups all run their paths as functions (:func:`_function`), without scopes or forwards:
    a group on every row gets the caller's own tensors (its path seen not to write them, their versions checked
    after), one on its own rows a copy of them. :data:`_GENERAL` where a group cannot, or one raised: the call then
    goes the general way (which runs each group again, as its forward says)."""
    seen = _WRITES.get(binding.module)
    functions = []
    for group in groups:
        function = _function(binding, group)
        if function is None or (group.rows is None and (seen is None or seen.get(group.path, True))):
            return _GENERAL
        functions.append(function)
    name = binding.layer_name
    call = GroupInputs(name, count, args, kwargs)
    ran: list[tuple[torch.Tensor | None, Any]] = []
    for group, function in zip(groups, functions, strict=True):
        mark = len(call.written)
        own_args, own_kwargs = call.own(group.own, True, False) if group.rows is None else call.own(group.rows, False)
        try:
            output = function(binding.module, *own_args, **own_kwargs)
        except Exception:  # noqa: BLE001  # the general way runs it again and says what its forward does
            call.wrote_shared(mark)
            return _GENERAL
        if group.rows is None:
            _seen(binding, group, call, mark, False)
        ran.append((group.rows, output))
    try:
        out = _joined_groups(name, count, groups, ran)
    except UnsplittableCall:
        if all(index is None for index, _ in ran):
            raise
        return _GENERAL  # the general way runs every group on every row instead
    call.write_back()
    return out


def _run_group(binding: Mixed, group: Group, call: GroupInputs) -> tuple[torch.Tensor | None, Any]:
    """One group's call: its rows (None: every row) and its output; its error as :class:`MixedCallError`."""
    index, own_rows = group.rows, group.own
    try:
        if group.attempt is not None:  # every row, the calls held: another group's rows may make the kernel raise
            scope, held = group.attempt
            held.calls.clear()
            mark = len(call.written)
            try:
                cloned = _writes(binding, group)
                args, kwargs = call.own(own_rows, True, cloned)
                with scope:
                    output = binding.dispatcher(*args, **kwargs)
                _seen(binding, group, call, mark, cloned)
            except UnsplittableCall:
                raise
            except Exception:  # noqa: BLE001  # retried below on its own rows, where it stands or is raised
                call.wrote_shared(mark)
                call.discard(mark)
                index = own_rows  # again on its own rows: the error is theirs, or none
            else:
                for recorder in group.recorders:
                    for made in held.calls:
                        recorder.add(*made)
                return None, output
        with group.scope:
            if index is None:
                mark = len(call.written)
                cloned = _writes(binding, group)
                args, kwargs = call.own(own_rows, True, cloned)
                output = binding.dispatcher(*args, **kwargs)
                _seen(binding, group, call, mark, cloned)
                return None, output
            args, kwargs = call.own(index, False)
            return index, binding.dispatcher(*args, **kwargs)
    except UnsplittableCall:
        raise
    except Exception as error:
        raise MixedCallError(group.policies, error) from error

"""kernelpolicy for torch.distributed jobs: every rank of a process group under one policy, on the same paths.

This module owns :func:`check_consistent` and :func:`broadcast_policy`, and
:func:`run_on_local_shards`, the declaration that lets a kernel run on the
local shards of DTensor arguments; it imports ``torch.distributed`` when one
of them needs it. Scopes are per
process, so the ranks of a job can disagree: one rank under ``require``
raising while the others enter a collective and wait for it until the process
group's timeout (30 minutes by default), or ranks silently running different
kernels. Both functions are collectives: every rank of the group calls them,
at the same point of the program.

>>> import kernelpolicy.distributed
>>> kernelpolicy.distributed.check_consistent()
Traceback (most recent call last):
...
RuntimeError: kernelpolicy.distributed.check_consistent needs an initialised torch.distributed process group (torch.distributed.init_process_group)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._context._active import current_policy
from ._context._scope import kernel_policy
from ._values._errors import PolicyMismatchError  # public here: only this module raises it
from ._values._policy import Policy, check_layer_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

__all__ = ["PolicyMismatchError", "broadcast_policy", "check_consistent", "local_shard_layers", "run_on_local_shards"]


def _dist(what: str) -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"kernelpolicy.distributed.{what} needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    return dist


def check_consistent(model: nn.Module | None = None, *, group: Any = None) -> Policy:
    """Check that every rank of ``group`` (default: the world) has this rank's policy and paths; return the policy.

    A collective (one ``torch.distributed.all_gather_object``): call it on
    every rank, for example inside the training or evaluation loop's scope
    before the first step. With ``model``, each rank also reports the path of
    every kernel layer of its model (``kernel``, ``original`` or ``error``, and
    why, as :func:`~kernelpolicy.explain` says; the paths are compared, the
    reasons only shown, since they may name a rank's device or its recovered
    failures), so a kernel that failed to
    load on one node, or ``require`` failing on one rank only, shows before the
    first step instead of as a hang. On a mismatch every rank raises the same
    :class:`PolicyMismatchError`, listing the ranks and what they
    reported, so all ranks stop together.
    """
    dist = _dist("check_consistent")
    policy = current_policy()
    paths: dict[str, tuple[str, str]] | None = None
    if model is not None:
        from ._tell._explain import explain

        paths = {row.name: (row.path, row.reason) for row in explain(model)}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (str(policy), paths), group=group)
    problems: list[str] = []
    policies = [text for text, _ in gathered]
    if len(set(policies)) > 1:
        problems.append("policies differ: " + ", ".join(f"rank {r}: {text!r}" for r, text in enumerate(policies)))
    reported = [found for _, found in gathered]
    if any(found is None for found in reported) and not all(found is None for found in reported):
        problems.append("ranks without a model: " + ", ".join(str(r) for r, f in enumerate(reported) if f is None))
    elif paths is not None:
        for name in sorted(set().union(*reported)):
            per_rank = [found.get(name, ("absent", "")) for found in reported]
            if len({path for path, _ in per_rank}) > 1:  # the path, not why (a reason may name a device)
                said = (f"{path} ({reason})" if reason else path for path, reason in per_rank)
                problems.append(f"layer {name!r}: " + ", ".join(f"rank {r}: {text}" for r, text in enumerate(said)))
    if problems:
        raise PolicyMismatchError(
            f"kernel policy check across {len(gathered)} ranks failed on rank {dist.get_rank(group)}: "
            + "; ".join(problems)
        )
    return policy


def broadcast_policy(src: int = 0, *, group: Any = None) -> kernel_policy:
    """Rank ``src``'s policy on every rank of ``group``, as a scope: ``with broadcast_policy(): ...``.

    A collective (one ``torch.distributed.broadcast_object_list``), done when
    it is called, not when the scope is entered; ``src`` is a global rank, as
    in torch.distributed. The scope applies exactly that policy (every layer),
    whatever each rank's own scopes and ``KERNELPOLICY`` said.
    """
    dist = _dist("broadcast_policy")
    box: list[Any] = [str(current_policy())]
    dist.broadcast_object_list(box, src=src, group=group)
    return kernel_policy(Policy.parse(box[0], source=f"rank {src}'s policy"))


def run_on_local_shards(*layer_names: str, enabled: bool = True) -> None:
    """Declare that the kernels of ``layer_names`` compute every shard on its own (process-wide).

    A kernel built as a custom op has no DTensor sharding strategy, so with
    DTensor arguments or parameters (tensor or sequence parallelism) it cannot
    run: ``prefer`` takes the original forward, ``require`` raises
    :class:`~kernelpolicy.KernelUnavailableError`. Declared here, such a call
    runs the kernel instead on each rank's local shards, as
    ``torch.distributed.tensor.experimental.local_map`` would: every DTensor
    argument and parameter is passed as its ``to_local()`` tensor, and every
    tensor output becomes a DTensor with the mesh and placements of the first
    DTensor argument. Declare only kernels whose result on a shard is the
    shard of the result: a norm or activation over the last dimension under
    ``SequenceParallel`` (activations ``Shard(1)``, weights ``Replicate()``),
    not one that reduces over the sharded dimension. The declaration is kept
    on kernelpolicy's side, by kernel layer name, because ``kernels`` rejects
    extra attributes on kernel classes. ``enabled=False`` withdraws it.

    >>> import kernelpolicy.distributed
    >>> kernelpolicy.distributed.run_on_local_shards("RMSNorm")
    >>> sorted(kernelpolicy.distributed.local_shard_layers())
    ['RMSNorm']
    >>> kernelpolicy.distributed.run_on_local_shards("RMSNorm", enabled=False)
    """
    from ._forward._sharding import LOCAL_SHARDS

    for name in [check_layer_name(name) for name in layer_names]:
        if enabled:
            LOCAL_SHARDS[name] = call_on_local_shards
        else:
            LOCAL_SHARDS.pop(name, None)


def local_shard_layers() -> frozenset[str]:
    """The layer names declared with :func:`run_on_local_shards`."""
    from ._forward._sharding import LOCAL_SHARDS

    return frozenset(LOCAL_SHARDS)


def call_on_local_shards(
    kernel: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``kernel(module, *args, **kwargs)`` on local shards (see :func:`run_on_local_shards`); the module is not changed.

    Written out rather than through ``local_map``, whose output placements must
    be given before the call, and which cannot localise parameters read from
    the module.
    """
    from torch.distributed.tensor import DTensor

    from ._values._tensors import map_tensors, tensors_in

    first = next(t for t in tensors_in((args, kwargs)) if isinstance(t, DTensor))
    mesh, placements = first.device_mesh, first.placements

    def local(value: Any) -> Any:
        return map_tensors(value, lambda t: t.to_local() if isinstance(t, DTensor) else t)

    out = kernel(_LocalView(module, DTensor), *local(args), **local(kwargs))
    return map_tensors(out, lambda t: DTensor.from_local(t, mesh, placements, run_check=False))


class _LocalView:
    """The module as its kernel sees it on local shards: DTensor attributes read as their local tensors."""

    __slots__ = ("_dtensor", "_module")

    def __init__(self, module: nn.Module, dtensor: Any) -> None:
        self._module = module
        self._dtensor = dtensor

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        return value.to_local() if isinstance(value, self._dtensor) else value

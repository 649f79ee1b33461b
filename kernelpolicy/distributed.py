"""kernelpolicy for torch.distributed jobs: every rank of a process group under one policy, on the same paths.

This module owns :func:`check_consistent` and :func:`broadcast_policy`; it
imports ``torch.distributed`` when one of them is called. Scopes are per
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

from ._active import current_policy
from ._errors import PolicyMismatchError
from ._policy import Policy
from ._scope import kernel_policy

if TYPE_CHECKING:
    from torch import nn

__all__ = ["broadcast_policy", "check_consistent"]


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
    why, as :func:`~kernelpolicy.explain` says), so a kernel that failed to
    load on one node, or ``require`` failing on one rank only, shows before the
    first step instead of as a hang. On a mismatch every rank raises the same
    :class:`~kernelpolicy.PolicyMismatchError`, listing the ranks and what they
    reported, so all ranks stop together.
    """
    dist = _dist("check_consistent")
    policy = current_policy()
    paths: dict[str, str] | None = None
    if model is not None:
        from ._explain import explain

        paths = {row.name: f"{row.path} ({row.reason})" for row in explain(model)}
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
            per_rank = [found.get(name, "absent") for found in reported]
            if len(set(per_rank)) > 1:
                problems.append(f"layer {name!r}: " + ", ".join(f"rank {r}: {path}" for r, path in enumerate(per_rank)))
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

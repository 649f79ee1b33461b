"""Ranks: every rank of a process group under the same policy, on the same paths.

This module owns :func:`check_ranks`. Scopes are per process, so the ranks of
a job can disagree: one rank under ``require`` raising while the others enter
a collective and wait for it until the process group's timeout, or ranks
silently running different kernels. ``check_ranks`` is a collective that
gathers each rank's policy (and, given a model, the path each kernel layer
would take there, as :func:`~kernelpolicy.explain` reports it) with
``torch.distributed.all_gather_object`` and raises the same
:class:`~kernelpolicy.RankMismatchError` on every rank when they differ, so
that all ranks stop together, with a message that names the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._active import current_policy
from ._errors import RankMismatchError

if TYPE_CHECKING:
    from torch import nn

    from ._policy import Policy

__all__ = ["check_ranks"]


def check_ranks(model: nn.Module | None = None, *, group: Any = None) -> Policy:
    """Check that every rank of ``group`` (default: the world) has this rank's policy and paths; return the policy.

    A collective: every rank of the group must call it, at the same point (for
    example before a training or evaluation loop, inside the loop's scope).
    With ``model``, each rank also reports the path of every kernel layer of
    its model (``kernel``, ``original`` or ``error``, and why), so a kernel that
    failed to load on one node, or ``require`` failing on one rank only, shows
    before the first step instead of as a hang. On a mismatch every rank
    raises :class:`~kernelpolicy.RankMismatchError` listing the ranks and what
    they reported.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "check_ranks needs an initialised torch.distributed process group (torch.distributed.init_process_group)"
        )
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
    if paths is not None:
        if any(found is None for found in reported):
            problems.append(
                "some ranks passed no model: " + ", ".join(str(r) for r, f in enumerate(reported) if f is None)
            )
        else:
            for name in sorted(set().union(*reported)):
                per_rank = [found.get(name, "absent") for found in reported]
                if len(set(per_rank)) > 1:
                    problems.append(
                        f"layer {name!r}: " + ", ".join(f"rank {r}: {path}" for r, path in enumerate(per_rank))
                    )
    if problems:
        raise RankMismatchError(
            f"kernel policy check across {len(gathered)} ranks failed on rank {dist.get_rank(group)}: "
            + "; ".join(problems)
        )
    return policy

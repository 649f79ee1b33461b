"""Warm-up for compiled serving: compile a model's programs for a set of policies, up front.

This module owns :func:`warmup`. TorchDynamo compiles a frame the first time
it meets a new guard failure, and cold compiles of one frame from several
threads race (see the README's compile section). A server that accepts a
known set of policies calls :func:`warmup` once, in one thread, before it
serves: every later call under one of those policies finds its graph.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ._policy import Policy
from ._scope import kernel_policy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["WarmupReport", "warmup"]

_LIMIT_ERRORS = ("FailOnRecompileLimitHit", "RecompileLimitExceeded")


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """Graphs compiled by each policy's warm-up call, in call order (0: it reused a graph)."""

    compiles: tuple[tuple[Policy, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.compiles)

    def __str__(self) -> str:
        lines = [f"warm-up: {self.total} graphs for {len(self.compiles)} policies"]
        lines += [f"  {policy}: {n} compiled" for policy, n in self.compiles]
        return "\n".join(lines)


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters  # see _compat.DYNAMO_COUNTERS

    return int(counters["stats"]["unique_graphs"])


def warmup(
    compiled: Callable[..., Any], /, *args: Any, policies: Iterable[Policy | str], **kwargs: Any
) -> WarmupReport:
    """Call ``compiled(*args, **kwargs)`` once under each policy, in this thread; report what compiled.

    Policies are :class:`Policy` values or their text (``"prefer,RMSNorm=disable"``).
    If compiling for one of them hits TorchDynamo's recompile limit, the error
    names the policy, those warmed up before it and the remedies.

    >>> import torch, kernelpolicy
    >>> def double(x):
    ...     return 2 * x
    >>> report = kernelpolicy.warmup(torch.compile(double, backend="eager"), torch.ones(2), policies=["prefer", "disable"])
    >>> [n for _, n in report.compiles]  # no kernel layer: one program for both
    [1, 0]
    """
    import torch

    checked = [p if isinstance(p, Policy) else Policy.parse(p, source="warmup policy") for p in policies]
    done: list[tuple[Policy, int]] = []
    for policy in checked:
        before = _unique_graphs()
        try:
            with kernel_policy(policy):
                compiled(*args, **kwargs)
        except Exception as exc:
            if type(exc).__name__ not in _LIMIT_ERRORS:
                raise
            limit = torch._dynamo.config.recompile_limit
            raise RuntimeError(
                f"kernelpolicy.warmup: compiling for policy {str(policy)!r} hit TorchDynamo's recompile limit "
                f"(torch._dynamo.config.recompile_limit = {limit}) after the policies "
                f"{[str(p) for p, _ in done]} compiled {sum(n for _, n in done)} graphs. Serve fewer policies "
                "that change a compiled layer's path, or raise torch._dynamo.config.recompile_limit."
            ) from exc
        done.append((policy, _unique_graphs() - before))
    return WarmupReport(compiles=tuple(done))


# The public name (kernelpolicy.types), set after the class is built: a dataclass resolves its annotations
# in the module its __module__ names, which is imported only on demand.
WarmupReport.__module__ = "kernelpolicy.types"

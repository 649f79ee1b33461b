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

from .._compat._attributes import FAIL_ON_RECOMPILE_LIMIT, RECOMPILE_LIMIT
from .._context._scope import kernel_policy
from .._values._policy import Policy

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
    TorchDynamo's recompile limit (``torch._dynamo.config.recompile_limit``, programs per compiled frame) is
    never passed silently: past it a frame compiled without ``fullgraph`` would run uncompiled under the
    policies left, so the warm-up calls make it raise. The error names the policy that hit it, those warmed
    up before it, and the limit these policies need: the rest are compiled under a raised limit to count
    their programs. Warm-up does not raise the limit itself: it is the process's setting, which serving
    (new shapes, other frames) relies on too; set it to the number named, then warm up again.

    >>> import torch, kernelpolicy
    >>> def double(x):
    ...     return 2 * x
    >>> report = kernelpolicy.warmup(torch.compile(double, backend="eager"), torch.ones(2), policies=["prefer", "disable"])
    >>> [n for _, n in report.compiles]  # no kernel layer: one program for both
    [1, 0]
    """
    import torch

    checked = [p if isinstance(p, Policy) else Policy.parse(p, source="warmup policy") for p in policies]
    config = torch._dynamo.config
    limit_name, fail_name = (
        next(n for n in names if hasattr(config, n)) for names in (RECOMPILE_LIMIT, FAIL_ON_RECOMPILE_LIMIT)
    )
    done: list[tuple[Policy, int]] = []
    with config.patch(fail_name, True):
        for index, policy in enumerate(checked):
            before = _unique_graphs()
            try:
                with kernel_policy(policy):
                    compiled(*args, **kwargs)
            except Exception as exc:
                if type(exc).__name__ not in _LIMIT_ERRORS:
                    raise
                raise _past_the_limit(compiled, args, kwargs, checked, index, done, limit_name) from exc
            done.append((policy, _unique_graphs() - before))
    return WarmupReport(compiles=tuple(done))


def _past_the_limit(
    compiled: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    checked: list[Policy],
    index: int,
    done: list[tuple[Policy, int]],
    limit_name: str,
) -> RuntimeError:
    """The error for ``checked[index]`` hitting the recompile limit, with the limit all of ``checked`` need.

    The policies from ``index`` on are compiled under the accumulated limit (TorchDynamo's cap over all of a
    frame's recompiles) to count their graphs: the frame held ``limit`` programs, so ``limit`` plus that count
    is enough (more than enough where one program is several graphs, split by graph breaks).
    """
    import torch

    config = torch._dynamo.config
    limit = getattr(config, limit_name)
    before = _unique_graphs()
    try:
        with config.patch(limit_name, max(limit, config.accumulated_recompile_limit)):
            for policy in checked[index:]:
                with kernel_policy(policy):
                    compiled(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the count is unknown; the error below says so
        needed = f"compiling the rest under a raised limit failed too ({type(exc).__name__}: {exc})"
    else:
        total = limit + _unique_graphs() - before
        needed = (
            f"these {len(checked)} policies need {total} programs of one compiled frame: set "
            f"torch._dynamo.config.{limit_name} = {total} (or more) before warmup"
        )
    return RuntimeError(
        f"kernelpolicy.warmup: compiling for policy {str(checked[index])!r} hit TorchDynamo's recompile limit "
        f"(torch._dynamo.config.{limit_name} = {limit}) after the policies {[str(p) for p, _ in done]} compiled "
        f"{sum(n for _, n in done)} graphs; past it the frame would run uncompiled under the policies left. "
        f"{needed[0].upper()}{needed[1:]}, or serve fewer policies that change a compiled layer's path."
    )


# The public name (kernelpolicy.types), set after the class is built: a dataclass resolves its annotations
# in the module its __module__ names, which is imported only on demand.
WarmupReport.__module__ = "kernelpolicy.types"

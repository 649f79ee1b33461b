"""A kernel's failures: what happens when a bound kernel raises, and the lines it logs once per layer.

This module owns ``fallback_on``'s side of a call (:func:`failed`: the kernel raised an error the policy
names, so the original runs, the failure counted), ``max_failures``' stop and :func:`reset_failures`, a
variant's failure (:func:`variant_failed`), DTensor's "no sharding strategy" (:func:`unsupported`), and the
log lines of a kernel layer said once (:func:`log_once`, :func:`log_fallback`). :class:`~._binding.Binding`
takes :func:`failed`, :func:`unsupported` and :func:`reset_failures` as its methods (the generated forwards
call the first two when the kernel raises); they read a binding as :class:`Failing`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .._compat._attributes import DYNAMO_CONSTANT_MARK
from .._compat._versions import _release
from .._context._active import in_effect
from .._context._state import traced_state
from .._values._exceptions import exception_types
from ._dispatch import FAILED, INELIGIBLE, NO_KERNEL, USABLE, Path, untraceable
from ._sharding import LOCAL_SHARDS, NO_SHARDING, ON_LOCAL_SHARDS, _no_sharding_strategy

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from .._values._errors import KernelUnavailableError

__all__ = [
    "ON_STOPPED",
    "Failing",
    "failed",
    "first_time",
    "log_fallback",
    "log_once",
    "reset_failures",
    "traced_fallback",
    "unsupported",
    "variant_failed",
]

logger = logging.getLogger("kernelpolicy")

#: Called with a binding whose kernel ``max_failures`` just stopped (a trip); the serve metrics count them.
ON_STOPPED: list[Callable[[Failing], None]] = []

#: (kernel layer name, what) said once already (see :func:`log_once`).
_logged: set[tuple[str, str]] = set()


class Failing(Protocol):
    """What this module reads and counts of a binding (``_binding.Binding``, a layer above, satisfies it)."""

    module: nn.Module
    module_name: str | None
    layer_name: str
    module_class: str
    kernel: Callable[..., Any] | None
    original: Callable[..., Any]
    failures: int
    last_failure: str | None
    stopped: str | None
    dtensor_failure: str | None

    def install(self, previous: Any = None) -> None: ...
    def error(self, reason: str) -> KernelUnavailableError: ...
    def _run(
        self,
        recorders: tuple[Any, ...],
        path: Path,
        reason: str,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any: ...
    def _record(
        self, recorders: tuple[Any, ...], path: Path, reason: str, error: BaseException | None = None
    ) -> None: ...


def failed(
    binding: Failing, error: Exception, args: tuple[Any, ...], kwargs: dict[str, Any], recorders: tuple[Any, ...] = ()
) -> Any:
    """The kernel raised ``error`` under ``prefer``: the original forward if the policy's ``fallback_on`` names it.

    Counts the failure; at the policy's ``max_failures`` the module stops trying its kernel (its forward
    is rebuilt to ask ``Binding.refused`` first) until :func:`kernelpolicy.reset_failures`. An error the
    policy does not name propagates, recorded as the kernel's.
    """
    policy = in_effect().policy
    if not isinstance(error, exception_types(policy.fallback_on)):
        binding._record(recorders, "kernel", USABLE, error)
        raise error
    binding.failures += 1
    binding.last_failure = f"{type(error).__name__}: {error}"
    limit = policy.max_failures
    if limit is not None and binding.failures >= limit and binding.stopped is None:
        binding.stopped = (
            f"kernel stopped after {binding.failures} failures (last: {binding.last_failure}); "
            "kernelpolicy.reset_failures(model) tries it again"
        )
        binding.install()
        log_once(binding, "stopped", logging.WARNING, f"is off: {binding.stopped}")
        for stopped in ON_STOPPED:
            stopped(binding)
    else:
        log_once(binding, "failed", logging.WARNING, f"raised {binding.last_failure}; the original forward ran instead")
    return binding._run(recorders, "original", f"{FAILED} ({binding.last_failure})", binding.original, args, kwargs)


def reset_failures(binding: Failing) -> None:
    """Forget the kernel's failures; a stopped kernel is tried again."""
    stopped = binding.stopped is not None
    binding.failures, binding.last_failure, binding.stopped = 0, None, None
    if stopped:
        binding.install()


def variant_failed(binding: Failing, name: str | None, error: Exception, names: tuple[str, ...]) -> tuple[str, ...]:
    """Variant ``name`` of the candidates ``names`` raised an error ``fallback_on`` names: count it, log it once.

    Returns the candidates after it, to run next (none: the original forward runs).
    """
    binding.failures += 1
    binding.last_failure = f"variant {name!r}: {type(error).__name__}: {error}"
    rest = names[names.index(name) + 1 :] if name in names else ()
    following = f"the next of {'|'.join(rest)}" if rest else "the original forward"
    log_once(
        binding, f"variant {name} failed", logging.WARNING, f"raised {binding.last_failure}; {following} ran instead"
    )
    return rest


def unsupported(
    binding: Failing,
    error: NotImplementedError,
    mode: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    recorders: tuple[Any, ...] = (),
    reason: str = USABLE,
) -> Any:
    """The kernel raised ``error`` before running: the original under ``prefer``, an error under ``require``.

    Only for what is known to fail before the kernel computes anything: a
    custom-op kernel given DTensor inputs or parameters for which its op has
    no sharding strategy (tensor or sequence parallelism). A kernel layer
    declared with :func:`kernelpolicy.distributed.run_on_local_shards` runs
    on the local shards instead, under every mode that asked for the kernel
    (``verify`` does not compare those calls: logged once). Anything else is
    the kernel's own error and propagates unchanged (or, under ``prefer``, is
    :func:`failed`'s). ``mode`` is a plain mode (the fast exits and
    ``Binding.slow_path`` strip recording); ``recorders`` count the path taken
    (``reason``: why the kernel was called, for a call whose error propagates).
    """
    if not _no_sharding_strategy(error, (args, kwargs, binding.module)):
        if mode == "prefer" and in_effect().policy.fallback_on:
            return failed(binding, error, args, kwargs, recorders)
        binding._record(recorders, "kernel", reason, error)
        raise error
    binding.dtensor_failure = str(error)
    on_local_shards = LOCAL_SHARDS.get(binding.layer_name)
    if on_local_shards is not None:
        assert binding.kernel is not None
        binding._record(recorders, "kernel", ON_LOCAL_SHARDS)
        if mode == "verify":
            log_once(binding, "not verified", logging.WARNING, "verify does not compare kernels run on local shards")
        return on_local_shards(binding.kernel, binding.module, args, kwargs)
    reason = f"{NO_SHARDING}: {error}"
    if mode == "require":
        refusal = binding.error(reason)
        binding._record(recorders, "error", NO_SHARDING, refusal)
        raise refusal from error
    log_fallback(binding, reason)
    return binding._run(recorders, "original", NO_SHARDING, binding.original, args, kwargs)


def log_fallback(binding: Failing, reason: str) -> bool:
    """Log once per reason that the original ran instead of the bound kernel (returns True).

    A warning where the bound kernel cannot run in a whole situation (a tracer, autograd, DTensor, a
    stopped kernel); INFO where a ``kernel_accepts`` rule declined one call, as it was declared to.

    Where TorchDynamo traces (``torch.compile``, strict ``torch.export``) a program runs no Python, so it
    cannot log: TorchDynamo calls this function itself while it traces the forward (it has
    ``assume_constant_result``'s mark, below) and folds its True into the program, without a guard and
    without a graph break. So the line is logged when the program is traced, once per layer and reason.
    """
    level = logging.INFO if reason.startswith(INELIGIBLE) or reason == NO_KERNEL else logging.WARNING
    log_once(binding, reason, level, f"falls back to its original forward: {reason}")
    return True


def traced_fallback(binding: Failing) -> Callable[[], bool]:
    """What the traced branch of the binding's forward calls where its kernel cannot be traced (a cell).

    :func:`log_fallback` of why, called by TorchDynamo while it traces (the same mark): that layer's one
    program serves every mode but ``require``, so it is logged whichever policy the program is traced under.
    """

    def logged() -> bool:
        return log_fallback(binding, untraceable(traced_state()))

    setattr(logged, DYNAMO_CONSTANT_MARK, True)
    return logged


def first_time(layer_name: str, key: str, level: int) -> bool:
    """Whether ``key`` of kernel layer ``layer_name``, a line at ``level``, is said now for the first time.

    From now on it is said; but a line the ``kernelpolicy`` logger does not emit at its level now (INFO
    under a default logging set-up) is not said: it is said the first time it would be shown, after
    ``logging.getLogger("kernelpolicy").setLevel(logging.INFO)``, say.
    """
    if (layer_name, key) in _logged or not logger.isEnabledFor(level):
        return False
    _logged.add((layer_name, key))
    return True


def log_once(binding: Failing, key: str, level: int, what: str) -> None:
    """Log ``what`` of the binding's kernel layer, once per layer and ``key`` (see :func:`first_time`)."""
    if first_time(binding.layer_name, key, level):
        logger.log(
            level, "kernel layer %r (%s at %r) %s", binding.layer_name, binding.module_class, binding.module_name, what
        )


# ``torch._dynamo.assume_constant_result``'s mark, set directly (importing TorchDynamo takes over a second).
setattr(log_fallback, DYNAMO_CONSTANT_MARK, True)
#: Whether traced code may call :func:`log_fallback` with a binding: TorchDynamo before torch 2.13 folds a marked
#: function only when its arguments are constants (a binding is not); there the line comes where code runs eagerly.
LOGS_WHILE_TRACING: bool = _release(str(torch.__version__)) >= (2, 13)

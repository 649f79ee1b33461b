"""Other processes: what carries the caller's policy into a worker or child process.

>>> import kernelpolicy.processes
>>> sorted(kernelpolicy.processes.__all__)
['child_env', 'worker_init_fn']


This module owns :func:`worker_init_fn` (DataLoader workers and process-pool
initializers) and :func:`child_env` (the environment of a launched child);
:func:`~kernelpolicy.propagate` (in ``_scope``) carries it into one call.

A policy lives in a ``ContextVar`` of one process. A forked child copies the
forking thread's context, so it keeps the scope active at the fork for its
whole life unless its initializer (:func:`worker_init_fn`) ends it; a spawned
or forkserver child starts from ``KERNELPOLICY`` in its environment. Both
helpers send a plain :class:`~kernelpolicy.Policy`, which pickles as its
content, variant entries included; ``record_calls`` recorders stay in the
calling process (calls made elsewhere are not counted here).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, final

from ._context._active import current_policy
from ._values._policy import ENV_VAR

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._values._policy import Policy

__all__ = ["child_env", "worker_init_fn"]


def worker_init_fn(fn: Callable[..., Any] | None = None) -> Callable[..., None]:
    """A picklable initializer that makes the caller's policy the default of each worker process.

    For ``torch.utils.data.DataLoader(worker_init_fn=...)``, whose workers are
    processes (spawned ones otherwise see only ``KERNELPOLICY``), and for
    ``ProcessPoolExecutor(initializer=...)`` or ``multiprocessing.Pool``. In
    the worker it makes the policy in effect where ``worker_init_fn`` was
    called the process default (every layer, as ``kernel_policy(policy)``
    would) and ends the scopes a forked worker copied from the thread that
    forked it (a loader iterated, or a pool first used, inside
    ``kernels_disabled()`` still gives its workers this policy), then calls
    ``fn(*args)`` (DataLoader passes the worker id). A DataLoader calls it
    once per worker, a pool once per worker it starts (replacements
    included), so the policy holds for each worker's life: with
    ``persistent_workers=True``, build a new loader to change it. A task's
    own scope (``propagate(task)``) still wins while it runs. Variants the
    policy names are not checked in the worker, which binds its own later,
    in its task (as with ``KERNELPOLICY``).

    >>> import pickle, kernelpolicy, kernelpolicy.processes
    >>> with kernelpolicy.kernel_policy("disable", RMSNorm="require"):
    ...     init = kernelpolicy.processes.worker_init_fn()
    >>> init
    kernelpolicy.processes.worker_init_fn(policy='disable,RMSNorm=require', fn=None)
    >>> pickle.loads(pickle.dumps(init)) == init
    True
    """
    return _WorkerInit(current_policy(), fn)


@final
class _WorkerInit:
    """What :func:`worker_init_fn` returns: a policy and the user's initializer, pickled by value."""

    __slots__ = ("fn", "policy")

    def __init__(self, policy: Policy, fn: Callable[..., Any] | None) -> None:
        self.policy = policy
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        from ._context._propagate import leave_scopes
        from ._context._scope import set_unchecked_default

        set_unchecked_default(self.policy)  # its variants are bound later, by the worker's task
        leave_scopes()  # a forked worker's copy of the forking thread's scopes would hide that default
        if self.fn is not None:
            self.fn(*args)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _WorkerInit) and (other.policy, other.fn) == (self.policy, self.fn)

    def __hash__(self) -> int:
        return hash((self.policy, self.fn))

    def __repr__(self) -> str:
        fn = "None" if self.fn is None else getattr(self.fn, "__qualname__", repr(self.fn))
        return f"kernelpolicy.processes.worker_init_fn(policy={str(self.policy)!r}, fn={fn})"

    def __reduce__(self) -> tuple[object, ...]:
        return (_WorkerInit, (self.policy, self.fn))


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: ``os.environ``) with ``KERNELPOLICY`` set to the policy in effect here.

    For a child process started with an environment (``subprocess``,
    ``torchrun``, a spawn start method reads ``os.environ``): the child's
    default is then this policy, for every layer, whatever ``KERNELPOLICY``
    said before. ``str(policy)`` parses back to the same policy.

    >>> import kernelpolicy, kernelpolicy.processes
    >>> with kernelpolicy.kernel_policy("prefer", RMSNorm="disable"):
    ...     kernelpolicy.processes.child_env({"PATH": "/usr/bin"})
    {'PATH': '/usr/bin', 'KERNELPOLICY': 'prefer,RMSNorm=disable'}
    """
    base = dict(os.environ if env is None else env)
    base[ENV_VAR] = str(current_policy())
    return base

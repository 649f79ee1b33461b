"""Per-request policies in transformers' continuous batching (``generate_batch``, ``init_continuous_batching``).

transformers' continuous batching runs the forward steps of many requests in a thread of its own, where no
caller's scope is set: without this module a request submitted under ``kernels_disabled()`` runs whatever the
manager's thread defaults to. This module owns the seam (:func:`policy_aware`), which every manager gets
once kernelpolicy has attached a transformers model (``attach``, ``kernelize``, ``auto_attach``), or by hand:

- **each request carries the policy in effect where it was submitted** (``add_request``, ``add_requests``,
  ``generate_batch`` inside a scope), and the ``record_calls`` recorders active there;
- **each forward step runs under exactly one policy**: the manager's own scheduler (``fifo``,
  ``prefill_first``, any of ``SCHEDULER_MAPPING``) schedules one policy's requests per step, the policies
  taking turns (round robin over the policies with work), so no policy starves; prefill and decode alike;
- **recorders count per request**: a step's calls are counted by the recorders of the requests it serves;
- **a policy's error fails only its requests**: ``require`` (``KernelUnavailableError``) or ``verify``
  (``KernelMismatchError``) raised in a step fails the requests of that step, with the error, and the manager
  goes on serving the others;
- **prefix sharing keeps policies apart**: a KV block computed under one policy is never reused by a
  request of another (the block hashes of all but the first policy a manager sees are salted);
- **warm-up covers each policy served**: ``policy_aware(manager, policies=[...])`` runs the manager's warm-up
  (compile, CUDA graphs) once per policy.

Nothing changes for a manager whose requests all carry one policy: its steps are scheduled, hashed and run
as without kernelpolicy, under that policy.

The seams are transformers' own, private (``_compat.BATCHING``): where one is missing, :func:`policy_aware`
tells the user once and leaves the manager as it is (its steps run under the process default policy).
Async batching (transformers' choice with CUDA graphs) runs a step's bookkeeping one step late: there an
error raised by a policy is left to transformers, which fails every request (a GPU-only path, untested here).
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from typing import TYPE_CHECKING, Any

from . import _compat
from ._active import RECORDERS, current_policy
from ._attach import ATTACH_HOOKS
from ._errors import KernelMismatchError, KernelUnavailableError, PolicyError
from ._scope import _recording_scope, kernel_policy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ._policy import Policy

__all__ = ["policy_aware", "request_policy"]

#: Errors a policy raises in a forward: they fail the requests of that policy's step, not the manager.
POLICY_ERRORS: tuple[type[Exception], ...] = (KernelUnavailableError, KernelMismatchError)

_MARK = "_kernelpolicy_requests"
#: Whether the KV block hashes of a manager's second and later policies are salted (tests switch it off).
_SALT = True
_CHILD = "__child#"  # transformers' ids of a request's forked children: "<parent>__child#<i>"


class _Requests:
    """The policy and recorders each request of one manager was submitted with, by request id."""

    def __init__(self, policies: tuple[Policy, ...], vocabulary: int) -> None:
        self.lock = threading.Lock()
        self.vocabulary = vocabulary
        #: transformers hashes a block's token ids as 32-bit integers: n policies need n * vocabulary ids.
        self.most_policies = (2**31 - 1) // vocabulary
        self.by_id: dict[str, tuple[Policy, tuple[Any, ...]]] = {}
        self.salts: dict[Policy, int] = {}
        self.policies = policies  # warmed up
        self.turn = itertools.count()
        self.step: tuple[Policy, tuple[Any, ...]] | None = None  # the policy and recorders of the step scheduled
        #: The policy of each step scheduled, the last 10,000 (what an operator or a test reads).
        self.history: collections.deque[Policy] = collections.deque(maxlen=10_000)
        self.failed = False  # the last step raised a policy's error: its update is skipped

    def submitted(self, request_id: str) -> None:
        policy, recorders = current_policy(), RECORDERS.get()
        with self.lock:
            if policy not in self.salts and len(self.salts) >= self.most_policies:
                raise PolicyError(
                    f"a continuous batching manager keeps at most {self.most_policies} policies apart (a vocabulary "
                    f"of {self.vocabulary}); request {request_id!r} brings one more, {str(policy)!r}: serve fewer "
                    "distinct policies (an allowlist), or another manager"
                )
            self.by_id[request_id] = (policy, recorders)
            self.salts.setdefault(policy, len(self.salts))

    def of(self, request_id: str) -> tuple[Policy, tuple[Any, ...]]:
        found = self.by_id.get(request_id.partition(_CHILD)[0])
        return found if found is not None else (current_policy(), ())

    def salted(self, request_id: str, token_ids: list[int]) -> list[int]:
        """The ids the blocks of ``request_id`` are hashed by: its own for the first policy, else mapped one to one
        into the negative ids of the n-th policy (never a token's, never another policy's)."""
        index = self.salts.get(self.of(request_id)[0], 0)
        if not index or not _SALT:
            return token_ids
        offset = index * self.vocabulary
        return [-(offset + token) for token in token_ids]

    def forget(self, request_id: str) -> None:
        if _CHILD not in request_id:
            with self.lock:
                self.by_id.pop(request_id, None)


def request_policy(manager: Any, request_id: str) -> Policy | None:
    """The policy request ``request_id`` of ``manager`` was submitted under, while it is in flight (else None)."""
    requests: _Requests | None = getattr(manager, _MARK, None)
    if requests is None:
        return None
    found = requests.by_id.get(request_id.partition(_CHILD)[0])
    return found[0] if found is not None else None


def policy_aware(manager: Any, *, policies: Iterable[Policy | str] = ()) -> Any:
    """Make a transformers ``ContinuousBatchingManager`` carry each request's policy; return it.

    Done for every manager once kernelpolicy attached a transformers model; by hand for ``policies``, the
    policies whose programs the manager's warm-up compiles ahead (each one once, besides the policy in
    effect where ``warmup()`` is called). Idempotent. Call it before the manager starts.

    Example (``model`` attached, ``ids`` two prompts)::

        with kernelpolicy.kernels_disabled():
            disabled = model.generate_batch(ids)  # every step of these requests: the original forwards
    """
    from ._policy import Policy

    wanted = tuple(Policy.parse(p) if isinstance(p, str) else p for p in policies)
    existing: _Requests | None = getattr(manager, _MARK, None)
    if existing is not None:
        existing.policies = tuple(dict.fromkeys((*existing.policies, *wanted)))
        return manager
    if not _compat.all_present(_compat.BATCHING) or not hasattr(manager, "input_queue"):
        return manager  # told once by _compat: the manager stays as transformers made it
    requests = _Requests(wanted, int(manager.model.config.get_text_config().vocab_size))
    setattr(manager, _MARK, requests)
    queue = manager.input_queue
    put = queue.put

    def put_submitted(state: Any, *args: Any, **kwargs: Any) -> None:
        requests.submitted(state.request_id)  # in the submitting thread: its policy
        put(state, *args, **kwargs)

    queue.put = put_submitted
    create = manager._create_batch_processor

    def create_batch_processor() -> Any:
        processor = create()
        _wrap_processor(processor, requests)
        return processor

    manager._create_batch_processor = create_batch_processor
    return manager


def _wrap_processor(processor: Any, requests: _Requests) -> None:
    if getattr(processor, _MARK, None) is requests:
        return  # the same processor, reset for a new run
    setattr(processor, _MARK, requests)
    _group_by_policy(processor.scheduler, requests)
    _salt_prefix_hashes(processor.cache, requests)
    step, update, warmup = processor._generation_step, processor.update_batch, processor.warmup
    use_async = bool(getattr(processor, "use_async_batching", False))

    def generation_step(model: Any) -> None:
        policy, recorders = requests.step or (current_policy(), ())
        requests.failed = False
        with _recording_scope(policy, recording=True if recorders else None, recorders=recorders):
            try:
                step(model)
            except POLICY_ERRORS as error:
                if use_async:
                    raise  # async batching updates a step late: transformers fails every request
                requests.failed = True
                processor.handle_batch_error(error)  # fails this step's requests, frees their blocks

    def update_batch() -> None:
        if requests.failed:
            requests.failed = False  # the failed step's requests are done: nothing to update
            return
        update()

    def warm_up(model: Any) -> None:
        warmup(model)
        for policy in requests.policies:
            with kernel_policy(policy):
                warmup(model)

    processor._generation_step = generation_step
    processor.update_batch = update_batch
    processor.warmup = warm_up


def _group_by_policy(scheduler: Any, requests: _Requests) -> None:
    """Each ``schedule_batch`` schedules the requests of one policy (the policies with work taking turns)."""
    schedule, finish, clear = scheduler.schedule_batch, scheduler.finish_request, scheduler.clear_cancelled_requests

    def schedule_batch(token_budget: int, cache_budget: int) -> Any:
        groups: dict[Policy, None] = {}
        for request_id in itertools.chain(scheduler.active_requests, scheduler.waiting_requests_order):
            groups.setdefault(requests.of(request_id)[0], None)
        if len(groups) <= 1:
            result = schedule(token_budget, cache_budget)
            chosen = next(iter(groups), current_policy())
        else:
            ordered = list(groups)
            chosen = ordered[next(requests.turn) % len(ordered)]
            result = _scheduled_among(scheduler, schedule, requests, chosen, token_budget, cache_budget)
        scheduled = result[0] or []
        recorders = tuple(dict.fromkeys(r for future in scheduled for r in requests.of(future.state.request_id)[1]))
        requests.step = (chosen, recorders)
        if scheduled:
            requests.history.append(chosen)
        return result

    def finish_request(request_id: str) -> None:
        finish(request_id)
        requests.forget(request_id)

    def clear_cancelled_requests() -> Any:
        cancelled = clear()
        for state in cancelled:
            requests.forget(state.request_id)
        return cancelled

    scheduler.schedule_batch = schedule_batch
    scheduler.finish_request = finish_request
    scheduler.clear_cancelled_requests = clear_cancelled_requests


def _scheduled_among(
    scheduler: Any,
    schedule: Callable[[int, int], Any],
    requests: _Requests,
    chosen: Policy,
    token_budget: int,
    cache_budget: int,
) -> Any:
    """The scheduler's own ``schedule_batch`` with the requests of other policies set aside, then put back."""
    order = list(scheduler.waiting_requests_order)
    hidden_active = {i: s for i, s in scheduler.active_requests.items() if requests.of(i)[0] != chosen}
    hidden_waiting = {i: s for i, s in scheduler.waiting_requests.items() if requests.of(i)[0] != chosen}
    for request_id in hidden_active:
        del scheduler.active_requests[request_id]
    for request_id in hidden_waiting:
        del scheduler.waiting_requests[request_id]
    scheduler.waiting_requests_order = type(scheduler.waiting_requests_order)(
        i for i in order if i not in hidden_waiting
    )
    try:
        return schedule(token_budget, cache_budget)
    finally:
        scheduler.active_requests.update(hidden_active)
        scheduler.waiting_requests.update(hidden_waiting)
        kept = set(scheduler.waiting_requests_order)
        scheduler.waiting_requests_order = type(scheduler.waiting_requests_order)(
            i for i in order if i in hidden_waiting or i in kept
        )


def _salt_prefix_hashes(cache: Any, requests: _Requests) -> None:
    """Salt the token ids a request's KV blocks are hashed by with its policy (the first policy: unchanged)."""
    search = cache.search_prefix_match

    def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
        return int(search(request_id, requests.salted(request_id, prompt_ids)))

    cache.search_prefix_match = search_prefix_match
    for allocator in cache.cache_allocators.values():
        mark = allocator.mark_complete_blocks

        def mark_complete_blocks(
            request_id: str, token_ids: list[int], new_blocks: int, mark: Callable[..., None] = mark
        ) -> None:
            mark(request_id, requests.salted(request_id, token_ids), new_blocks)

        allocator.mark_complete_blocks = mark_complete_blocks


def _install_on_attach(model: Any, options: Any) -> None:
    """Attach hook: managers made from now on are policy-aware (once transformers' batching is imported)."""
    if hasattr(model, "init_continuous_batching"):
        install()


_INSTALLED = False


def install() -> None:
    """Make every transformers ``ContinuousBatchingManager`` created from now on policy-aware (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    manager_class = _compat.resolve(_compat.BATCHING_MANAGER)
    if manager_class is None:
        return
    init = manager_class.__init__
    if getattr(init, _MARK, False):
        _INSTALLED = True
        return

    @functools.wraps(init)
    def initialized(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        policy_aware(self)

    setattr(initialized, _MARK, True)
    manager_class.__init__ = initialized
    _INSTALLED = True


ATTACH_HOOKS.append(_install_on_attach)

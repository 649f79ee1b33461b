"""Which requests a step of continuous batching schedules, when their policies may differ.

This module owns :func:`schedule_every_policy`: the manager's own scheduler sees every request, except where the
policies with work cannot share a step (a layer whose rows are not declared, or one found unsplittable, differs
between them): there each step schedules one class of policies that can, the classes taking turns, and
transformers' offloading still sees every request. It also keeps each request's entry in step with transformers'
finishing, requeueing and cancelling.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from .._forward._mixing import kept_apart, mixable

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._values._policy import Policy
    from ._requests import Requests

__all__ = ["schedule_every_policy"]


def schedule_every_policy(scheduler: Any, requests: Requests) -> None:
    """``schedule_batch`` sees every request, except where the policies with work cannot share a step (a layer
    whose rows are not declared differs between them): there each step schedules one class of policies that
    can, the classes taking turns."""
    schedule, finish, clear = scheduler.schedule_batch, scheduler.finish_request, scheduler.clear_cancelled_requests
    add = scheduler.add_waiting_request

    def schedule_batch(token_budget: int, cache_budget: int) -> Any:
        with_work: dict[Policy, None] = {}
        for request_id in itertools.chain(scheduler.active_requests, scheduler.waiting_requests_order):
            with_work.setdefault(requests.of(request_id)[0], None)
        classes = _classes(tuple(with_work), requests.layers, requests.grouped)
        if len(classes) <= 1:
            return schedule(token_budget, cache_budget)
        first = next(requests.turn) % len(classes)
        result = None
        for chosen in classes[first:] + classes[:first]:
            result = _scheduled_among(scheduler, schedule, requests, chosen, token_budget, cache_budget)
            if result[0] is not None:
                return result  # else the next class: transformers offloads only once none can be scheduled
        return result

    def finish_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        finish(request_id, *args, **kwargs)
        requests.forget(request_id)

    def add_waiting_request(state: Any, *args: Any, **kwargs: Any) -> None:
        requests.queued_again(state.request_id)
        add(state, *args, **kwargs)

    def clear_cancelled_requests(*args: Any, **kwargs: Any) -> Any:
        requests.finished.clear()  # a new turn of transformers' loop
        cancelled = clear(*args, **kwargs)
        for state in cancelled:
            requests.forget(state.request_id)
        return cancelled

    scheduler.schedule_batch = schedule_batch
    scheduler.finish_request = finish_request
    scheduler.add_waiting_request = add_waiting_request
    scheduler.clear_cancelled_requests = clear_cancelled_requests


def _classes(policies: tuple[Policy, ...], layers: frozenset[str], grouped: set[str]) -> list[frozenset[Policy]]:
    """``policies`` in classes that may share a step: the same entries and options on every layer kept apart."""
    if len(policies) <= 1 or mixable(policies, layers, grouped):
        return [frozenset(policies)]
    undeclared = sorted(name for name in layers if kept_apart(name, grouped))
    keyed: dict[tuple[Any, ...], list[Policy]] = {}
    for policy in policies:
        keyed.setdefault(tuple((policy.entry_for(n), policy.options) for n in undeclared), []).append(policy)
    return [frozenset(group) for group in keyed.values()]


def _scheduled_among(
    scheduler: Any,
    schedule: Callable[[int, int], Any],
    requests: Requests,
    chosen: frozenset[Policy],
    token_budget: int,
    cache_budget: int,
) -> Any:
    """The scheduler's own ``schedule_batch`` with the requests of other policies set aside, then put back."""
    order = list(scheduler.waiting_requests_order)
    hidden_active = {i: s for i, s in scheduler.active_requests.items() if requests.of(i)[0] not in chosen}
    hidden_waiting = {i: s for i, s in scheduler.waiting_requests.items() if requests.of(i)[0] not in chosen}
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

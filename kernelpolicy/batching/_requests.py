"""What each request of a policy-aware batching manager carries, for its whole life, and where transformers shows it.

This module owns :class:`Requests` (one per manager): each request's policy and ``record_calls`` recorders by
request id, from submission until the request finishes (an offloaded request, finished and queued again at
once, gets them back; a forked child, ``num_return_sequences``, gets its parent's when forked:
:func:`register_forks`), and the salt of each policy's KV block hashes (:func:`salt_prefix_hashes`), so that
prefix sharing never gives a request another policy's blocks.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import TYPE_CHECKING, Any

from .._context._active import RECORDERS, current_policy
from .._values._errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._forward._mixing import Step
    from .._values._policy import Policy

__all__ = ["Requests", "register_forks", "salt_prefix_hashes"]

#: Whether the KV block hashes of a manager's second and later policies are salted (tests switch it off).
_SALT = True


class Requests:
    """The policy and recorders each request of one manager was submitted with, by request id."""

    def __init__(self, policies: tuple[Policy, ...], vocabulary: int) -> None:
        self.lock = threading.Lock()
        #: The kernel layer names of the manager's model (what decides whether policies can share a step).
        self.layers: frozenset[str] = frozenset()
        self.vocabulary = vocabulary
        #: transformers hashes a block's token ids as 32-bit integers: n policies need n * vocabulary ids.
        self.most_policies = (2**31 - 1) // vocabulary
        self.by_id: dict[str, tuple[Policy, tuple[Any, ...]]] = {}
        self.salts: dict[Policy, int] = {}
        self.policies = policies  # warmed up
        #: The rows of the current processor's steps (what tests and operators read).
        self.step: Step | None = None
        self.turn = itertools.count()
        #: The policies each step served, the last 10,000 (what an operator or a test reads).
        self.history: collections.deque[tuple[Policy, ...]] = collections.deque(maxlen=10_000)
        #: Row counts at which a mixed call could not tell the step's rows apart (a per-head norm of as many heads):
        #: mixed steps of these counts run one policy at a time.
        self.unsplittable_counts: set[int] = set()
        #: Layers whose outputs show no rows (a value for the whole call that differs by path): grouped by policy.
        self.grouped: set[str] = set()
        #: What requests transformers finished in this turn of its loop had: an offloaded request is finished, then
        #: queued again at once, and gets it back (cleared at the next turn).
        self.finished: dict[str, tuple[Policy, tuple[Any, ...]]] = {}

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
        found = self.by_id.get(request_id)
        return found if found is not None else (current_policy(), ())

    def forked(self, parent: str, children: list[str]) -> None:
        """transformers forks ``parent`` into ``children`` (``num_return_sequences``): each child keeps the parent's
        policy and recorders until it finishes itself (the parent may finish first, even in this turn)."""
        with self.lock:
            found = self.by_id.get(parent) or self.finished.get(parent)
            if found is not None:
                for child in children:
                    self.by_id[child] = found

    def salted(self, request_id: str, token_ids: list[int]) -> list[int]:
        """The ids the blocks of ``request_id`` are hashed by: its own for the first policy, else mapped one to one
        into the negative ids of the n-th policy (never a token's, never another policy's)."""
        index = self.salts.get(self.of(request_id)[0], 0)
        if not index or not _SALT:
            return token_ids
        offset = index * self.vocabulary
        return [-(offset + token) for token in token_ids]

    def forget(self, request_id: str) -> None:
        with self.lock:
            found = self.by_id.pop(request_id, None)
        if found is not None:
            self.finished[request_id] = found

    def queued_again(self, request_id: str) -> None:
        """transformers queued a request it had just finished (an offload): it keeps its policy and recorders."""
        found = self.finished.pop(request_id, None)
        if found is not None:
            with self.lock:
                self.by_id.setdefault(request_id, found)


def salt_prefix_hashes(cache: Any, requests: Requests) -> None:
    """Salt the token ids a request's KV blocks are hashed by with its policy (the first policy: unchanged)."""
    search = cache.search_prefix_match

    def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
        return int(search(request_id, requests.salted(request_id, prompt_ids)))

    cache.search_prefix_match = search_prefix_match
    for allocator in cache.cache_allocators.values():
        mark = allocator.mark_complete_blocks

        def mark_complete_blocks(
            request_id: str, token_ids: list[int], new_new_blocks: int, mark: Callable[..., None] = mark
        ) -> None:
            mark(request_id, requests.salted(request_id, token_ids), new_new_blocks)

        allocator.mark_complete_blocks = mark_complete_blocks


def register_forks(cache: Any, requests: Requests) -> None:
    """A request's forked children (``num_return_sequences``) get its policy and recorders as they are forked."""
    fork = cache.prepare_fork_request

    def prepare_fork_request(src_state: Any, dst_req_ids: list[str], copy_src_and_dst: Any) -> list[str]:
        requests.forked(src_state.request_id, dst_req_ids)  # forked here or queued anew: each child is one of these
        return list(fork(src_state, dst_req_ids, copy_src_and_dst))

    cache.prepare_fork_request = prepare_fork_request

"""Per-request policies in transformers' continuous batching (``generate_batch``, ``init_continuous_batching``).

transformers' continuous batching runs the forward steps of many requests in a thread of its own, where no
caller's scope is set: without this module a request submitted under ``kernels_disabled()`` runs whatever the
manager's thread defaults to. This module owns the seam (:func:`policy_aware`), which every manager gets
once kernelpolicy has attached a transformers model (``attach``, ``kernelize``, ``auto_attach``), or by hand:

- **each request carries the policy in effect where it was submitted** (``add_request``, ``add_requests``,
  ``generate_batch`` inside a scope), and the ``record_calls`` recorders active there, for its whole life:
  offloaded and queued again, forked (``num_return_sequences``: each child), its KV blocks salted by its policy
  (:mod:`kernelpolicy.batching._requests`);
- **one forward step serves every policy**: the manager's scheduler (any of ``SCHEDULER_MAPPING``) sees every
  request; in each policy-aware layer whose paths differ between the step's policies, each request's rows take
  its policy's path (``_mixing``: the rows' policies come with each batch; compiled, they are an input). A
  layer whose rows are not declared (:func:`declare_rows`) is never mixed: those steps are grouped by policy,
  taking turns, and transformers' offloading still sees every request;
- **recorders count per request**: a call counts for each request's recorders on that request's path;
- **a policy's error fails only its requests**: an error raised by some policies' rows in a mixed step (a
  kernel's exception, ``require``, ``verify``) fails their requests and the step runs again without them; a
  kernel's exception, ``require`` or ``verify`` failing where every row ran the path (a step of one policy, a
  layer the step's policies agree on) fails that step's requests; the manager goes on serving. An error of
  transformers' own (raised outside any kernel) stops the manager, as without kernelpolicy;
- **prefix sharing keeps policies apart**: a KV block computed under one policy is never reused by a
  request of another (the block hashes of all but the first policy a manager sees are salted);
- **warm-up covers each policy served**: ``policy_aware(manager, policies=[...])`` runs the manager's warm-up
  (compile, CUDA graphs) once per policy, and once for their mix when the steps are compiled.

Nothing changes for a manager whose requests all carry one policy. The seams are transformers' own, private
(``_compat.BATCHING``): where one is missing, :func:`policy_aware` tells the user once and leaves the manager
as it is. Async batching (CUDA graphs) updates a step one step late: there a policy's error is left to
transformers, which fails every request (a GPU-only path, untested here).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._attach._attach import ATTACH_HOOKS
from .._attach._aware import aware_modules
from .._compat import _compat
from .._context._active import activate, current_policy
from .._context._scope import kernel_policy
from .._forward._binding import BINDING
from .._forward._mixing import MixedCallError, Step, UnsplittableCall, declare_rows, mixable, mixed_scope
from .._values._errors import KernelMismatchError, KernelUnavailableError
from ._requests import Requests, register_forks, salt_prefix_hashes
from ._schedule import schedule_every_policy

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .._context._active import Active
    from .._values._policy import Policy

__all__ = ["declare_rows", "policy_aware", "request_policy"]

#: Errors a policy raises in a forward: like a kernel's own error (:func:`_raised_in_a_kernel`), raised in a step
#: outside a mixed call they fail that step's requests (every row ran the path that raised), not the manager.
POLICY_ERRORS: tuple[type[Exception], ...] = (KernelUnavailableError, KernelMismatchError)

_MARK = "_kernelpolicy_requests"


class _Batch(NamedTuple):
    """What one prepared batch runs under: its table, the recorders of its requests, its rows' slots."""

    table: Active
    recorders: tuple[Any, ...]
    rows: torch.Tensor  # each row's slot (a view of the batch's own buffer)
    host_rows: list[int]
    slot_recorders: dict[int, tuple[Any, ...]]
    requests: dict[str, int]  # request id -> slot
    #: The batch's requests as transformers prepared them, with what preparing advanced on each (to run it again).
    futures: tuple[Any, ...] = ()
    before: tuple[tuple[int, list[int]], ...] = ()


def request_policy(manager: Any, request_id: str) -> Policy | None:
    """The policy request ``request_id`` of ``manager`` was submitted under, while it is in flight (else None)."""
    requests: Requests | None = getattr(manager, _MARK, None)
    if requests is None:
        return None
    found = requests.by_id.get(request_id)
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
    from .._values._policy import Policy

    wanted = tuple(Policy.parse(p) if isinstance(p, str) else p for p in policies)
    existing: Requests | None = getattr(manager, _MARK, None)
    if existing is not None:
        existing.policies = tuple(dict.fromkeys((*existing.policies, *wanted)))
        return manager
    if not _compat.all_present(_compat.BATCHING) or _compat.missing_attributes({"ContinuousBatchingManager": manager}):
        return manager  # told once by _compat: the manager stays as transformers made it
    requests = Requests(wanted, int(manager.model.config.get_text_config().vocab_size))
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
        requests.layers = _layer_names(manager.model)
        _wrap_processor(processor, requests)
        return processor

    manager._create_batch_processor = create_batch_processor
    return manager


class _Rows:
    """The rows of a processor's batches: each prepared batch's slots, in a buffer of its own IO pair."""

    def __init__(self, processor: Any, requests: Requests) -> None:
        self.requests = requests
        self.step = requests.step = Step(processor.model_device)
        self.static = bool(processor.model_runner.pad_inputs)  # compiled or CUDA graphs: one program for every mix
        self.ios, self.paired = processor.inputs_and_outputs, bool(processor.use_async_batching)
        self.buffers: dict[int, torch.Tensor] = {}
        self.batches: dict[int, _Batch] = {}  # by IO pair: the batch prepared in it, until its step runs
        self.size = int(processor.max_batch_tokens)
        self.layers = requests.layers
        #: The holders of the recorders of the step that ran last, by recorder: the same for the next step's same
        #: recorders, so that its groups of rows, made with them, are kept (``Step.begin``).
        self.holders: dict[int, _Holder] = {}

    def pair(self) -> int:
        return int(self.ios.current_pair) if self.paired else 0  # async batching alternates two IO pairs

    def prepared(self, requests_in_batch: list[Any], rows: int) -> _Batch:
        """The batch of ``requests_in_batch`` (``rows`` rows, padding included): its slots and its table."""
        step, by_id = self.step, {}
        with self.requests.lock:
            alive = {policy for policy, _ in self.requests.by_id.values()}
        step.release(alive | {self.requests.of(f.state.request_id)[0] for f in requests_in_batch})
        host_rows: list[int] = []
        slot_recorders: dict[int, tuple[Any, ...]] = {}
        everyone: dict[Any, None] = {}
        for future in requests_in_batch:
            policy, recorders = self.requests.of(future.state.request_id)
            slot = by_id[future.state.request_id] = step.slot(policy)
            host_rows.extend(itertools.repeat(slot, future.query_length))
            if recorders:
                slot_recorders[slot] = tuple(dict.fromkeys((*slot_recorders.get(slot, ()), *recorders)))
                everyone.update(dict.fromkeys(recorders))
        host_rows.extend(itertools.repeat(host_rows[-1] if host_rows else 0, max(0, rows - len(host_rows))))
        recorders = tuple(everyone)
        table = self.table(tuple(sorted(set(by_id.values()))), bool(recorders))
        pair = self.pair()
        buffer = self.buffers.get(pair)
        if buffer is None or buffer.shape[0] < len(host_rows):
            buffer = self.buffers[pair] = torch.zeros(
                max(self.size, len(host_rows)), dtype=torch.long, device=step.device
            )
        view = buffer[: len(host_rows)].detach()  # the buffer's memory, not a view: no guard on the buffer's size
        view.copy_(torch.tensor(host_rows, dtype=torch.long), non_blocking=True)
        return _Batch(table, recorders, view, host_rows, slot_recorders, by_id)

    def table(self, slots: tuple[int, ...], recording: bool) -> Active:
        """One policy's table, or the mixed table of the slots (of every policy served, when steps are static)."""
        step = self.step
        served = tuple(sorted(step.slot_of.values()))  # the policies in flight: what compiled steps must serve
        policies = tuple(step.policies[slot] for slot in served)
        if self.static and len(served) > 1 and mixable(policies, self.layers, self.requests.grouped):
            return step.table(served, recording)
        if len(slots) == 1:
            return activate(step.policies[slots[0]], recording)
        return step.table(slots, recording)

    def begin(self, batch: _Batch) -> None:
        self.step.begin(batch.rows, batch.host_rows, batch.slot_recorders)


def _wrap_processor(processor: Any, requests: Requests) -> None:
    if getattr(processor, _MARK, None) is requests:
        return  # the same processor, reset for a new run
    if _compat.missing_processor_attributes(processor):
        return  # told once by _compat: this processor's steps run under the policy in effect
    setattr(processor, _MARK, requests)
    schedule_every_policy(processor.scheduler, requests)
    salt_prefix_hashes(processor.cache, requests)
    register_forks(processor.cache, requests)
    rows = _Rows(processor, requests)
    ios = processor.inputs_and_outputs
    prepare, batch_update = ios.prepare_batch_tensors, ios.prepare_batch_update
    step, warmup, use_async = processor._generation_step, processor.warmup, bool(processor.use_async_batching)
    failed: dict[str, Exception] = {}  # the requests a policy's error failed in the step that ran last
    arguments: dict[int, tuple[Any, bool, int, bool]] = {}  # by IO pair: what its batch was prepared with
    #: The outputs of a step run one policy at a time (requests, tokens, log-probs), for transformers' update.
    apart: list[tuple[list[Any], list[Any], list[Any] | None]] = []

    def run_apart(model: Any, batch: _Batch) -> None:
        """Run ``batch``'s step again one policy at a time: each policy's requests prepared and run on their own."""
        apart.clear()
        processors, decode, max_kv_read, padding = arguments[rows.pair()]
        slots = dict.fromkeys(batch.requests.values())
        for slot in slots:
            futures = [f for f in batch.futures if batch.requests[f.state.request_id] == slot]
            for future, (offset, tokens) in zip(batch.futures, batch.before, strict=True):
                if batch.requests[future.state.request_id] == slot:
                    future.state.position_offset, future.state.tokens_to_process = offset, list(tokens)
            count = sum(int(f.query_length) for f in futures)
            if rows.static:
                count, max_kv_read = processor.model_runner.maybe_pad_inputs(count, max_kv_read, decode)
            prepare(futures, processors, decode, count, max_kv_read, padding)
            alone = rows.prepared(futures, count)
            alone = alone._replace(table=activate(rows.step.policies[slot], bool(alone.recorders)))  # one policy
            rows.begin(alone)
            try:
                with mixed_scope(alone.table, alone.recorders):
                    step(model)
            except POLICY_ERRORS as error:
                for request_id in alone.requests:
                    failed[request_id] = error
            in_batch, tokens, logprobs = batch_update()
            apart.append((list(in_batch), list(tokens), None if logprobs is None else list(logprobs)))

    def prepare_batch_tensors(
        requests_in_batch: list[Any],
        logits_processors: Any,
        use_decode_fast_path: bool,
        num_q_tokens: int,
        max_kv_read: int,
        use_padding: bool,
    ) -> None:
        before = tuple((f.state.position_offset, list(f.state.tokens_to_process)) for f in requests_in_batch)
        prepare(requests_in_batch, logits_processors, use_decode_fast_path, num_q_tokens, max_kv_read, use_padding)
        batch = rows.prepared(requests_in_batch, num_q_tokens)._replace(futures=tuple(requests_in_batch), before=before)
        rows.batches[rows.pair()] = batch
        arguments[rows.pair()] = (logits_processors, use_decode_fast_path, max_kv_read, use_padding)
        if not use_async:
            rows.begin(batch)  # warm-up computes right after preparing, without a generation step
        requests.history.append(tuple(rows.step.policies[s] for s in sorted(set(batch.requests.values()))))

    def generation_step(model: Any) -> None:
        failed.clear()
        batch = rows.batches.pop(rows.pair(), None)
        if batch is None:  # nothing prepared by kernelpolicy's seam: the policy in effect
            step(model)
            return
        batch = _holding(batch, rows.holders)  # each call recorded once: held until the step stands
        rows.begin(batch)
        try:
            while True:
                try:
                    if batch.table.mix is not None and len(batch.host_rows) in requests.unsplittable_counts:
                        run_apart(model, batch)  # a row count at which a mixed call cannot tell the rows apart
                        return
                    with mixed_scope(batch.table, batch.recorders):
                        step(model)
                    return
                except UnsplittableCall as error:
                    if use_async or _compat.missing_attributes({"RequestState": batch.futures[0].state}):
                        raise
                    if error.again:
                        pass  # nothing to remember: this step runs apart, later ones mix again
                    elif error.size is None:
                        requests.grouped.add(error.layer_name)  # later steps keep its policies apart
                    else:
                        requests.unsplittable_counts.add(error.size)
                    for holder in batch.recorders:
                        holder.calls.clear()  # the attempt's calls: the runs apart record theirs
                    run_apart(model, batch)
                    return
                except MixedCallError as error:
                    if use_async:
                        raise error.error from error  # async batching updates a step late: transformers fails all
                    kept = _without(rows, batch, error, failed)
                    _settle(batch, kept)
                    if kept is None:
                        return
                    batch = kept
                    rows.begin(batch)
                except Exception as error:
                    if use_async or not (isinstance(error, POLICY_ERRORS) or _raised_in_a_kernel(error)):
                        raise  # transformers' own: it stops the manager, as without kernelpolicy
                    for request_id in batch.requests:
                        failed[request_id] = error
                    return
        finally:
            for holder in batch.recorders:
                holder.pass_on()

    def prepare_batch_update() -> Any:
        if apart:  # a step run one policy at a time: the outputs of each run, in turn
            in_batch: list[Any] = []
            tokens: list[Any] = []
            logprobs: list[Any] | None = None if apart[0][2] is None else []
            for part_batch, part_tokens, part_logprobs in apart:
                in_batch.extend(part_batch)
                tokens.extend(part_tokens)
                if logprobs is not None and part_logprobs is not None:
                    logprobs.extend(part_logprobs)
            apart.clear()
        else:
            in_batch, tokens, logprobs = batch_update()
        if not failed:
            return in_batch, tokens, logprobs
        kept, kept_tokens, kept_logprobs, index = [], [], [], 0
        for future in in_batch:
            if future.has_new_token:
                index += 1
            if future.state.request_id in failed:
                continue
            kept.append(future)
            if future.has_new_token:
                kept_tokens.append(tokens[index - 1])
                if logprobs is not None:
                    kept_logprobs.append(logprobs[index - 1])
        for future in in_batch:
            error = failed.get(future.state.request_id)
            if error is not None:
                processor._handle_request_error(error, future.state)
                processor.scheduler.finish_request(future.state.request_id)
        failed.clear()
        return kept, kept_tokens, None if logprobs is None else kept_logprobs

    def warm_up(model: Any) -> None:
        served = tuple(dict.fromkeys((current_policy(), *requests.policies)))
        if rows.static and len(served) > 1 and mixable(served, requests.layers, requests.grouped):
            for policy in served:
                rows.step.slot(policy)
            with mixed_scope(rows.table(tuple(range(len(rows.step.policies))), False), ()):
                warmup(model)  # the one program of the mix, which every compiled step runs from now on
            return
        warmup(model)
        for policy in requests.policies:
            with kernel_policy(policy):
                warmup(model)

    ios.prepare_batch_tensors = prepare_batch_tensors
    ios.prepare_batch_update = prepare_batch_update
    processor._generation_step = generation_step
    processor.warmup = warm_up


def _raised_in_a_kernel(error: BaseException) -> bool:
    """Whether ``error`` was raised inside a bound kernel or variant (its frame is on the error's traceback, or on
    that of the error it was raised from). A kernel traced into a compiled program shows no frame of its own:
    its errors there are transformers' (the manager stops)."""
    kernels = set()
    for module in aware_modules():
        binding = module.__dict__.get(BINDING)
        if binding is None:
            continue
        for function in (binding.kernel, *(variant.function for variant in binding.variants.values())):
            code = getattr(inspect.unwrap(getattr(function, "__func__", function)), "__code__", None)
            if code is not None:
                kernels.add(code)
    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            return False
        trace = seen.__traceback__
        while trace is not None:
            if trace.tb_frame.f_code in kernels:
                return True
            trace = trace.tb_next
        seen = seen.__cause__ or seen.__context__
    return False


def _layer_names(model: Any) -> frozenset[str]:
    """The kernel layer names of the policy-aware modules of ``model`` (what a manager's steps can differ on)."""
    return frozenset(m.__dict__[BINDING].layer_name for m in model.modules() if BINDING in m.__dict__)


class _Holder:
    """One recorder's calls in an attempt of a step, passed on once the attempt stands (or is its requests' last)."""

    __slots__ = ("calls", "recorder")

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.calls: list[tuple[Any, ...]] = []

    def add(self, *call: Any) -> None:
        self.calls.append(call)

    def pass_on(self) -> None:
        calls, self.calls = self.calls, []
        for call in calls:
            self.recorder.add(*call)


def _holding(batch: _Batch, kept: dict[int, _Holder]) -> _Batch:
    """``batch`` with a :class:`_Holder` in place of each of its recorders: those of ``kept`` (the last step's, by
    recorder) where the recorder is the same, then ``kept`` holds this step's."""
    holders = {}
    for recorder in batch.recorders:
        holder = kept.get(id(recorder))
        holders[id(recorder)] = holder if holder is not None and holder.recorder is recorder else _Holder(recorder)
    kept.clear()
    kept.update(holders)
    by_slot = {slot: tuple(holders[id(r)] for r in group) for slot, group in batch.slot_recorders.items()}
    return batch._replace(recorders=tuple(holders.values()), slot_recorders=by_slot)


def _settle(attempt: _Batch, again: _Batch | None) -> None:
    """An attempt of a step ran until some policies' rows raised; ``again`` runs without their requests. A recorder
    that a kept request carries forgets the attempt (the step run again records those calls); one that only failed
    requests carry counts it (their calls, up to the error, ran once)."""
    kept = set() if again is None else {id(holder) for holder in again.recorders}
    for holder in attempt.recorders:
        if id(holder) in kept:
            holder.calls.clear()
        else:
            holder.pass_on()


def _without(rows: _Rows, batch: _Batch, error: MixedCallError, failed: dict[str, Exception]) -> _Batch | None:
    """``batch`` again without the requests of the policies that raised: their rows run another's path, unused."""
    step = rows.step
    bad = {step.slot(policy) for policy in error.policies}
    for request_id, slot in batch.requests.items():
        if slot in bad:
            failed[request_id] = error.error
    kept = {i: s for i, s in batch.requests.items() if s not in bad}
    if not kept:
        return None
    stand_in = next(iter(kept.values()))
    host_rows = [stand_in if slot in bad else slot for slot in batch.host_rows]
    batch.rows.copy_(torch.tensor(host_rows, dtype=torch.long))
    slot_recorders = {s: r for s, r in batch.slot_recorders.items() if s not in bad}
    recorders = tuple(dict.fromkeys(r for group in slot_recorders.values() for r in group))
    table = rows.table(tuple(sorted(set(kept.values()))), bool(recorders))
    return _Batch(table, recorders, batch.rows, host_rows, slot_recorders, kept)


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

"""The workers' counts in vLLM's ``/metrics``: per governed op, the token rows each path took.

This module owns :data:`METRIC` and each stage of its way:

- **the worker** (:class:`StepCounts`, :data:`COUNTS`): before each step's forward, the runner hands it the step's
  policies and scheduled tokens (already on the host: no tensor is read, nothing runs per op call); it adds each
  policy's tokens, and, when the step's output leaves (``sample_tokens``), turns them into rows per (op, path) from
  each policy's codes (``StepCodes.codes_of``), the output's attribute :data:`ATTRIBUTE`. With tensor parallel every
  rank counts the same rows; only the output of the rank that answers the scheduler reaches it, so a step counts
  once.
- **the engine core** (:class:`Pending`): the scheduler takes them from the step's ``ModelRunnerOutput`` and puts
  them in the ``SchedulerStats`` it sends to one front end (vLLM sends each step's stats once), in the field
  :data:`ATTRIBUTE` that :func:`add_stats_field` gives vLLM's dataclass (msgspec sends a dataclass's fields only).
- **the front end** (:func:`record`): vLLM's ``StatLoggerManager.record`` hands them to a ``prometheus_client``
  counter, in vLLM's registry; with several API servers vLLM sums every process's files
  (``PROMETHEUS_MULTIPROC_DIR``), so each row counts once whichever API server got the stats.

An op counts where the model runs it through kernelpolicy: a ``CustomOp`` layer it governs (built with a platform
forward of its own), or an IR op called (:func:`learned`, at its first call, eager or while Dynamo traces it).
Its ``path``: :data:`VLLM` (no policy governs the row's op), ``kernel``, ``original``, or ``kernel:<provider>`` (a
variant), as the row's policy chose (compiled programs compute every path on every row: the count is the row's
choice); a kernel with no provider here counts as the ``original`` it runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Final

import torch

from ._codes import DEFAULT, KERNEL, REQUIRED, STEP, VARIANTS, VERIFIED, has_provider

if TYPE_CHECKING:
    from ._admission import RequestPolicy

__all__ = ["ATTRIBUTE", "COUNTS", "HELP", "METRIC", "VLLM", "Pending", "StepCounts", "add_stats_field", "record"]

#: The counter in vLLM's ``/metrics`` (``_total`` added by ``prometheus_client``), labels ``op`` and ``path``.
METRIC: Final = "kernelpolicy_vllm_op_rows"
HELP: Final = (
    "token rows of vLLM's engine steps by governed op and the path each row's policy chose for it (a row counts "
    "once per op and step, however many layers call the op)"
)
#: The ``path`` of rows no policy governs for the op: vLLM's own choice.
VLLM: Final = "vllm"
#: The attribute of a step's ``ModelRunnerOutput``, and the field of vLLM's ``SchedulerStats``, that carry counts.
ATTRIBUTE: Final = "kernelpolicy_counts"

#: The ops this worker counts: ``CustomOp`` names it governs, IR ops the model called.
CALLED: set[str] = set()
#: The ``CustomOp`` names governed here (their kernel is the platform forward).
CUSTOM: set[str] = set()

Counts = dict[str, dict[str, int]]


def governed(name: str) -> None:
    """A ``CustomOp`` layer of ``name`` was built and governed: its rows count."""
    CUSTOM.add(name)
    CALLED.add(name)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def learned(name: str) -> bool:
    """IR op ``name`` is called (run at its first eager call, or once while Dynamo traces it: nothing in the
    compiled program)."""
    CALLED.add(name)
    return True


def _path(op: str, code: int) -> str:
    if code == DEFAULT:
        return VLLM
    if code in (KERNEL, REQUIRED, VERIFIED):
        return "kernel" if op in CUSTOM or _has_kernel(op) else "original"
    if code >= VARIANTS:
        provider = _provider(op, code - VARIANTS)
        if provider is not None:
            return f"kernel:{provider}"
    return "original"


@functools.cache
def _has_kernel(op: str) -> bool:
    """Whether IR op ``op`` has a provider other than ``native`` that this platform supports."""
    from vllm.ir.op import IrOp

    found = IrOp.registry.get(op)
    return found is not None and has_provider(found)


@functools.cache
def _provider(op: str, place: int) -> str | None:
    from vllm.ir.op import IrOp

    impls = list(IrOp.registry[op].impls.values()) if op in IrOp.registry else []
    return str(impls[place].provider) if 0 <= place < len(impls) else None


class StepCounts:
    """A worker's tokens per policy since its last output, and the rows per (op, path) they make."""

    def __init__(self) -> None:
        self.tokens: dict[RequestPolicy | None, int] = {}
        self._labels: dict[RequestPolicy | None, tuple[tuple[str, str], ...]] = {}
        self._known = (0, 0)

    def step(self, policies: list[RequestPolicy | None], tokens: Any) -> None:
        """A step's requests, in batch order: their policies and scheduled tokens (a host array)."""
        counts = self.tokens
        if all(policy is None for policy in policies):
            counts[None] = counts.get(None, 0) + int(tokens.sum())
            return
        # summed per policy object first (requests of one policy share it; a policy's hash is slower than an id's)
        sums: dict[int, list[Any]] = {}
        for policy, count in zip(policies, tokens.tolist(), strict=False):
            found = sums.get(id(policy))
            if found is None:
                sums[id(policy)] = [policy, count]
            else:
                found[1] += count
        for policy, count in sums.values():
            counts[policy] = counts.get(policy, 0) + count

    def labels(self, policy: RequestPolicy | None) -> tuple[tuple[str, str], ...]:
        """The (op, path) of each counted op for rows of ``policy`` (cached until an op is added or called)."""
        known = (len(STEP.columns), len(CALLED))
        if known != self._known:
            self._labels.clear()
            self._known = known
        found = self._labels.get(policy)
        if found is None:
            codes = None if policy is None else STEP.codes_of(policy)
            found = tuple(
                (op, _path(op, DEFAULT if codes is None else int(codes[column])))
                for op, column in sorted(STEP.columns.items())
                if op in CALLED
            )
            self._labels[policy] = found
        return found

    def take(self) -> Counts | None:
        """The rows per op and path since the last call (None: none), cleared."""
        if not self.tokens:
            return None
        found: Counts = {}
        for policy, count in self.tokens.items():
            for op, path in self.labels(policy):
                paths = found.setdefault(op, {})
                paths[path] = paths.get(path, 0) + count
        self.tokens = {}
        return found or None


#: This worker's counts.
COUNTS = StepCounts()


def add(into: Counts, counts: Counts) -> None:
    for op, paths in counts.items():
        mine = into.setdefault(op, {})
        for path, count in paths.items():
            mine[path] = mine.get(path, 0) + count


class Pending:
    """The engine core's counts not sent yet (a step without stats, as with ``--disable-log-stats``, keeps them)."""

    def __init__(self) -> None:
        self.counts: Counts = {}

    def step(self, model_runner_output: Any, outputs: dict[int, Any]) -> None:
        """After the scheduler's ``update_from_output``: the step's counts in the stats it sends, if any."""
        counts = getattr(model_runner_output, ATTRIBUTE, None)
        if counts:
            add(self.counts, counts)
        if not self.counts:
            return
        stats = next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None), None)
        if stats is not None:
            setattr(stats, ATTRIBUTE, self.counts)
            self.counts = {}


#: This engine core's counts.
PENDING = Pending()


def add_stats_field() -> None:
    """vLLM's ``SchedulerStats`` gains the field :data:`ATTRIBUTE` (default None, not in ``__init__``), so that msgspec
    sends it from the engine core to the front end (both run this, before either encodes one)."""
    from vllm.v1.metrics.stats import SchedulerStats

    stats: Any = SchedulerStats
    if ATTRIBUTE in stats.__dataclass_fields__:
        return
    kind = Counts | None
    field: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    field.name, field.type, field._field_type = ATTRIBUTE, kind, dataclasses._FIELD  # type: ignore[attr-defined]
    stats.__dataclass_fields__[ATTRIBUTE] = field
    stats.__annotations__[ATTRIBUTE] = kind
    setattr(stats, ATTRIBUTE, None)
    if "__msgspec_cache__" in vars(stats):  # msgspec read the fields before: read them again
        delattr(stats, "__msgspec_cache__")


@functools.cache
def _counter() -> Any:
    from prometheus_client import Counter

    return Counter(METRIC, HELP, ["op", "path"])


def record(scheduler_stats: Any) -> None:
    """In the front end: the counts a step's stats carry, into vLLM's ``/metrics``."""
    counts: Counts | None = getattr(scheduler_stats, ATTRIBUTE, None)
    if not counts:
        return
    counter = _counter()
    for op, paths in counts.items():
        for path, count in paths.items():
            counter.labels(op, path).inc(count)

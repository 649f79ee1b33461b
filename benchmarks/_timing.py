"""The measurement method, in one place.

Every number in the benchmarks comes from here:

- A *group* is a set of variants measured together; one of them (or, per
  variant, another named variant) is the reference for ratios.
- Each variant is a statement (``"m(x)"``) timed by
  :class:`torch.utils.benchmark.Timer`: a sample is one ``Timer.timeit(n)``
  block (see :func:`_sampler`). Timer's own schedulers
  (``blocked_autorange``, ``adaptive_autorange``) time one variant after the
  other, which a noisy machine turns into ratios (benchmarks/README.md,
  "torch.utils.benchmark"); the rounds below interleave instead.
- Calibration picks, per variant, the number of calls ``n`` in one sample so
  that a sample lasts about ``Settings.target_ns``; it also serves as warm-up,
  followed by ``Settings.warmup`` untimed samples.
- Variants are measured interleaved: round ``r`` takes one sample of A, one of
  B, one of C, ..., then round ``r + 1``. The variant's context (a policy
  scope, say) is entered before and left after each sample, outside the
  timed block.
- Per variant: median, min, max and quartiles of the per-round ns per call,
  and the ratio to the reference computed *per round* (both sampled within
  the same round, so slow phases of a noisy machine cancel) then summarised
  by median and quartiles. On a shared machine the ratios are the result; the
  absolute times are context.

Nothing here asserts anything about a timing.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.benchmark import Timer

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from contextlib import AbstractContextManager

__all__ = ["Group", "Settings", "Variant", "VariantResult", "loop_overhead_ns", "measure", "summarize"]


@dataclass(frozen=True)
class Settings:
    """How much to measure: rounds, sample length, warm-up."""

    rounds: int
    target_ns: int
    warmup: int
    max_loops: int = 1_000_000

    @classmethod
    def full(cls) -> Settings:
        return cls(rounds=31, target_ns=20_000_000, warmup=3)

    @classmethod
    def quick(cls) -> Settings:
        return cls(rounds=3, target_ns=1_000_000, warmup=1)


@dataclass(frozen=True)
class Variant:
    """One thing to time: ``stmt`` run with ``names`` as local variables.

    ``context`` builds a context manager entered around each sample (untimed);
    ``ratio_to`` names the reference variant (default: the group baseline).
    """

    name: str
    stmt: str
    names: Mapping[str, Any] = field(default_factory=dict)
    context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    ratio_to: str | None = None
    note: str = ""


@dataclass
class VariantResult:
    """Summary of one variant's per-round samples (nanoseconds per call)."""

    name: str
    note: str
    ratio_to: str
    loops: int
    samples_ns: list[float]
    median_ns: float
    min_ns: float
    max_ns: float
    q1_ns: float
    q3_ns: float
    ratio: float
    ratio_min: float
    ratio_max: float
    ratio_q1: float
    ratio_q3: float
    extra: dict[str, float | int | str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "note": self.note,
            "ratio_to": self.ratio_to,
            "loops": self.loops,
            "rounds": len(self.samples_ns),
            "median_ns": self.median_ns,
            "min_ns": self.min_ns,
            "max_ns": self.max_ns,
            "q1_ns": self.q1_ns,
            "q3_ns": self.q3_ns,
            "ratio": self.ratio,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
            "ratio_q1": self.ratio_q1,
            "ratio_q3": self.ratio_q3,
            "samples_ns": self.samples_ns,
            "extra": self.extra,
        }


@dataclass
class Group:
    """A table: variants measured together against ``baseline``."""

    title: str
    baseline: str
    variants: list[VariantResult]
    unit: str = "call"
    extra_columns: list[str] = field(default_factory=list)

    def variant(self, name: str) -> VariantResult:
        for result in self.variants:
            if result.name == name:
                return result
        raise KeyError(name)

    def as_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "baseline": self.baseline,
            "unit": self.unit,
            "variants": [v.as_json() for v in self.variants],
        }


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summarize(
    name: str,
    samples_ns: Sequence[float],
    reference_ns: Sequence[float],
    *,
    ratio_to: str,
    loops: int = 1,
    note: str = "",
) -> VariantResult:
    """Summarise per-round samples; ratios are taken round by round against ``reference_ns``."""
    if len(samples_ns) != len(reference_ns) or not samples_ns:
        raise ValueError(f"{name}: {len(samples_ns)} samples against {len(reference_ns)} reference samples")
    ratios = [value / reference for value, reference in zip(samples_ns, reference_ns, strict=True)]
    q1, q3 = _quartiles(samples_ns)
    r1, r3 = _quartiles(ratios)
    return VariantResult(
        name=name,
        note=note,
        ratio_to=ratio_to,
        loops=loops,
        samples_ns=[float(v) for v in samples_ns],
        median_ns=float(statistics.median(samples_ns)),
        min_ns=float(min(samples_ns)),
        max_ns=float(max(samples_ns)),
        q1_ns=float(q1),
        q3_ns=float(q3),
        ratio=float(statistics.median(ratios)),
        ratio_min=float(min(ratios)),
        ratio_max=float(max(ratios)),
        ratio_q1=float(r1),
        ratio_q3=float(r3),
    )


def _sampler(variant: Variant) -> Callable[[int], int]:
    """A function taking ``n`` and returning the ns taken by ``n`` runs of the statement.

    One sample is one :meth:`torch.utils.benchmark.Timer.timeit` block: the standard library's
    :mod:`timeit` loop (the variant's names as its globals, the garbage collector off) with torch's
    thread count fixed, after Timer's own untimed warm-up block of ``max(n // 100, 2)`` runs.
    """
    for name in variant.names:
        # timeit's loop keeps its own state in names that start with "_".
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"{variant.name}: bad name {name!r} (identifiers not starting with '_')")
    timer = Timer(
        stmt=textwrap.dedent(variant.stmt).strip(),
        globals=dict(variant.names),
        num_threads=torch.get_num_threads(),
        label=variant.name,
    )

    def run(n: int) -> int:
        return round(timer.timeit(n).raw_times[0] * 1e9)

    return run


def _calibrate(
    run: Callable[[int], int], context: Callable[[], AbstractContextManager[Any]], settings: Settings
) -> int:
    """Calls per sample so that one sample lasts about ``settings.target_ns`` (also a warm-up)."""
    n = 1
    for _ in range(20):
        with context():
            took = max(run(n), 1)
        if took >= settings.target_ns * 0.8 or n >= settings.max_loops:
            break
        n = min(settings.max_loops, max(n + 1, math.ceil(n * settings.target_ns / took)))
    return n


def measure(
    title: str,
    variants: Sequence[Variant],
    *,
    baseline: str,
    settings: Settings,
    outer: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    unit: str = "call",
) -> Group:
    """Measure ``variants`` interleaved, round by round; ``outer`` is entered once around everything."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names) or baseline not in names:
        raise ValueError(f"{title}: variant names must be unique and include the baseline {baseline!r}")
    for v in variants:
        if v.ratio_to is not None and v.ratio_to not in names:
            raise ValueError(f"{title}: {v.name} is compared to unknown variant {v.ratio_to!r}")
    with outer():
        runs = [_sampler(v) for v in variants]
        loops = [_calibrate(run, v.context, settings) for run, v in zip(runs, variants, strict=True)]
        for _ in range(settings.warmup):
            for run, v, n in zip(runs, variants, loops, strict=True):
                with v.context():
                    run(n)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(settings.rounds):
            for run, v, n in zip(runs, variants, loops, strict=True):
                with v.context():
                    took = run(n)
                samples[v.name].append(took / n)
    results = [
        summarize(
            v.name,
            samples[v.name],
            samples[v.ratio_to or baseline],
            ratio_to=v.ratio_to or baseline,
            loops=n,
            note=v.note,
        )
        for v, n in zip(variants, loops, strict=True)
    ]
    return Group(title=title, baseline=baseline, variants=results, unit=unit)


def loop_overhead_ns(settings: Settings) -> float:
    """Median ns per iteration of the timing loop with an empty body (``pass``)."""
    group = measure("loop", [Variant("pass", "pass")], baseline="pass", settings=settings)
    return group.variants[0].median_ns

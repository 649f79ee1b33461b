"""``python -m benchmarks.run``: run the kernelpolicy benchmarks, print Markdown tables, write JSON.

Options: ``--quick`` (tiny counts, a smoke test), ``--sections a,b`` (a subset,
in the given order), ``--json PATH`` (default ``benchmarks/results/latest.json``),
``--threads N`` (torch intra-op threads, default 1). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._layers import KernelRepos
from ._sections import SECTIONS, RunContext, Section
from ._timing import Settings, loop_overhead_ns

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._timing import Group

__all__ = ["main", "package_versions"]

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "latest.json"


def _sections(text: str) -> list[str]:
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in SECTIONS:
            raise argparse.ArgumentTypeError(f"unknown section {name!r}; valid sections: {', '.join(SECTIONS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise argparse.ArgumentTypeError(f"no section given; valid sections: {', '.join(SECTIONS)}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmarks of kernelpolicy's per-call dispatch against kernels' direct binding.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny counts (a smoke test, well under a minute)")
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        metavar="A,B,...",
        help=f"comma-separated sections to run, in that order (default: all: {','.join(SECTIONS)})",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, metavar="PATH", help="where to write the results")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the printed report there (benchmarks/RESULTS.md is this report of a full run)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1: on a small shared machine more threads mostly measure contention)",
    )
    return parser


def package_versions() -> dict[str, str]:
    """The versions a result depends on, as the reports' headers and JSON files state them."""

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "torch": torch.__version__,
        "kernels": version("kernels"),
        "transformers": version("transformers"),
        "kernelpolicy": version("kernelpolicy"),
        "python": platform.python_version(),
    }


def _unit(group: Group) -> tuple[str, float]:
    reference = group.variant(group.baseline).median_ns
    if reference < 10_000:
        return "ns", 1.0
    if reference < 10_000_000:
        return "µs", 1e3
    return "ms", 1e6


def _num(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render_group(group: Group) -> str:
    unit, scale = _unit(group)
    rounds = len(group.variants[0].samples_ns)
    head = [
        "variant",
        f"median {unit}/{group.unit}",
        f"min..max {unit}",
        f"IQR {unit}",
        "ratio",
        "ratio IQR",
        "ratio to",
        f"calls per sample ({rounds} rounds)",
        *group.extra_columns,
    ]
    lines = [
        f"### {group.title}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---"] + ["---:"] * 5 + ["---"] + ["---:"] * (1 + len(group.extra_columns))) + " |",
    ]
    for v in group.variants:
        extra = [v.extra.get(column, "") for column in group.extra_columns]
        row = [
            v.name,
            _num(v.median_ns / scale),
            f"{_num(v.min_ns / scale)}..{_num(v.max_ns / scale)}",
            f"{_num(v.q1_ns / scale)}..{_num(v.q3_ns / scale)}",
            "1 (ref)" if v.ratio_to == v.name else f"{v.ratio:.3f}",
            "" if v.ratio_to == v.name else f"{v.ratio_q1:.3f}..{v.ratio_q3:.3f}",
            "" if v.ratio_to == v.name else v.ratio_to,
            str(v.loops),
            *(_num(e) if isinstance(e, (int, float)) else str(e) for e in extra),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_section(section: Section) -> str:
    parts = [f"## {section.name}: {section.title}", "", section.description, ""]
    for group in section.groups:
        parts += [render_group(group), ""]
    if section.info:
        parts += [f"- {key}: {value}" for key, value in section.info.items()]
        parts.append("")
    parts.append(f"_section time: {section.seconds:.1f} s_")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "-m", "benchmarks.run", *argv_list])
    settings = Settings.quick() if args.quick else Settings.full()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    now = dt.datetime.now().astimezone()
    versions = package_versions()
    report: list[str] = []

    def say(text: str) -> None:
        report.append(text)
        print(text, end="", flush=True)

    say(
        f"# kernelpolicy benchmarks: {now:%Y-%m-%d %H:%M:%S %Z}, torch {versions['torch']}, "
        f"kernels {versions['kernels']}, Python {versions['python']}, command: `{command}`\n"
    )
    overhead = loop_overhead_ns(settings)
    say(
        f"\n{settings.rounds} interleaved rounds per group, samples of ~{settings.target_ns / 1e6:g} ms, "
        f"{settings.warmup} warm-up samples; torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, "
        f"{platform.machine()}; empty timing loop {overhead:.1f} ns/iteration (included in every ns/call). "
        "Ratios are medians of per-round ratios; times are noisy, ratios are the result.\n\n"
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kernelpolicy-bench-") as tmp:
        ctx = RunContext(settings=settings, quick=args.quick, repos=KernelRepos(Path(tmp)))
        for name in args.sections:
            section_start = time.perf_counter()
            section = SECTIONS[name](ctx)
            section.seconds = time.perf_counter() - section_start
            results[name] = section.as_json()
            say(render_section(section) + "\n\n")
    total = time.perf_counter() - started
    document = {
        "meta": {
            "date": now.isoformat(timespec="seconds"),
            "command": command,
            "executable": sys.executable,
            "versions": versions,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "quick": args.quick,
            "settings": {
                "rounds": settings.rounds,
                "target_ns": settings.target_ns,
                "warmup": settings.warmup,
            },
            "loop_overhead_ns": overhead,
            "seconds": total,
        },
        "sections": results,
    }
    path: Path = args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("".join(report).rstrip() + "\n")
    print(f"total {total:.1f} s; results written to {path}" + (f" and {args.markdown}" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

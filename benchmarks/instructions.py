"""``python -m benchmarks.instructions``: dispatch cost as instructions per call, under callgrind.

Wall-clock ratios on a small shared machine move by several percent between
runs (the A/A control rows of ``benchmarks.run`` show it). Instruction counts
do not: ``valgrind --tool=callgrind`` counts the instructions a program
executes, the same for the same command on the same machine and checkout
whatever else the machine does (with string hashing fixed: the children run with ``PYTHONHASHSEED=0``;
with random hash seeds the counts moved by 0.5 % between runs). Counts do move
between machines and checkouts (the A/A control, two identical modules,
read 1.000 on one machine, 1.05 and 0.85 on others): compare rows of one run. They are not time (a cache miss or a branch costs no instruction), but
the eager dispatch overhead is interpreter work, where instructions and time
go together.

Method. Each variant runs in its own ``python -m benchmarks.instructions
--child NAME --calls K`` under ``valgrind --tool=callgrind --instr-atstart=no
--collect-atstart=no --toggle-collect=*functools_reduce*``: torch is imported
and the modules are built uninstrumented (fast), warmed up, then the child
switches instrumentation on (``callgrind_control -i on``) and runs
``functools.reduce(lambda _, __: m(x), range(K), None)`` inside the
variant's scope and ``torch.no_grad()``. Only instructions inside
``functools.reduce`` are counted, so nothing else the process does is. Each
variant runs with ``K = calls`` and ``K = 2 * calls``; the difference divided
by ``calls`` is the cost of one iteration, constant start-up cancelled. The
``harness`` variant (the lambda returns ``x`` without calling a module) is the
per-iteration cost of the loop itself and is subtracted from every other row
("net"). Ratios are net instructions to those of kernels' direct binding.

Needs ``valgrind`` and ``callgrind_control`` (Debian package ``valgrind``).
Two children run at a time; the whole run takes a few minutes.

``python -m benchmarks.instructions [--calls N] [--variant TEXT ...] [--json PATH] [--markdown PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["VARIANTS", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "instructions.json"
HARNESS = "harness"
NOOP_BASELINE = "noop (a) kernels direct binding"
RMSNORM_BASELINE = "rmsnorm (a) kernels direct binding"


@dataclass(frozen=True)
class Spec:
    group: str  # "noop" or "rmsnorm"
    module: str  # key of the module built by _modules()
    scope: str  # key of the scope entered around the loop ("" for none)
    baseline: str


# name -> what the child times. The names are the rows of the report.
VARIANTS: dict[str, Spec] = {
    HARNESS: Spec("noop", "", "", NOOP_BASELINE),
    NOOP_BASELINE: Spec("noop", "direct", "", NOOP_BASELINE),
    "noop (a') kernels direct binding, second instance (A/A control)": Spec("noop", "direct_again", "", NOOP_BASELINE),
    "noop (b) kernelpolicy prefer, can_torch_compile=True": Spec("noop", "policy_ctc", "", NOOP_BASELINE),
    "noop (b) kernelpolicy prefer, can_torch_compile=False": Spec("noop", "policy_plain", "", NOOP_BASELINE),
    "noop (b) kernelpolicy under kernels_disabled()": Spec("noop", "policy_ctc", "disabled", NOOP_BASELINE),
    "noop (b) kernelpolicy under kernel_policy(Other='disable')": Spec("noop", "policy_ctc", "other", NOOP_BASELINE),
    "noop (b) kernelpolicy, 3 nested scopes active": Spec("noop", "policy_ctc", "nested", NOOP_BASELINE),
    "noop (c) CustomOp-style self._forward_method(x)": Spec("noop", "custom_op", "", NOOP_BASELINE),
    "noop (d) seed: is_compiling() or CONFIG.disabled": Spec("noop", "seed", "", NOOP_BASELINE),
    "noop plain module, no kernels (class forward)": Spec("noop", "plain", "", NOOP_BASELINE),
    RMSNORM_BASELINE: Spec("rmsnorm", "rms_direct", "", RMSNORM_BASELINE),
    "rmsnorm (b) kernelpolicy prefer, can_torch_compile=True": Spec("rmsnorm", "rms_policy_ctc", "", RMSNORM_BASELINE),
    "rmsnorm (b) kernelpolicy prefer, can_torch_compile=False": Spec(
        "rmsnorm", "rms_policy_plain", "", RMSNORM_BASELINE
    ),
}


# --- the child: build, warm up, count one loop ----------------------------------------------------------


def _modules(root: Path) -> dict[str, Any]:
    """The modules of ``benchmarks.run``'s eager_noop and eager_rmsnorm sections; RMSNorm keys get ``rms_``."""
    from . import _layers

    repos = _layers.KernelRepos(root)
    modules: dict[str, Any] = dict(_layers.noop_modules(repos))
    modules.update({f"rms_{k}": m for k, m in _layers.rms_norm_modules(repos, 4096).items()})
    return modules


def _scope(key: str) -> contextlib.AbstractContextManager[Any]:
    from kernelpolicy import kernel_policy, kernels_disabled

    from . import _layers

    if key == "disabled":
        return kernels_disabled()
    if key == "other":
        return kernel_policy(Other="disable")
    if key == "nested":
        return _layers.nested_scopes()
    return contextlib.nullcontext()


def _child(name: str, calls: int, under_valgrind: bool) -> None:
    import torch

    torch.set_num_threads(1)
    spec = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="kernelpolicy-instr-") as tmp:
        modules = _modules(Path(tmp))
        shape = (1, 1) if spec.group == "noop" else (1, 4096)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        if spec.module:
            m = modules[spec.module]

            def step(_: Any, __: Any) -> Any:
                return m(x)
        else:

            def step(_: Any, __: Any) -> Any:
                return x

        gc.collect()
        gc.disable()  # as benchmarks.run's timed loops: no collection inside the counted loop
        with torch.no_grad(), _scope(spec.scope):
            functools.reduce(step, range(50), None)  # warm-up: first-call paths, caches
            if under_valgrind:
                subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
            functools.reduce(step, range(calls), None)


# --- the parent: run the children, difference, report ---------------------------------------------------


def count(name: str, calls: int, out_dir: Path) -> int:
    """Instructions callgrind collected inside ``functools.reduce`` for ``calls`` iterations of ``name``."""
    index = list(VARIANTS).index(name)
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        "--toggle-collect=*functools_reduce*",
        f"--callgrind-out-file={out_dir / f'callgrind.{index}.{calls}.out'}",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--child",
        name,
        "--calls",
        str(calls),
    ]
    # A fixed hash seed: string hashes, and so dict and set probing, are the same in every child.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("KERNELPOLICY", None)
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False, timeout=1800)
    found = re.findall(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(found[-1])


def measure(names: Sequence[str], calls: int, jobs: int = 2) -> dict[str, dict[str, float]]:
    """Per variant: raw and net (harness subtracted) instructions per call, and the net ratio to its baseline."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("valgrind and callgrind_control are needed (Debian package 'valgrind')")
    wanted = list(dict.fromkeys([HARNESS, *(VARIANTS[n].baseline for n in names), *names]))
    runs = [(name, k) for name in wanted for k in (calls, 2 * calls)]
    with tempfile.TemporaryDirectory(prefix="kernelpolicy-callgrind-") as tmp, ThreadPoolExecutor(jobs) as pool:
        counts = dict(zip(runs, pool.map(lambda run: count(run[0], run[1], Path(tmp)), runs), strict=True))
    raw = {name: (counts[name, 2 * calls] - counts[name, calls]) / calls for name in wanted}
    results: dict[str, dict[str, float]] = {}
    for name in wanted:
        net = raw[name] - raw[HARNESS]
        base = raw[VARIANTS[name].baseline] - raw[HARNESS]
        results[name] = {"raw": raw[name], "net": net}
        if name != HARNESS:
            results[name]["ratio"] = net / base
    return results


def render(results: dict[str, dict[str, float]], calls: int, command: str, versions: dict[str, str]) -> str:
    lines = [
        f"# kernelpolicy instruction counts: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"torch {versions['torch']}, kernels {versions['kernels']}, Python {versions['python']}, "
        f"command: `{command}`",
        "",
        f"callgrind, instructions per `m(x)` inside `functools.reduce` ((count at {2 * calls} calls - count at "
        f"{calls}) / {calls}); net = minus the harness's {results[HARNESS]['raw']:,.0f} per iteration. "
        "Children run with PYTHONHASHSEED=0: a rerun gives identical counts.",
        "",
        "| variant | instructions/call | net | net ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in results.items():
        if name == HARNESS:
            continue
        ratio = "1 (ref)" if VARIANTS[name].baseline == name else f"{row['ratio']:.3f}"
        lines.append(f"| {name} | {row['raw']:,.0f} | {row['net']:,.0f} | {ratio} |")
    return "\n".join(lines)


def _names(parts: Sequence[str]) -> list[str]:
    chosen = [name for name in VARIANTS if any(part in name for part in parts)]
    if not chosen:
        raise ValueError(f"no variant name contains any of {list(parts)}; variants: {', '.join(VARIANTS)}")
    return chosen


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.instructions",
        description="Instructions per call of kernelpolicy's dispatch and its anchors, counted by callgrind.",
    )
    parser.add_argument("--calls", type=int, default=2000, help="iterations of the smaller run (default 2000)")
    parser.add_argument(
        "--variant",
        action="append",
        metavar="TEXT",
        help="measure the variants whose name contains TEXT (repeatable; default: all)",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, metavar="PATH", help="where to write the results")
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="PATH",
        help="also write the printed report there (benchmarks/INSTRUCTIONS.md is this report of a full run)",
    )
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    if args.child is not None:
        _child(args.child, args.calls, under_valgrind=True)
        return 0
    command = "python -m benchmarks.instructions " + shlex.join(list(sys.argv[1:] if argv is None else argv))
    try:
        names = _names(args.variant) if args.variant else list(VARIANTS)
    except ValueError as error:
        parser.error(str(error))
    from .run import package_versions  # the parent only: the children import no more than they measure

    versions = package_versions()
    results = measure(names, args.calls)
    report = render(results, args.calls, command.strip(), versions)
    out(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {"calls": args.calls, "command": command.strip(), "versions": versions, "results": results}
    args.json.write_text(json.dumps(document, indent=2))
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report + "\n")
    out(f"\nJSON: {args.json}" + (f", Markdown: {args.markdown}" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

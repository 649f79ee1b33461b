"""``python -m benchmarks.persisted``: what the policy check of a persisted compiled program costs a call.

A DemoModel(16) with a traceable local RMSNorm kernel (two RMSNorm layers, one check: one per layer name),
called on a (2, 16) float32 tensor with one thread, compiled with Inductor three ways: ``torch.compile`` in
this process (the policy is a guard; the program has no check), ``compile_per_policy`` (``aot_compile``: the
program carries ``kernelpolicy::policy_check`` after the first RMSNorm, and the policy is dispatched in
Python by ``PolicyPrograms``), and the bare ``aot_compile``'d function; plus one call of the op alone. One
``Compare`` table; read the ratios, not the times.
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import Any

import torch
from torch.utils.benchmark import Compare, Measurement, Timer

import kernelpolicy
from kernelpolicy.artifacts import compile_per_policy
from kernelpolicy.testing import DemoModel, kernelize_locally, rms_norm_kernel_source, write_kernel_repo

__all__ = ["main"]


def main(min_run_time: float = 1.0) -> list[Measurement]:
    torch.set_num_threads(1)
    repo = write_kernel_repo(pathlib.Path(tempfile.mkdtemp()), rms_norm_kernel_source(can_torch_compile=True))
    torch.manual_seed(0)
    model = kernelize_locally(DemoModel(16).eval(), {"RMSNorm": repo})
    x = torch.ones(2, 16)
    in_process = torch.compile(model)
    programs = compile_per_policy(model, (x,), policies=["prefer"])
    bare = programs.programs[kernelpolicy.Policy("prefer")]
    op = torch.ops.kernelpolicy.policy_check
    torch.testing.assert_close(in_process(x), programs(x))
    statements: list[tuple[str, str, dict[str, Any]]] = [
        ("torch.compile, in this process (no check)", "f(x)", {"f": in_process}),
        ("compile_per_policy (1 check, PolicyPrograms)", "f(x)", {"f": programs}),
        ("its aot_compile'd program alone (1 check)", "f(x)", {"f": bare}),
        ("kernelpolicy::policy_check alone", "op(x, 'RMSNorm', 'k', True, False, '', 'prefer')", {"op": op}),
    ]
    results = []
    for round_ in range(2):  # interleaved: a drift of the machine hits them all
        for label, statement, names in statements:
            timer = Timer(
                statement,
                globals={**names, "x": x},
                label="DemoModel(16), compiled with Inductor",
                sub_label=label,
                description=f"round {round_}",
            )
            results.append(timer.blocked_autorange(min_run_time=min_run_time))
    print(Compare(results))  # Compare.print() is untyped in torch 2.9; its str() is the same table
    return results


if __name__ == "__main__":
    main()

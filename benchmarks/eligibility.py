"""``python -m benchmarks.eligibility``: what a rule and a variant choice cost an eager call (torch.utils.benchmark).

One RMSNorm(16) layer with a local kernel, called eagerly on a (2, 16) float32 tensor with one thread: kernels'
own binding, kernelpolicy without a rule, with a dtype rule, with dtypes, devices and a check, with a rule
that refuses the call (the original forward runs), and a layer with a second kernel bound as the variant
``fast``, under ``prefer`` (its default kernel) and under ``RMSNorm="kernel:fast"``. One ``Compare`` table;
read the ratios, not the times.
"""

from __future__ import annotations

import pathlib
import tempfile
import warnings

import kernels
import torch
from torch.utils.benchmark import Compare, Measurement, Timer

import kernelpolicy
from kernelpolicy.testing import RMSNorm, local_mapping, rms_norm_kernel_source, write_kernel_repo

__all__ = ["main"]


def main(min_run_time: float = 1.0) -> list[Measurement]:
    torch.set_num_threads(1)
    repo = write_kernel_repo(pathlib.Path(tempfile.mkdtemp()), rms_norm_kernel_source(can_torch_compile=True))
    aware, plain, varied = RMSNorm(16), RMSNorm(16), RMSNorm(16)
    with local_mapping({"RMSNorm": repo}):
        kernelpolicy.kernelize(aware, mode="inference", device="cpu")
        kernels.kernelize(plain, mode=kernels.Mode.INFERENCE, device="cpu")
        kernelpolicy.kernelize(varied, mode="inference", device="cpu")
        kernelpolicy.kernelize(varied, mode="inference", device="cpu", variant="fast")
    x = torch.ones(2, 16)
    rules: list[tuple[str, dict[str, object]]] = [
        ("no rule", {}),
        ("dtypes", {"dtypes": [torch.float32]}),
        ("dtypes, devices, check", {"dtypes": [torch.float32], "devices": ["cpu"], "check": _multiple_of_8}),
        ("refused (original runs)", {"dtypes": [torch.bfloat16]}),
    ]
    results = []
    try:
        for round_ in range(2):  # variants interleaved: a drift of the machine hits them all
            results.append(_time(plain, x, "kernels' own binding", round_, min_run_time))
            for label, rule in rules:
                kernelpolicy.kernel_accepts("RMSNorm", **rule)  # type: ignore[arg-type]
                results.append(_time(aware, x, f"kernelpolicy, {label}", round_, min_run_time))
            kernelpolicy.kernel_accepts("RMSNorm")
            results.append(_time(varied, x, "variants bound, prefer (the default kernel)", round_, min_run_time))
            with warnings.catch_warnings():  # `plain` is kernels' own on purpose: the warning says so, once
                warnings.filterwarnings("ignore", "the kernel policy .* does not reach")
                with kernelpolicy.kernel_policy(RMSNorm="kernel:fast"):
                    results.append(_time(varied, x, "variants bound, RMSNorm='kernel:fast'", round_, min_run_time))
    finally:
        kernelpolicy.kernel_accepts("RMSNorm")
    print(Compare(results))  # Compare.print() is untyped in torch 2.9; its str() is the same table
    return results


def _multiple_of_8(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    return hidden_states.shape[-1] % 8 == 0


def _time(module: torch.nn.Module, x: torch.Tensor, label: str, round_: int, min_run_time: float) -> Measurement:
    timer = Timer(
        "m(x)",
        globals={"m": module, "x": x},
        label="RMSNorm(16) eager call",
        sub_label=label,
        description=f"round {round_}",
    )
    return timer.blocked_autorange(min_run_time=min_run_time)


if __name__ == "__main__":
    main()

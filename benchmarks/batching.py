"""``python -m benchmarks.batching``: what mixing policies costs transformers' continuous batching (tokens/s).

The same requests (16 prompts of 4 to 12 tokens, 64 greedy new tokens each, a tiny Llama with a local RMSNorm
kernel, one CPU thread) through a ``ContinuousBatchingManager``:

- ``transformers alone``: the model kernelized by ``kernels.kernelize``, a manager without kernelpolicy's seam;
- ``kernelpolicy, 1 policy``: the model kernelized by ``kernelpolicy.kernelize``, every request under ``prefer``;
- ``kernelpolicy, 2 policies`` / ``4 policies``: the requests spread over 2 or 4 policies, submitted interleaved
  (each step serves one policy, the policies taking turns).

Each arm is one ``torch.utils.benchmark`` measurement of a run from the first request submitted to the last
result (the manager is started in the untimed setup and stopped after: its thread wakes every 0.1 s when idle,
which would add up to 0.1 s at random to a timed stop), the arms
interleaved over the rounds so a drift of the machine hits them all. Printed: torch's ``Compare`` table, then
tokens/s per arm (median over the rounds) and its ratio to transformers alone. Read the ratios, not the times.
"""

from __future__ import annotations

import contextlib
import pathlib
import statistics
import tempfile
from typing import TYPE_CHECKING, Any

import kernels
import torch
from torch.utils.benchmark import Compare, Measurement, Timer

import kernelpolicy
from kernelpolicy.testing import local_mapping, rms_norm_kernel_source, tiny_llama, write_kernel_repo

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["main"]

POLICIES = [kernelpolicy.Policy.parse(text) for text in ("prefer", "RMSNorm=disable", "disable", "SiLU=disable")]


@contextlib.contextmanager
def _without_kernelpolicy() -> Iterator[None]:
    """Managers made inside are transformers' alone (the seam kernelpolicy.batching puts on __init__ set aside)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    init = ContinuousBatchingManager.__init__
    ContinuousBatchingManager.__init__ = getattr(init, "__wrapped__", init)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContinuousBatchingManager.__init__ = init  # type: ignore[method-assign]


def _started(model: Any, new_tokens: int, managers: list[Any]) -> Any:
    """A started manager (appended to ``managers``, stopped by the caller): not part of the timed run."""
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = transformers.GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512),
    )
    manager.start()
    managers.append(manager)
    return manager


def _workload(manager: Any, prompts: list[list[int]], policies: list[Any], new_tokens: int) -> int:
    """Submit every prompt (interleaving the policies), wait for every result; the tokens generated."""
    for i, prompt in enumerate(prompts):
        with kernelpolicy.kernel_policy(policies[i % len(policies)]):
            manager.add_request(prompt, max_new_tokens=new_tokens)
    tokens = finished = 0
    while finished < len(prompts):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError("the batching manager returned no result for 60 s")
        if result.is_finished():
            finished += 1
            tokens += len(result.generated_tokens)
    return tokens


def main(rounds: int = 4, requests: int = 16, new_tokens: int = 64) -> list[Measurement]:
    torch.set_num_threads(1)
    repo = write_kernel_repo(
        pathlib.Path(tempfile.mkdtemp()), rms_norm_kernel_source(can_torch_compile=True, offset=0.5)
    )
    plain, aware = tiny_llama(), tiny_llama()
    with local_mapping({"RMSNorm": repo}):
        kernels.kernelize(plain, mode=kernels.Mode.INFERENCE, device="cpu")
        kernelpolicy.kernelize(aware, mode="inference", device="cpu")
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, 256, (int(n),), generator=generator).tolist()
        for n in torch.randint(4, 13, (requests,), generator=generator)
    ]
    arms: list[tuple[str, Any, list[Any]]] = [
        ("transformers alone", plain, POLICIES[:1]),
        ("kernelpolicy, 1 policy", aware, POLICIES[:1]),
        ("kernelpolicy, 2 policies", aware, POLICIES[:2]),
        ("kernelpolicy, 4 policies", aware, POLICIES),
    ]
    results: list[Measurement] = []
    rates: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    for round_ in range(rounds):
        for label, model, policies in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:  # order rotates
            counted: list[int] = []
            managers: list[Any] = []
            scope = _without_kernelpolicy() if model is plain else contextlib.nullcontext()
            with scope:
                timer = Timer(
                    stmt="counted.append(work(manager, prompts, policies, new_tokens))",
                    setup="manager = start(model, new_tokens, managers)",  # not timed: the manager's thread starts
                    globals={
                        "counted": counted,
                        "work": _workload,
                        "start": _started,
                        "managers": managers,
                        "model": model,
                        "prompts": prompts,
                        "policies": policies,
                        "new_tokens": new_tokens,
                    },
                    label="continuous batching, submit to last result",
                    sub_label=label,
                    description=f"round {round_}",
                    num_threads=1,
                )
                measurement = timer.timeit(number=1)
            for manager in managers:
                manager.stop(block=True, timeout=60)
            results.append(measurement)
            rates[label].append(counted[-1] / measurement.median)
    print(Compare(results))  # Compare.print() is untyped in torch 2.9; its str() is the same table
    baseline = statistics.median(rates["transformers alone"])
    print(f"{'arm':<28} {'tokens/s':>10} {'ratio':>7}")
    for label, values in rates.items():
        rate = statistics.median(values)
        print(f"{label:<28} {rate:>10.1f} {rate / baseline:>7.3f}")
    return results


if __name__ == "__main__":
    main()

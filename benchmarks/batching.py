"""``python -m benchmarks.batching``: what mixing policies costs transformers' continuous batching (tokens/s).

The same requests (16 prompts of 4 to 12 tokens, 64 greedy new tokens each, a Llama with a local RMSNorm
kernel, one CPU thread) through a ``ContinuousBatchingManager``, for a tiny Llama (hidden 64, 2 layers) and a
medium one (hidden 512, 4 layers; ``--model``):

- ``transformers alone``: the model kernelized by ``kernels.kernelize``, a manager without kernelpolicy's seam;
- ``kernelpolicy, 1 policy``: the model kernelized by ``kernelpolicy.kernelize``, every request under ``prefer``;
- ``kernelpolicy, 1 policy, recorded``: the same inside ``record_calls()`` (what ``serve``'s ``/metrics`` does);
- ``kernelpolicy, 2 policies`` / ``4 policies``, ``select`` and ``split``: the requests spread over 2 or 4
  policies, submitted interleaved; every step serves them all, RMSNorm's rows joined by that method.

Each arm is one ``torch.utils.benchmark`` measurement of a run from the first request submitted to the last
result (the manager is started in the untimed setup and stopped after: its thread wakes every 0.1 s when idle,
which would add up to 0.1 s at random to a timed stop), the arms
interleaved over the rounds so a drift of the machine hits them all. Printed: torch's ``Compare`` table, then
tokens/s per arm (median over the rounds), its ratio to transformers alone and, for the mixed arms, to one
policy (each ratio the median of the rounds' ratios: a round's arms share its load). ``--compiled`` counts instead the graphs TorchDynamo compiles for a manager with
``default_compile_level=1`` while the mix changes from step to step (after its warm-up: 0 expected).
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
from kernelpolicy import batching
from kernelpolicy._forward._mixing import JOINS, ROWS
from kernelpolicy.testing import local_mapping, rms_norm_kernel_source, tiny_llama, write_kernel_repo

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kernelpolicy._forward._step import Join

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


def _workload(
    manager: Any,
    prompts: list[list[int]],
    policies: list[Any],
    new_tokens: int,
    *,
    paired: bool = False,
    wait: float = 60,
) -> int:
    """Submit every prompt (interleaving the policies; ``paired``: prompt i under policy i), wait for every
    result; the tokens generated."""
    for i, prompt in enumerate(prompts):
        with kernelpolicy.kernel_policy(policies[i] if paired else policies[i % len(policies)]):
            manager.add_request(prompt, max_new_tokens=new_tokens)
    tokens = finished = 0
    while finished < len(prompts):
        result = manager.get_result(timeout=wait)
        if result is None:
            raise RuntimeError(f"the batching manager returned no result for {wait} s")
        if result.is_finished():
            finished += 1
            tokens += len(result.generated_tokens)
    return tokens


MODELS = {"tiny": {}, "medium": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4}}


def _arms(plain: Any, aware: Any) -> list[tuple[str, Any, list[Any], Join, bool]]:
    """(label, model, policies, RMSNorm's join, recorded) of each arm."""
    arms: list[tuple[str, Any, list[Any], Join, bool]] = [
        ("transformers alone", plain, POLICIES[:1], "select", False),
        ("kernelpolicy, 1 policy", aware, POLICIES[:1], "select", False),
        ("kernelpolicy, 1 policy, recorded", aware, POLICIES[:1], "select", True),
    ]
    for count in (2, 4):
        for join in JOINS:
            arms.append((f"kernelpolicy, {count} policies, {join}", aware, POLICIES[:count], join, False))
    return arms


@contextlib.contextmanager
def _joined_by(join: Join, recorded: bool) -> Iterator[None]:
    """RMSNorm's rows joined by ``join`` (and the calls recorded) while inside."""
    saved = ROWS["RMSNorm"]
    ROWS["RMSNorm"] = saved._replace(join=join)
    try:
        with kernelpolicy.record_calls() if recorded else contextlib.nullcontext():
            yield
    finally:
        ROWS["RMSNorm"] = saved


def _models(size: str) -> tuple[Any, Any]:
    repo = write_kernel_repo(
        pathlib.Path(tempfile.mkdtemp()), rms_norm_kernel_source(can_torch_compile=True, offset=0.5)
    )
    plain, aware = tiny_llama(**MODELS[size]), tiny_llama(**MODELS[size])
    with local_mapping({"RMSNorm": repo}):
        kernels.kernelize(plain, mode=kernels.Mode.INFERENCE, device="cpu")
        kernelpolicy.kernelize(aware, mode="inference", device="cpu")
    return plain, aware


def main(rounds: int = 4, requests: int = 16, new_tokens: int = 64, size: str = "tiny") -> list[Measurement]:
    torch.set_num_threads(1)
    plain, aware = _models(size)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, 256, (int(n),), generator=generator).tolist()
        for n in torch.randint(4, 13, (requests,), generator=generator)
    ]
    arms = _arms(plain, aware)
    results: list[Measurement] = []
    rates: dict[str, list[float]] = {label: [] for label, *_ in arms}
    for round_ in range(rounds):
        for label, model, policies, join, recorded in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            counted: list[int] = []
            managers: list[Any] = []
            scope = _without_kernelpolicy() if model is plain else _joined_by(join, recorded)
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
                    label=f"continuous batching, submit to last result ({size} Llama)",
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
    # Ratios are medians of per-round ratios: the arms of one round run back to back, so a round's load is shared.
    baseline, one = rates["transformers alone"], rates["kernelpolicy, 1 policy"]
    print(f"{size} Llama: {'arm':<36} {'tokens/s':>10} {'ratio':>7} {'to 1 policy':>12}")
    for label, values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, baseline, strict=True))
        mixed = statistics.median(v / o for v, o in zip(values, one, strict=True))
        shown = f"{mixed:>12.3f}" if "policies" in label else ""
        print(f"{'':<13}{label:<36} {statistics.median(values):>10.1f} {ratio:>7.3f} {shown}")
    return results


def compiled(requests: int = 8, new_tokens: int = 8) -> dict[str, tuple[int, int]]:
    """Per arm, (graphs compiled by the warm-up, graphs compiled after it): the same requests under one policy,
    and under 2 policies whose mix changes from batch to batch (the first i requests under one, for each i)."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.set_num_threads(1)
    _, aware = _models("tiny")
    import transformers

    config = transformers.GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    counts: dict[str, tuple[int, int]] = {}
    for label, served in (("one policy", POLICIES[:1]), ("2 policies, the mix changing", POLICIES[:2])):
        torch._dynamo.reset()
        manager = aware.init_continuous_batching(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(
                num_blocks=256, max_batch_tokens=512, default_compile_level=1
            ),
        )
        batching.policy_aware(manager, policies=served[1:])
        before = counters["stats"]["unique_graphs"]
        manager.warmup()
        warm = counters["stats"]["unique_graphs"]
        manager.start()
        generator = torch.Generator().manual_seed(1)
        try:
            for split in range(requests + 1):  # the first `split` requests under one policy, the rest the other
                prompts = [torch.randint(1, 256, (6,), generator=generator).tolist() for _ in range(requests)]
                chosen = [served[int(i >= split) % len(served)] for i in range(requests)]
                _workload(manager, prompts, chosen, new_tokens, paired=True, wait=900)  # inductor compiles
        finally:
            manager.stop(block=True, timeout=60)
        counts[label] = (warm - before, counters["stats"]["unique_graphs"] - warm)
    for label, (warm_up, after) in counts.items():
        print(f"compiled (default_compile_level=1), {label}: {warm_up} graphs in the warm-up, {after} after it")
    return counts


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.batching", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compiled", action="store_true", help="count the compiles while the mix changes")
    options = parser.parse_args()
    if options.compiled:
        compiled()
    else:
        for name in MODELS if options.model == "both" else [options.model]:
            main(rounds=options.rounds, size=name)

"""Training under DDP and FSDP2 with the policy switched per step: 2 spawned gloo ranks on 127.0.0.1, bounded timeouts.

A real local kernel repository (Llama's RMSNorm plus an offset, with backward) is bound by
``kernelpolicy.kernelize(mode="training")``. Each step's path is read off ``record_calls()`` (eager) or off the
compiled graphs, and each rank's losses and the final parameters must equal a one-process reference without
kernels that adds the kernel's offset on the steps where the kernel is expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _helpers import run_ranks
from _parallel_workers import OFFSET, STEPS, WORLD, kernel_expected, reference, train_worker

from kernelpolicy.testing import free_port, rms_norm_kernel_source, write_kernel_repo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

#: What record_calls() counts per eager step: the model's two RMSNorm layers, on the expected path.
EAGER_CALLS = [{"RMSNorm": {"kernel" if kernel_expected(policy) else "original": 2}} for policy in STEPS]


def _run(tmp_path: Path, case: str) -> list[dict[str, Any]]:
    repo = write_kernel_repo(tmp_path / "repo", rms_norm_kernel_source(can_torch_compile=True, offset=OFFSET))
    run_ranks(train_worker, WORLD, free_port(), str(tmp_path), case, str(repo), nprocs=WORLD, deadline_s=150)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _assert_matches_reference(results: list[dict[str, Any]]) -> None:
    expected = reference()
    for rank, result in enumerate(results):
        assert [step["policy"] for step in result["steps"]] == list(STEPS)
        assert [step["predicted"] for step in result["steps"]] == [kernel_expected(policy) for policy in STEPS]
        losses = torch.tensor([step["loss"] for step in result["steps"]])
        torch.testing.assert_close(losses, torch.tensor([row[rank] for row in expected["losses"]]))
        # a step on the other path would be far off: the kernel's offset moves every loss
        other = torch.tensor([row[rank] for row in expected["other_path"]])
        assert ((losses - other).abs() > 1e-2).all(), (losses, other)
        assert result["params"].keys() == expected["params"].keys()
        for name, values in result["params"].items():
            torch.testing.assert_close(torch.tensor(values), torch.tensor(expected["params"][name]), msg=name)


def _assert_compiled_once_per_path(result: dict[str, Any]) -> None:
    """Two programs, each as many graphs as without kernels, compiled once: the kernel's (step 1), the original's (step 2)."""
    graphs = result["graphs"]  # kernel-offset nodes of each graph the backend received, in order
    per_program = result["baseline_graphs"]
    assert per_program >= 1 and len(graphs) == 2 * per_program, graphs  # steps 3 and 4 reuse them
    assert sum(graphs[:per_program]) == 2, graphs  # both RMSNorm kernels, traced once
    assert sum(graphs[per_program:]) == 0, graphs
    breaks, baseline = set(result["graph_breaks"]), set(result["baseline_graph_breaks"])
    # no break of kernelpolicy's own: a policy-aware module's __call__ is skipped as a Dynamo frame, as
    # nn.Module.__call__ is (else FSDP2's torch._dynamo.disable'd pre-forward hook would break there)
    assert breaks == baseline, breaks ^ baseline


def test_ddp_eager_follows_the_policy_of_each_step(tmp_path: Path) -> None:
    results = _run(tmp_path, "ddp")
    for result in results:
        assert [step["calls"] for step in result["steps"]] == EAGER_CALLS
        assert not result["norm_is_fsdp_module"]
    _assert_matches_reference(results)


def test_ddp_compiled_follows_the_policy_of_each_step(tmp_path: Path) -> None:
    results = _run(tmp_path, "ddp-compiled")
    for result in results:
        assert [step["calls"] for step in result["steps"]] == [{}] * len(STEPS)  # compiled graphs run no Python
        _assert_compiled_once_per_path(result)
    _assert_matches_reference(results)


@pytest.mark.parametrize("order", ["kernelize-first", "kernelize-after"])
def test_fsdp2_eager_follows_the_policy_of_each_step(tmp_path: Path, order: str) -> None:
    results = _run(tmp_path, f"fsdp-{order}")
    for result in results:
        assert [step["calls"] for step in result["steps"]] == EAGER_CALLS
        assert result["norm_is_fsdp_module"], result["norm_mro"]
    _assert_matches_reference(results)


@pytest.mark.parametrize("order", ["kernelize-first", "kernelize-after"])
def test_fsdp2_compiled_follows_the_policy_of_each_step(tmp_path: Path, order: str) -> None:
    results = _run(tmp_path, f"fsdp-{order}-compiled")
    for result in results:
        assert [step["calls"] for step in result["steps"]] == [{}] * len(STEPS)
        assert result["norm_is_fsdp_module"], result["norm_mro"]
        _assert_compiled_once_per_path(result)
    _assert_matches_reference(results)

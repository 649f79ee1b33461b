"""``kernelpolicy.distributed`` on real gloo process groups: 2 ranks on 127.0.0.1, spawned, bounded timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from _helpers import run_ranks
from _workers import distributed_worker

import kernelpolicy.distributed
from kernelpolicy.testing import free_port, rms_norm_kernel_source, write_kernel_repo

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _run(tmp_path: Path, case: str) -> list[str]:
    repo = write_kernel_repo(tmp_path / "repo", rms_norm_kernel_source(can_torch_compile=True, offset=1.0))
    run_ranks(distributed_worker, 2, free_port(), str(tmp_path), case, str(repo))
    return [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.slow  # spawns 2 ranks
def test_same_policy_and_paths_pass_on_every_rank(tmp_path: Path) -> None:
    assert _run(tmp_path, "same") == ["ok prefer,RMSNorm=disable"] * 2


@pytest.mark.slow  # spawns 2 ranks
def test_different_policies_raise_on_every_rank_naming_them(tmp_path: Path) -> None:
    outcomes = _run(tmp_path, "policies differ")
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith(f"mismatch kernel policy check across 2 ranks failed on rank {rank}: ")
        assert "policies differ: rank 0: 'require', rank 1: 'disable'" in outcome
        assert "layer 'norm': rank 0: kernel (kernel usable), rank 1: original (disabled by policy)" in outcome


@pytest.mark.slow  # spawns 2 ranks
def test_a_kernel_missing_on_one_rank_shows_before_the_first_step(tmp_path: Path) -> None:
    outcomes = _run(tmp_path, "kernel missing on rank 1")
    for outcome in outcomes:
        assert "policies differ" not in outcome
        assert "layer 'norm': rank 0: kernel (kernel usable), rank 1: original (no kernel bound)" in outcome


@pytest.mark.slow  # spawns 2 ranks
def test_ranks_on_the_same_paths_pass_whatever_their_reasons_say(tmp_path: Path) -> None:
    # rank 1's kernel failed once (fallback_on); both take the kernel: its reason names the failure and 'GPU 0'
    assert _run(tmp_path, "failure recovered on rank 1") == ["ok prefer,fallback_on=RuntimeError"] * 2


def test_without_a_process_group_it_says_what_is_missing() -> None:
    for call in (kernelpolicy.distributed.check_consistent, kernelpolicy.distributed.broadcast_policy):
        with pytest.raises(RuntimeError, match=rf"distributed\.{call.__name__} needs an initialised torch.distributed"):
            call()


@pytest.mark.slow  # spawns 2 ranks
def test_broadcast_policy_applies_the_source_ranks_policy_on_every_rank(tmp_path: Path) -> None:
    # rank 0 under require, rank 1 under disable,RMSNorm=prefer; both adopt rank 1's, then agree
    assert _run(tmp_path, "broadcast") == ["ok disable,RMSNorm=prefer"] * 2

"""Exported programs per policy, saved in this process and loaded in another (``kernelpolicy.artifacts``).

A DemoModel kernelized with a traceable local RMSNorm kernel that adds 100: an exported program keeps the
path of its export's policy, which its output shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _helpers import kernel_ran

import kernelpolicy as kp
from kernelpolicy.artifacts import MANIFEST, NoProgramError, export_per_policy, load_per_policy
from kernelpolicy.testing import DemoModel

X = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))

LOADER = """
import json, sys, torch
import kernelpolicy
from kernelpolicy.artifacts import NoProgramError, load_per_policy

x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
single = torch.export.load(sys.argv[1] + "/program-0.pt2").module()  # one program, exported under prefer
programs = load_per_policy(sys.argv[1])
seen = {}
for text in ("prefer", "disable", "prefer,RMSNorm=disable", "require"):
    with kernelpolicy.kernel_policy(kernelpolicy.Policy.parse(text)):
        try:
            seen[text] = round(programs(x).mean().item(), 3)
        except NoProgramError as error:
            seen[text] = str(error)
        seen["single " + text] = round(single(x).mean().item(), 3)
print(json.dumps(seen))
"""


@pytest.fixture
def model(kernelized: Callable[..., DemoModel]) -> DemoModel:
    return kernelized("traceable")


def test_programs_per_policy_survive_another_process(model: DemoModel, tmp_path: Path) -> None:
    with kp.kernel_policy("prefer"):
        kernel = model(X).mean().item()
    with kp.kernels_disabled():
        original = model(X).mean().item()
    programs = export_per_policy(
        model, (X,), policies=["prefer", "disable", "prefer,RMSNorm=disable", "disable"], directory=tmp_path
    )
    assert [str(p) for p in programs.policies] == ["prefer", "disable", "prefer,RMSNorm=disable"]  # once each
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [entry["policy"] for entry in manifest["programs"]] == ["prefer", "disable", "prefer,RMSNorm=disable"]

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOADER), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["prefer"] == pytest.approx(kernel, abs=1e-3) and kernel > 50
    assert seen["disable"] == pytest.approx(original, abs=1e-3) == seen["prefer,RMSNorm=disable"]
    assert seen["require"].startswith("kernelpolicy: no exported program for the policy in effect 'require'")
    assert "'prefer', 'disable', 'prefer,RMSNorm=disable'" in seen["require"]
    # the control: one program loaded alone runs its export's path under every policy, without a word
    assert {seen[f"single {text}"] for text in ("prefer", "disable", "require")} == {seen["prefer"]}


def test_in_process_programs_dispatch_and_refuse(model: DemoModel) -> None:
    programs = export_per_policy(model, (X,), policies=[kp.Policy("prefer"), "disable"])
    assert kernel_ran(programs(X))
    with kp.kernels_disabled():
        assert not kernel_ran(programs(X))
    with kp.kernel_policy(RMSNorm="require"), pytest.raises(NoProgramError, match="'prefer,RMSNorm=require'"):
        programs(X)


def test_loading_a_folder_without_a_manifest_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no kernelpolicy-programs\.json; save programs with"):
        load_per_policy(tmp_path)

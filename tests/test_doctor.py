"""``python -m kernelpolicy doctor``: the canary of the private torch names and of the compile mechanism."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernelpolicy._tell._doctor import _persistence, doctor


def test_doctor_passes_on_this_torch() -> None:
    report = doctor()
    assert report.ok, str(report)
    assert report.versions["torch"] == torch.__version__
    text = str(report)  # the verdict for users
    assert "all checks passed" in text and "mechanism:" not in text and "private names" not in text
    assert "transformers: hub kernels on (transformers" in text
    assert "mechanism:" in report.verbose() and "private names read:" in report.verbose()


def test_doctor_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kernelpolicy", "doctor"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok] follows the policy of each call" in done.stdout and "private names" not in done.stdout
    verbose = subprocess.run(
        [sys.executable, "-m", "kernelpolicy", "doctor", "--verbose"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert verbose.returncode == 0 and "private names read:" in verbose.stdout


def test_doctor_says_when_transformers_runs_no_hub_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.23 and later gate their integration to kernels releases not supported here.

    Such a pair cannot be installed beside the tested one, so its gate is stood in for: a function with
    transformers' own signature that answers no.
    """
    from transformers.utils import import_utils

    from kernelpolicy._tell._doctor import _transformers_integration

    def is_kernels_available(MIN_VERSION: str = "0.18.0", MAX_VERSION: str = "0.19.0") -> bool:  # noqa: N803
        return False

    monkeypatch.setattr(import_utils, "is_kernels_available", is_kernels_available)
    line = _transformers_integration()
    assert line.startswith("hub kernels OFF: transformers ") and "only with kernels >= 0.18.0, < 0.19.0" in line
    assert "use_kernels=True silently does nothing" in line


def test_doctor_reports_caching_precompile_and_the_graph_caches() -> None:
    import torch._dynamo.config

    check = next(c for c in doctor().checks if c[0] == "persisted compile artifacts follow the policy or refuse it")
    assert check[1] and check[2].startswith("caching precompile off; ")
    if not hasattr(torch._dynamo.config, "caching_precompile"):
        pytest.skip(f"torch {torch.__version__} has no caching precompile")
    # torch's own patch: pytest's monkeypatch deletes a config entry on undo (a ConfigModule is no plain module).
    # The check alone: compiling with caching precompile on fails on torch 2.9 before any policy is asked.
    with torch._dynamo.config.patch(caching_precompile=True):
        detail = _persistence()
    assert "caching precompile is ON" in detail and "ArtifactPolicyError" in detail
    assert torch._dynamo.config.caching_precompile is False  # restored

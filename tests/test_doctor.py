"""``python -m kernelpolicy doctor``: the canary of the private torch names and of the compile mechanism."""

from __future__ import annotations

import subprocess
import sys

import torch

from kernelpolicy._doctor import doctor


def test_doctor_passes_on_this_torch() -> None:
    report = doctor()
    assert report.ok, str(report)
    assert report.versions["torch"] == torch.__version__
    text = str(report)
    assert "mechanism:" in text and "all checks passed" in text


def test_doctor_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kernelpolicy", "doctor"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok] follows the policy of each call" in done.stdout

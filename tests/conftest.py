"""Shared fixtures: a clean policy state around every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kernelpolicy
from kernelpolicy._attach import _autoattach
from kernelpolicy._context import _active
from kernelpolicy._values import _policy
from kernelpolicy.testing import DemoModel, local_mapping, rms_norm_kernel_source, write_kernel_repo


@pytest.fixture(autouse=True)
def _clean_policy_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no KERNELPOLICY, no explicit default, no active scope and no auto_attach."""
    monkeypatch.delenv(_policy.ENV_VAR, raising=False)
    monkeypatch.setattr(_autoattach, "_AUTO", False)
    _active.DEFAULTS.explicit = None
    _active.reload_env()
    before = _active._SCOPED.get(None)
    yield
    assert _active._SCOPED.get(None) is before, "a test leaked a policy scope"
    _active.DEFAULTS.explicit = None
    _active.reload_env()


# --- real local kernel repositories and kernelized models --------------------------------------

REPO_SPECS: dict[str, dict[str, object]] = {
    # bit-identical to the original forward, not traceable
    "exact": {},
    # traceable kernel that adds 100: its presence is visible in any output, compiled or not
    "traceable": {"can_torch_compile": True, "offset": 100.0},
    "untraceable": {"can_torch_compile": False, "offset": 100.0},
    "no_backward": {"can_torch_compile": True, "has_backward": False, "offset": 100.0},
    # traceable, adds 0.5: changes a tiny Llama's generated tokens without making them degenerate
    "half": {"can_torch_compile": True, "offset": 0.5},
}


@pytest.fixture(scope="session")
def kernel_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kernel-repos")
    return {
        name: write_kernel_repo(root / name, rms_norm_kernel_source(**spec))  # type: ignore[arg-type]
        for name, spec in REPO_SPECS.items()
    }


@pytest.fixture
def mapping(kernel_repos: dict[str, Path]) -> Callable[[str], Any]:
    """``mapping(kind)``: a ``kernels.use_kernel_mapping`` context for one of the repos."""

    def make(kind: str) -> Any:
        return local_mapping({"RMSNorm": kernel_repos[kind]})

    return make


@pytest.fixture
def kernelized(mapping: Callable[[str], Any]) -> Callable[..., DemoModel]:
    """``kernelized(kind, hidden=16)``: a DemoModel kernelized by kernelpolicy with that repo."""

    def make(kind: str, hidden: int = 16, mode: str = "inference") -> DemoModel:
        torch.manual_seed(0)
        model = DemoModel(hidden).eval()
        with mapping(kind):
            kernelpolicy.kernelize(model, mode=mode, device="cpu")
        return model

    return make


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """TorchDynamo's caches and counters reset before and after the test (``usefixtures("fresh_dynamo")``)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()

"""Models kernelized outside kernelpolicy: ``auto_attach()``, and the one warning when a policy misses them.

Real ``kernels.kernelize`` and transformers' ``use_kernels`` / ``from_pretrained(use_kernels=True)`` on real
local kernel repositories (the test kernel adds 100 to its output, so the path shows in every output).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kernels
import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._attach import _autoattach
from kernelpolicy._attach._aware import binding_of
from kernelpolicy._context import _active
from kernelpolicy._forward import _watch
from kernelpolicy.testing import DemoModel, RMSNorm, kernel_calls, tiny_llama

X = torch.ones(2, 16)
FIX = "kernelpolicy.attach(model) once the model is kernelized, or kernelpolicy.auto_attach() once"


def plain(mapping: Callable[[str], Any], kind: str = "traceable") -> DemoModel:
    """A DemoModel (3 RMSNorm layers) kernelized by kernels alone."""
    model = DemoModel(16).eval()
    with mapping(kind):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    return model


@pytest.fixture
def unwarned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The once-per-process warning not given yet, and its check listed (restored after the test)."""
    monkeypatch.setattr(_autoattach, "_WARNED", False)
    _autoattach._UNATTACHED.clear()  # modules of earlier tests, not collected yet
    checks = list(_active.POLICY_CHECKS)
    if _autoattach._check not in _active.POLICY_CHECKS:
        _active.POLICY_CHECKS.append(_autoattach._check)
    yield
    _active.POLICY_CHECKS[:] = checks


def ours(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in records if "does not reach" in str(w.message)]


# --- the warning --------------------------------------------------------------------------------


@pytest.mark.usefixtures("unwarned")
def test_a_policy_that_misses_plain_kernelized_modules_warns_once_at_the_users_line(
    mapping: Callable[[str], Any],
) -> None:
    model = plain(mapping)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with kp.kernel_policy("prefer"), kp.kernel_policy(SiLU="disable"):  # asks nothing of RMSNorm
            pass
        assert ours(records) == []
        with kp.kernels_disabled():
            assert model(X).mean().item() > 50  # the kernel still runs: that is what the warning says
        with kp.kernels_disabled():
            pass
    [message] = ours(records)
    assert message == (
        "the kernel policy 'disable' does not reach 3 modules that kernels bound outside kernelpolicy: "
        "3 RMSNorm (kernel layer 'RMSNorm', runs its kernel). They take the path kernels bound whatever the "
        f"policy says. Make them policy-aware: {FIX}, before models are kernelized (kernels.kernelize, "
        "transformers' use_kernels=True). This warning is given once per process."
    )
    [record] = [w for w in records if "does not reach" in str(w.message)]
    assert record.filename == __file__
    assert _autoattach._check not in _active.POLICY_CHECKS  # said once: scope entries pay nothing more


@pytest.mark.usefixtures("unwarned")
def test_attached_models_and_unasked_layers_do_not_warn(mapping: Callable[[str], Any]) -> None:
    model = plain(mapping)
    kp.attach(model)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with kp.kernel_policy("require"), kp.kernels_disabled():
            assert model(X).mean().item() < 50
    assert ours(records) == []
    # no unattached module left: the check takes itself off the scope entry until kernels binds one
    assert _autoattach._check not in _active.POLICY_CHECKS
    plain(mapping)
    assert _autoattach._check in _active.POLICY_CHECKS


@pytest.mark.usefixtures("unwarned")
def test_require_warns_for_a_module_kernels_left_without_a_kernel(mapping: Callable[[str], Any]) -> None:
    model = DemoModel(16).eval()
    with mapping("traceable"):
        kernels.kernelize(model.norm, mode=kernels.Mode.INFERENCE, device="cpu")  # one layer, kernel bound
    kernels.kernelize(model.blocks, mode=kernels.Mode.INFERENCE, device="cpu", use_fallback=True)  # no mapping
    with pytest.warns(UserWarning, match="does not reach") as records:
        kp.set_default_policy("require")
    [message] = ours(list(records))
    assert (
        "1 RMSNorm (kernel layer 'RMSNorm', runs its kernel), 2 RMSNorm (kernel layer 'RMSNorm', no kernel)" in message
    )
    assert kp.current_policy() == kp.Policy("require")  # a warning, not a refusal


@pytest.mark.usefixtures("unwarned")
def test_kernelizing_under_a_policy_that_misses_the_module_warns_there(mapping: Callable[[str], Any]) -> None:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with kp.kernels_disabled():
            plain(mapping)  # the line inside plain() that calls kernels.kernelize
    [record] = [w for w in records if "does not reach" in str(w.message)]
    assert (
        record.filename == __file__
        and "kernels.kernelize(model" in Path(__file__).read_text().splitlines()[record.lineno - 1]
    )


@pytest.mark.usefixtures("unwarned")
def test_kernelpolicy_kernelize_under_a_scope_does_not_warn(mapping: Callable[[str], Any]) -> None:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with kp.kernels_disabled(), mapping("traceable"):
            model = kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
            assert model(X).mean().item() < 50
    assert ours(records) == []


@pytest.mark.usefixtures("unwarned")
def test_transformers_use_kernels_without_attach_warns(mapping: Callable[[str], Any]) -> None:
    pytest.importorskip("transformers")
    model = tiny_llama()
    with mapping("exact"):
        model.use_kernels = True  # transformers' own kernelize
    with pytest.warns(UserWarning, match="does not reach") as records, kp.kernel_policy(RMSNorm="disable"):
        pass
    [message] = ours(list(records))
    assert message.startswith(
        "the kernel policy 'prefer,RMSNorm=disable' does not reach 5 modules that kernels bound outside "
        "kernelpolicy: 5 LlamaRMSNorm (kernel layer 'RMSNorm', runs its kernel)."
    )


SCRIPT = """
import warnings, kernels, torch
import kernelpolicy  # as a user's script does; nothing else of kernelpolicy before the scope
from kernelpolicy.testing import DemoModel, local_mapping
model = DemoModel(16).eval()
with local_mapping({{"RMSNorm": {repo!r}}}):
    kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
with warnings.catch_warnings(record=True) as records:
    warnings.simplefilter("always")
    with kernelpolicy.kernels_disabled():
        out = model(torch.ones(2, 16))
print([str(w.message)[:60] for w in records])
"""


def test_modules_bound_before_kernelpolicy_looked_are_found(kernel_repos: dict[str, Path]) -> None:
    """In a fresh process kernels binds before the hook exists: the first policy that asks finds them."""
    script = textwrap.dedent(SCRIPT.format(repo=str(kernel_repos["traceable"])))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(["the kernel policy 'disable' does not reach 3 modules that ke"])


# --- auto_attach -------------------------------------------------------------------------------


def test_auto_attach_makes_plain_kernelize_policy_aware_with_names(mapping: Callable[[str], Any]) -> None:
    assert kp.auto_attach() is False
    model = plain(mapping)
    binding = binding_of(model.blocks[0][1])
    assert binding is not None and binding.module_name == "blocks.0.1" and binding.kernel is not None
    assert model(X).mean().item() > 50
    with kp.kernels_disabled():
        assert model(X).mean().item() < 50
    unkernelized = plain(mapping, "exact")
    kernels.kernelize(unkernelized, mode=kernels.Mode.INFERENCE, device="cpu")  # outside the mapping: no kernel
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match=r"module 'blocks\.0\.1'"):
        unkernelized(X)
    assert kp.auto_attach(False) is True
    assert binding_of(plain(mapping).norm) is None  # stopped: later bindings stay kernels' own


def test_auto_attach_covers_modules_kernels_bound_before(mapping: Callable[[str], Any]) -> None:
    model = plain(mapping)
    assert binding_of(model.norm) is None
    kp.auto_attach()
    binding = binding_of(model.norm)
    assert binding is not None and binding.kernel is not None and binding.module_name is None  # found, unnamed
    with kp.kernels_disabled():
        assert model(X).mean().item() < 50


def test_auto_attach_and_kernelpolicy_kernelize_together(mapping: Callable[[str], Any]) -> None:
    kp.auto_attach()
    with mapping("traceable"):
        model = kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
    assert all(binding_of(m) is not None for m in model.modules() if isinstance(m, RMSNorm))
    assert [row.name for row in kp.explain(model)] == ["blocks.0.1", "blocks.1.1", "norm"]
    # (tests/test_attention.py: the attention fallback kernelpolicy.kernelize names is the one attached)


def test_auto_attach_takes_a_bool() -> None:
    with pytest.raises(TypeError, match=r"auto_attach\(enabled\) takes True or False, got 'on'"):
        kp.auto_attach("on")  # type: ignore[arg-type]


def test_auto_attach_reaches_transformers_from_pretrained(mapping: Callable[[str], Any], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tiny_llama().save_pretrained(tmp_path)
    kp.auto_attach()
    with mapping("exact"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True).eval()
        binding = binding_of(model.model.norm)
        assert binding is not None and binding.kernel is not None and binding.module_name == "model.norm"
        ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
        before = kernel_calls(model)
        model(ids)
        assert kernel_calls(model) - before == 5
        with kp.kernels_disabled():
            model(ids)
        assert kernel_calls(model) - before == 5
        model.train()  # transformers kernelizes again: still policy-aware
        model.eval()
        assert binding_of(model.model.norm) is not None


def test_each_watch_callback_runs_once_per_binding() -> None:
    """``_autoattach`` registers its callback on kernels' binding once (it was twice: every binding ran it twice)."""
    assert _watch.ON_BIND.count(_autoattach._on_bind) == 1, _watch.ON_BIND
    assert len({id(callback) for callback in _watch.ON_BIND}) == len(_watch.ON_BIND), _watch.ON_BIND

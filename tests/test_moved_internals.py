"""A private name of kernels or transformers that moves: each feature falls back or says so once, never silently.

Each test hides one entry of ``_compat.INTERNALS`` (its names replaced by a location that does not exist, as a
release that moved it would look) and runs the features that read it on real kernelized models, with real
local kernel repositories (the test kernel adds 100: the path shows in every output). Also: a kernels
release newer than the tested range, simulated.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import kernels
import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._attach import _autoattach
from kernelpolicy._attach._aware import binding_of
from kernelpolicy._compat import _compat, _versions
from kernelpolicy._compat._compat import Internal
from kernelpolicy._context import _active
from kernelpolicy._forward import _watch
from kernelpolicy.testing import DemoModel

X = torch.ones(2, 16)
DOCTOR = "Run `python -m kernelpolicy doctor` for what moved."


def hide(monkeypatch: pytest.MonkeyPatch, attribute: str) -> Internal:
    """Hide ``_compat.<attribute>``: its names point nowhere, as after a release that moved it."""
    internal: Internal = getattr(_compat, attribute)
    moved = dataclasses.replace(internal, names=tuple(name.replace(".", ".kp_moved_", 1) for name in internal.names))
    monkeypatch.setattr(_compat, attribute, moved)
    monkeypatch.setattr(_compat, "_told", set())
    return moved


@pytest.fixture
def unwatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """kernels' binding function as kernels has it (no watch), and the watch not tried yet."""
    owner_name, _, attribute = str(_compat.first_present(_compat.KERNELS_BIND)).rpartition(".")
    owner = sys.modules[owner_name]
    bind = getattr(owner, attribute)
    monkeypatch.setattr(owner, attribute, getattr(bind, "__wrapped__", bind))
    monkeypatch.setattr(_watch, "_WATCHING", None)
    monkeypatch.setattr(_autoattach, "_LOOKED", False)
    monkeypatch.setattr(_autoattach, "_WARNED", False)
    _autoattach._UNATTACHED.clear()
    checks = list(_active.POLICY_CHECKS)
    if _autoattach._check not in _active.POLICY_CHECKS:
        _active.POLICY_CHECKS.append(_autoattach._check)
    yield
    _active.POLICY_CHECKS[:] = checks
    monkeypatch.undo()  # kernels' own function back before the watch is tried again
    _watch._WATCHING = None
    _watch.watch()


def plain(mapping: Callable[[str], Any], kind: str = "traceable") -> DemoModel:
    """A DemoModel (3 RMSNorm layers) kernelized by kernels alone."""
    model = DemoModel(16).eval()
    with mapping(kind):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    return model


def told(records: list[warnings.WarningMessage], internal: Internal) -> list[str]:
    return [str(w.message) for w in records if internal.names[0] in str(w.message)]


def test_every_kernels_and_transformers_entry_is_hidden_by_a_test_here() -> None:
    # BATCHING_MANAGER: the class whose __init__ is wrapped, looked up once; BATCHING (a tuple) is hidden below
    hidden = {
        "KERNELS_BIND",
        "KERNELS_LAYER_CACHE",
        "TRANSFORMERS_LAZY_KERNELS",
        "TRANSFORMERS_LAZY_REPOS",
        "BATCHING_MANAGER",
        "SERVING_BUILD",
        "SERVING_SEND",
        "SERVING_ENGINE",
        "SERVING_GENERATE",
        "SERVING_CB_GENERATE",
        "SERVING_API",
    }
    entries = {
        name
        for name, value in vars(_compat).items()
        if isinstance(value, Internal) and value.names[0].startswith(("kernels", "transformers"))
    }
    assert entries == hidden


@pytest.mark.usefixtures("unwatched")
def test_without_kernels_binding_function_auto_attach_says_so_once_and_attaches_what_is_bound(
    monkeypatch: pytest.MonkeyPatch, mapping: Callable[[str], Any]
) -> None:
    moved = hide(monkeypatch, "KERNELS_BIND")
    before = plain(mapping)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        previous = kp.auto_attach()  # no ModuleNotFoundError, no RuntimeError
        kp.auto_attach()
    try:
        [message] = told(records, moved)
        assert "kernelpolicy sees kernels bind a layer" in message and message.endswith(DOCTOR)
        assert "auto_attach makes policy-aware only the modules bound before it is called" in message
        assert [w.filename for w in records if moved.names[0] in str(w.message)] == [__file__]
        # what kernels bound before is policy-aware: the policy reaches it
        assert all(binding_of(m) is not None for m in (before.norm, before.blocks[0][1]))
        with kp.kernels_disabled():
            assert before(X).mean().item() < 50
        assert before(X).mean().item() > 50
    finally:
        kp.auto_attach(previous)


@pytest.mark.usefixtures("unwatched")
def test_without_kernels_binding_function_a_policy_that_misses_modules_still_warns(
    monkeypatch: pytest.MonkeyPatch, mapping: Callable[[str], Any]
) -> None:
    moved = hide(monkeypatch, "KERNELS_BIND")
    model = plain(mapping)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with kp.kernels_disabled():
            assert model(X).mean().item() > 50  # unattached: kernels' path, as the warning says
    assert len(told(records, moved)) == 1
    [missed] = [str(w.message) for w in records if "does not reach" in str(w.message)]
    assert "3 RMSNorm (kernel layer 'RMSNorm', runs its kernel)" in missed


@pytest.mark.usefixtures("unwatched")
def test_without_kernels_binding_function_a_removed_forward_is_noticed_by_explain_and_kernelize(
    monkeypatch: pytest.MonkeyPatch, mapping: Callable[[str], Any]
) -> None:
    hide(monkeypatch, "KERNELS_BIND")
    with mapping("traceable"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
        other = kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
    assert model(X).mean().item() > 50 and other(X).mean().item() > 50
    with mapping("no_backward"):  # training: no kernel with backward, so kernels falls back on every layer
        kp.kernelize(model, mode="training", device="cpu")  # kernelpolicy's: takes in what kernels did
        kernels.kernelize(other, mode=kernels.Mode.TRAINING, device="cpu")  # kernels' alone: explain notices
    for kernelized in (model, other):
        rows = {row.name: row for row in kp.explain(kernelized).rows}
        assert rows["norm"].kernel is None and rows["norm"].path == "original"
        with pytest.raises(kp.KernelUnavailableError, match="no kernel bound"), kp.kernel_policy("require"):
            kernelized(X)
        assert kernelized(X).mean().item() < 50


def test_without_kernels_layer_cache_explain_still_names_what_it_can(
    monkeypatch: pytest.MonkeyPatch, kernel_repos: dict[str, Any], mapping: Callable[[str], Any]
) -> None:
    moved = hide(monkeypatch, "KERNELS_LAYER_CACHE")
    with mapping("traceable"):
        model = kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        table = str(kp.explain(model))
        str(kp.explain(model))
    if hasattr(kernels, "get_kernelized_layers"):  # kernels >= 0.19 (and 0.18.3): the public way, no warning
        assert str(kernel_repos["traceable"]) in table
        assert told(records, moved) == []
    else:
        assert "RMSNorm" in table  # the kernel class, without its repository
        [message] = told(records, moved)
        assert "explain shows the kernel class without its repository" in message
    with kp.kernels_disabled():
        assert model(X).mean().item() < 50


@pytest.mark.parametrize("attribute", ["TRANSFORMERS_LAZY_KERNELS", "TRANSFORMERS_LAZY_REPOS"])
def test_without_transformers_lazy_kernel_tables_explain_says_so_once(
    monkeypatch: pytest.MonkeyPatch, attribute: str
) -> None:
    pytest.importorskip("transformers")
    from kernelpolicy.testing import tiny_llama

    moved = hide(monkeypatch, attribute)
    model = kp.attach(tiny_llama())
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        kp.explain(model)
        kp.explain(model)
    [message] = told(records, moved)
    assert str(moved.fallback) in message and message.endswith(DOCTOR)


@pytest.mark.usefixtures("unwatched")
def test_a_kernels_newer_than_tested_warns_once_and_every_feature_still_runs(
    monkeypatch: pytest.MonkeyPatch, mapping: Callable[[str], Any]
) -> None:
    """Simulated: kernels 0.20.0 with its binding function moved again."""
    monkeypatch.setattr(_versions.metadata, "version", lambda package: "0.20.0")
    monkeypatch.setattr(_versions, "_warned", set())
    _versions.kernels.cache_clear()
    monkeypatch.setattr(_versions, "kernels", _versions.kernels)  # cleared again on undo
    moved = hide(monkeypatch, "KERNELS_BIND")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with mapping("traceable"):
            model = kp.kernelize(DemoModel(16).eval(), mode="inference", device="cpu")
        previous = kp.auto_attach()
        kp.auto_attach(previous)
    messages = [str(w.message) for w in records]
    assert sum("tested with kernels>=0.16,<0.20; installed: kernels 0.20.0" in m for m in messages) == 1
    assert len(told(records, moved)) == 1
    assert model(X).mean().item() > 50
    with kp.kernels_disabled():
        assert model(X).mean().item() < 50
    _versions.kernels.cache_clear()


# --- torch's trace-state readers, chosen at import: each hidden in a process of its own --------------

HIDE_AND_RUN = """
import dataclasses, pathlib, sys, tempfile, warnings

import torch

from kernelpolicy._compat import _compat

entry = sys.argv[1]
internal = getattr(_compat, entry)
moved = dataclasses.replace(internal, names=tuple(n.replace(".", ".kp_moved_", 1) for n in internal.names))
setattr(_compat, entry, moved)
_compat.INTERNALS = tuple(moved if found is internal else found for found in _compat.INTERNALS)

import kernelpolicy as kp
from kernelpolicy._context import _state
from kernelpolicy._tell import _doctor
from kernelpolicy.testing import DemoModel, kernelize_locally, rms_norm_kernel_source, write_kernel_repo

root = pathlib.Path(tempfile.mkdtemp())
x = torch.ones(2, 16)
traceable = kernelize_locally(
    DemoModel(16).eval(), {"RMSNorm": write_kernel_repo(root / "t", rms_norm_kernel_source(can_torch_compile=True, offset=100.0))}
)
untraceable = kernelize_locally(
    DemoModel(16).eval(), {"RMSNorm": write_kernel_repo(root / "u", rms_norm_kernel_source(can_torch_compile=False, offset=100.0))}
)
seen = {}
seen["eager"] = (traceable(x).mean().item() > 50, kp.kernels_disabled()(traceable)(x).mean().item() > 50)
compiled = torch.compile(traceable, backend="eager", fullgraph=True)
seen["compile"] = (compiled(x).mean().item() > 50, kp.kernels_disabled()(compiled)(x).mean().item() > 50)
seen["fx"] = torch.fx.symbolic_trace(untraceable)(x).mean().item() > 50
seen["export"] = torch.export.export(untraceable, (x,)).module()(x).mean().item() > 50
try:
    with kp.kernel_policy("verify"):
        seen["vmap"] = torch.func.vmap(traceable)(x.unsqueeze(1)).mean().item() > 50
except RuntimeError as error:  # the documented fallback without the functorch stack: verify compares, vmap refuses
    assert entry == "FUNCTORCH_STACK" and "vmap" in str(error), error
    seen["vmap"] = True
missing = [  # transformers' seams come and go with its releases: not this test's
    str(found) for found in _compat.probe() if not found.present and not found.internal.names[0].startswith("transformers.")
]
print(seen)
print(missing)
assert seen == {"eager": (True, False), "compile": (True, False), "fx": False, "export": False, "vmap": True}, seen
assert len(missing) == 1 and "MISSING " + moved.names[0] in missing[0] and "falls back to" in missing[0], missing
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["COMPILING_FLAG", "EXPORTING_FLAG", "FX_TRACING", "FUNCTORCH_STACK"])
def test_a_hidden_torch_reader_falls_back_and_every_tracer_still_takes_its_path(entry: str, tmp_path: Any) -> None:
    import subprocess

    script = tmp_path / "hide.py"
    script.write_text(HIDE_AND_RUN)
    done = subprocess.run(
        [sys.executable, str(script), entry], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@pytest.mark.parametrize("index", range(len(_compat.BATCHING)))
def test_without_a_seam_of_continuous_batching_managers_stay_as_made_and_the_user_is_told(
    monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    pytest.importorskip("transformers")
    from kernelpolicy import batching
    from kernelpolicy.testing import tiny_llama

    if not all(_compat.first_present(seam) for seam in _compat.BATCHING):
        pytest.skip("this transformers has not the batching seams of 5.22-5.25: every manager tells")
    internal = _compat.BATCHING[index]
    moved = dataclasses.replace(internal, names=tuple(n.replace(".", ".kp_moved_", 1) for n in internal.names))
    monkeypatch.setattr(_compat, "BATCHING", tuple(moved if i == index else e for i, e in enumerate(_compat.BATCHING)))
    monkeypatch.setattr(_compat, "_told", set())
    model = kp.attach(tiny_llama())
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        first = model.init_continuous_batching()
        second = model.init_continuous_batching()
    assert not hasattr(first, batching._MARK) and not hasattr(second, batching._MARK)
    [message] = told(records, moved)
    assert "continuous batching carries each request's policy" in message
    assert "its forward steps run under the process default policy" in message and message.endswith(DOCTOR)
    first.destroy()
    second.destroy()


def test_every_batching_seam_is_listed_in_internals() -> None:
    assert set(_compat.BATCHING) | {_compat.BATCHING_MANAGER} <= set(_compat.INTERNALS)


def test_without_the_batching_manager_class_install_says_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from kernelpolicy import batching
    from kernelpolicy.testing import tiny_llama

    init = ContinuousBatchingManager.__init__
    monkeypatch.setattr(ContinuousBatchingManager, "__init__", getattr(init, "__wrapped__", init))
    monkeypatch.setattr(batching, "_INSTALLED", False)
    moved = hide(monkeypatch, "BATCHING_MANAGER")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        model = kp.attach(tiny_llama())  # attach installs the seam: here it cannot
        kp.attach(model)
        manager = model.init_continuous_batching()
    assert not hasattr(manager, batching._MARK)
    assert len(told(records, moved)) == 1
    manager.destroy()
    assert transformers is not None


@pytest.mark.parametrize(
    "attribute", ["SERVING_BUILD", "SERVING_SEND", "SERVING_ENGINE", "SERVING_GENERATE", "SERVING_CB_GENERATE"]
)
def test_without_a_seam_of_transformers_serve_the_command_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], attribute: str
) -> None:
    """Rather than serve every request under one policy: the command says so, and the doctor lists the name."""
    pytest.importorskip("transformers")
    from kernelpolicy import serving

    moved = hide(monkeypatch, attribute)
    monkeypatch.setattr(
        _compat,
        "SERVING_RUNNERS",
        tuple(getattr(_compat, name) for name in ("SERVING_ENGINE", "SERVING_GENERATE", "SERVING_CB_GENERATE")),
    )
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert serving.main(["model-that-is-never-loaded"]) == 1
    assert "lacks the seams a policy travels through" in capsys.readouterr().err
    [message] = told(records, moved)
    assert "serve refuses to start" in message and message.endswith(DOCTOR)


def test_without_the_entry_point_of_spawned_processes_several_api_servers_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--api-server-count 2`` where transformers serve's ``run_until_parent_exits`` moved: its API servers would
    not read the header, so the command refuses, and the doctor lists the name (one API server is unaffected)."""
    pytest.importorskip("transformers")
    from kernelpolicy import serving

    others = (_compat.SERVING_BUILD, _compat.SERVING_SEND, *_compat.SERVING_RUNNERS)
    if not all(_compat.first_present(seam) for seam in others):
        pytest.skip("this transformers has not the other serve seams of 5.25: the command refuses before")
    moved = hide(monkeypatch, "SERVING_API")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert serving.main(["model-that-is-never-loaded", "--api-server-count=2"]) == 1
    assert "--api-server-count 2: this transformers serve lacks the seam" in capsys.readouterr().err
    [message] = told(records, moved)
    assert "serve refuses --api-server-count above 1" in message and message.endswith(DOCTOR)

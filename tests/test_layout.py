"""The house: each concept lives in the module named after it (issue 31).

A top-level class or function whose name is a module's name (``Binding`` and ``_binding``, ``attach`` and
``_attach``, ``propagate`` and ``_propagate``, ``explain`` and ``_explain``, ...) is defined in that module and
nowhere else; the facade re-exports, it does not define. Module sizes stay near 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kernelpolicy"
#: Modules above 500 lines, each one concept whose seams would cut it in the middle (see the closing note of
#: issue 31): the policy value with its checks. Issue 42 split the others where a concept stands apart
#: (``_binding``, ``_aware``, ``_compat``, ``_scope``).
LARGER = {"_values/_policy.py": 530}


def _concept(name: str) -> str:
    return name.strip("_").replace("_", "").lower()


def _definitions() -> dict[str, list[str]]:
    """Concept -> the modules that define a top-level class or function of that name."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(_concept(node.name), []).append(path.stem)
    return found


def test_a_concept_named_by_a_module_is_defined_there_and_only_there() -> None:
    definitions = _definitions()
    # ``main``: the entry point's name in __main__ and serving (a convention, not a concept)
    modules = {
        _concept(path.stem): path.stem for path in PACKAGE.rglob("*.py") if path.stem not in ("__init__", "__main__")
    }
    misplaced = {
        concept: where for concept, where in definitions.items() if concept in modules and where != [modules[concept]]
    }
    assert misplaced == {}
    # and the concepts this round moved are where their files say
    assert definitions["binding"] == ["_binding"] and definitions["replays"] == ["_replay"]
    assert definitions["attach"] == ["_attach"] and definitions["propagate"] == ["_propagate"]


def test_modules_stay_near_500_lines() -> None:
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = {name: size for name, size in sizes.items() if size > LARGER.get(name, 500)}
    assert over == {}


def test_the_layers_count_imports_made_only_for_type_checking() -> None:
    """``lint-imports`` (CI) checks the layers with the imports under ``TYPE_CHECKING`` too (issue 42).

    A type a lower module names reaches it as a protocol of what it reads (``_replay.Replayed``,
    ``_mixing.Mixed``, ``_dispatch.Dispatched``), not by importing the class above it, so that no cycle hides there.
    """
    config = (PACKAGE.parent / "pyproject.toml").read_text()
    settings = config.split("[tool.importlinter]", 1)[1].split("[[tool.importlinter.contracts]]", 1)[0]
    assert "exclude_type_checking_imports = false" in settings.splitlines(), settings


def test_kernelize_takes_in_a_popped_forward_once_per_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The way down of ``kernelize(model)`` (issue 42, item 6): without a variant, ``kernelize`` leaves a forward
    kernels popped to ``attach`` (``binding_of`` resyncs each module) instead of resyncing every module first;
    with a variant it resyncs each module once, while the variant is being bound ("no such variant")."""
    import kernelpolicy as kp
    from kernelpolicy._attach import _attach
    from kernelpolicy.testing import DemoModel, local_mapping, rms_norm_kernel_source, write_kernel_repo

    calls: list[object] = []
    resync = _attach._resync
    monkeypatch.setattr(_attach, "_resync", lambda module: (calls.append(module), resync(module))[1])
    import torch

    repo = write_kernel_repo(tmp_path / "default", rms_norm_kernel_source(offset=100.0))
    other = write_kernel_repo(tmp_path / "again", rms_norm_kernel_source(offset=200.0))
    model = DemoModel(8).eval()
    with local_mapping({"RMSNorm": repo}):
        kp.kernelize(model, mode="inference", device="cpu")
    assert calls == []
    with local_mapping({"RMSNorm": other}):
        kp.kernelize(model, mode="inference", device="cpu", variant="again")
    norms = [module for module in model.modules() if type(module).__name__.endswith("RMSNorm")]
    assert len(calls) == len(norms) == 3 and set(map(id, calls)) == set(map(id, norms))
    # the paths, seen in the outputs: the kernel adds 100, the variant 200, the original nothing
    x = torch.randn(2, 8)
    with kp.kernels_disabled():
        original = model.norm(x)
    torch.testing.assert_close(model.norm(x), original + 100)
    with kp.kernel_policy(RMSNorm="kernel:again"):
        torch.testing.assert_close(model.norm(x), original + 200)

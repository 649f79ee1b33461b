"""Folders of programs (``kernelpolicy._manifest``): written whole or not at all, checked when loaded (issue 35).

Real ``torch.export`` programs of a DemoModel kernelized with a traceable local kernel that adds 100, saved to
real folders; a failed save is a real save with a fault injected (``torch.export.save`` raising ENOSPC after
its first file, a rename failing).
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import kernel_ran

import kernelpolicy as kp
from kernelpolicy import _manifest
from kernelpolicy.artifacts import MANIFEST, export_per_policy, load_per_policy
from kernelpolicy.testing import DemoModel

X = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def model(kernelized: Callable[..., DemoModel]) -> DemoModel:
    return kernelized("traceable")


def _full_disk_after(saves: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.export.save`` writes ``saves`` files, then fails as on a full disk (writing part of the file)."""
    real = torch.export.save
    done = [0]

    def save(program: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if done[0] == saves:
            Path(path).write_bytes(b"PK\x03\x04 half a program")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        done[0] += 1
        real(program, path, *args, **kwargs)

    monkeypatch.setattr(torch.export, "save", save)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def test_a_failed_resave_leaves_the_old_programs_whole(
    model: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer", "disable"], directory=folder)
    before = sorted(p.name for p in folder.iterdir())
    _full_disk_after(1, monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        export_per_policy(model, (X,), policies=["disable", "prefer"], directory=folder)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == before and _leftovers(folder) == []
    programs = load_per_policy(folder)
    with kp.kernel_policy("prefer"):
        assert kernel_ran(programs(X))  # was: the original forward (program-0.pt2 overwritten by 'disable')
        assert kernel_ran(model(X))
    with kp.kernels_disabled():
        assert not kernel_ran(programs(X))


def test_a_resave_replaces_the_folder_whole_with_or_without_an_atomic_exchange(
    model: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer", "disable", "prefer,RMSNorm=disable"], directory=folder)
    export_per_policy(model, (X,), policies=["disable", "prefer"], directory=folder)  # renameat2 on Linux
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "program-0.pt2", "program-1.pt2"]
    monkeypatch.setattr(_manifest, "_exchange", lambda a, b: False)  # the rename-aside path of other systems
    export_per_policy(model, (X,), policies=["prefer"], directory=folder)
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "program-0.pt2"] and _leftovers(folder) == []
    with kp.kernel_policy("prefer"):
        assert kernel_ran(load_per_policy(folder)(X))


def test_a_save_stopped_between_its_renames_says_where_the_programs_are(
    model: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer"], directory=folder)
    monkeypatch.setattr(_manifest, "_exchange", lambda a, b: False)
    real, renames = os.rename, [0]

    def rename(source: Any, target: Any) -> None:
        renames[0] += 1
        if renames[0] == 2:  # the new folder into place: the process dies here
            raise KeyboardInterrupt
        real(source, target)

    monkeypatch.setattr(_manifest.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        export_per_policy(model, (X,), policies=["disable"], directory=folder)
    monkeypatch.undo()
    (aside,) = _leftovers(folder)
    with pytest.raises(
        FileNotFoundError, match=rf"interrupted while replacing it: the previous programs are in {aside}"
    ):
        load_per_policy(folder)
    (folder.parent / aside).rename(folder)
    with kp.kernel_policy("prefer"):
        assert kernel_ran(load_per_policy(folder)(X))


def test_a_folder_with_other_files_is_not_replaced(model: DemoModel, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds files and no kernelpolicy-programs\.json.*new or empty folder"):
        export_per_policy(model, (X,), policies=["prefer"], directory=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def _damaged(folder: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_damaged_manifests_are_refused_naming_the_file(model: DemoModel, tmp_path: Path) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer", "disable"], directory=folder)
    good = (folder / MANIFEST).read_text()
    outside = tmp_path / "outside.pt2"
    outside.write_bytes((folder / "program-0.pt2").read_bytes())

    def entry(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda m: m["programs"][1].update({key: value})

    cases: dict[str, tuple[Callable[[dict[str, Any]], Any] | str, str]] = {
        "truncated": (good[: len(good) // 2], r"is not valid JSON \(.*\): it was cut short or edited"),
        "a list": (f"[{good}]", r"holds a JSON list, not an object"),
        "no programs": (lambda m: m.pop("programs"), r"has programs = None, not a non-empty list"),
        "empty programs": (lambda m: m.update(programs=[]), r"has programs = \[\], not a non-empty list"),
        "no torch": (lambda m: m.pop("torch"), r"has 'torch' = None, not a non-empty text"),
        "a number policy": (entry("policy", 3), r"has programs\[1\]\.'policy' = 3, not a non-empty text"),
        "no file": (lambda m: m["programs"][1].pop("file"), r"has programs\[1\]\.'file' = None"),
        "an entry not an object": (lambda m: m["programs"].append("x"), r"has programs\[2\] = 'x', not an object"),
        "absolute file": (entry("file", str(outside)), r"must be a plain name inside"),
        "file above": (entry("file", "../outside.pt2"), r"must be a plain name inside"),
        "missing file": (entry("file", "program-7.pt2"), r"lists programs\[1\]\.file = 'program-7\.pt2', which is not"),
        "duplicate policy": (entry("policy", "prefer"), r"lists the policy 'prefer' twice"),
        "equal policy": (entry("policy", "prefer,RMSNorm=prefer"), r"lists the policy 'prefer' twice"),
        "duplicate file": (entry("file", "program-0.pt2"), r"lists the file 'program-0\.pt2' twice"),
        "old format": (lambda m: m.update(format=2), r"has format 2, not 3 \(written by another kernelpolicy\)"),
        "bad kind": (lambda m: m.update(kind="onnx"), r"has kind 'onnx', not one of"),
        "bad layers": (lambda m: m.update(layers=[]), r"has layers = \[\], not an object"),
    }
    for name, (change, message) in cases.items():
        if isinstance(change, str):
            (folder / MANIFEST).write_text(change)
        else:
            (folder / MANIFEST).write_text(good)
            _damaged(folder, change)
        with pytest.raises(ValueError, match=message) as raised:
            load_per_policy(folder)
        assert str(folder / MANIFEST) in str(raised.value), name
        assert "save the programs again" in str(raised.value), name


def test_programs_of_another_torch_release(model: DemoModel, tmp_path: Path) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer"], directory=folder)
    _damaged(folder, lambda m: m.update(torch="2.0.0"))
    with pytest.warns(
        UserWarning, match=rf"exported by torch 2\.0\.0, and this is torch {re.escape(str(torch.__version__))}"
    ):
        programs = load_per_policy(folder)
    with kp.kernel_policy("prefer"):
        assert kernel_ran(programs(X))
    _damaged(folder, lambda m: m.update(kind="aot_compile"))  # compiled code: refused, before anything loads
    with pytest.raises(RuntimeError, match=r"compiled by torch 2\.0\.0.*not portable to another\. Compile them again"):
        load_per_policy(folder, model=model)

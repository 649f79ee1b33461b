"""Folders of programs (``kernelpolicy.artifacts._manifest``): written whole or not at all, checked when loaded (issue 35).

Real ``torch.export`` programs of a DemoModel kernelized with a traceable local kernel that adds 100, saved to
real folders; a failed save is a real save with a fault injected (``torch.export.save`` raising ENOSPC after
its first file, a rename failing, a file that cannot be removed), or a save by a process without root's
capabilities into a read-only folder (``as_ordinary_user``: the tests run as root, which no chmod stops).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import as_ordinary_user, kernel_ran

import kernelpolicy as kp
from kernelpolicy.artifacts import MANIFEST, _manifest, export_per_policy, load_per_policy
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


@pytest.mark.parametrize("linked", [False, True], ids=["folder", "link"])
def test_a_save_stopped_between_its_renames_says_where_the_programs_are(
    model: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linked: bool
) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer"], directory=folder)
    named = folder
    if linked:  # loaded through a link (latest -> programs): the save wrote beside its target
        named = tmp_path / "latest"
        named.symlink_to("programs")
    monkeypatch.setattr(_manifest, "_exchange", lambda a, b: False)
    real, renames = os.rename, [0]

    def rename(source: Any, target: Any) -> None:
        renames[0] += 1
        if renames[0] == 2:  # the new folder into place: the process dies here
            raise KeyboardInterrupt
        real(source, target)

    monkeypatch.setattr(_manifest.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        export_per_policy(model, (X,), policies=["disable"], directory=named)
    monkeypatch.undo()
    (aside,) = _leftovers(folder)
    with pytest.raises(
        FileNotFoundError, match=rf"interrupted while replacing it: the previous programs are in {aside}"
    ):
        load_per_policy(named)
    (folder.parent / aside).rename(folder)
    with kp.kernel_policy("prefer"):
        assert kernel_ran(load_per_policy(named)(X))


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


RESAVE = """
import sys, torch
from kernelpolicy.artifacts import export_per_policy
from kernelpolicy.testing import DemoModel

for folder in sys.argv[1:]:
    try:
        export_per_policy(DemoModel(16).eval(), (torch.ones(2, 16),), policies=["disable"], directory=folder)
    except PermissionError as error:
        print(error)
    else:
        print("saved")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drops capabilities with Linux's capset")
def test_a_resave_into_a_read_only_folder_is_refused_before_anything_is_written(
    model: DemoModel, tmp_path: Path
) -> None:
    folder, locked = tmp_path / "programs", tmp_path / "locked" / "programs"
    for where in (folder, locked):
        export_per_policy(model, (X,), policies=["prefer", "disable"], directory=where)
    before = {where: _contents(where) for where in (folder, locked)}
    folder.chmod(0o555)  # the folder read-only: its old programs cannot be removed
    locked.parent.chmod(0o555)  # its parent read-only: the new folder cannot be made beside it
    try:
        done = as_ordinary_user(RESAVE, str(folder), str(locked))
    finally:
        folder.chmod(0o755)
        locked.parent.chmod(0o755)
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip().splitlines()
    # was: the save swapped the folders, then failed to remove the old one: the new programs in the folder,
    # the old ones in a hidden sibling, and a bare PermissionError
    assert said[0].endswith(
        f"kernelpolicy: cannot save programs in {folder}: {folder} is not writable by this process, and a save "
        f"removes its old programs once the new ones are in place. Nothing was written; make it writable "
        f"(chmod u+w {folder}) or pass another directory="
    ), said
    assert f"cannot save programs in {locked}: {locked.parent} is not writable by this process" in said[1], said
    for where in (folder, locked):
        assert _contents(where) == before[where] and _leftovers(where) == []
        programs = load_per_policy(where)
        with kp.kernel_policy("prefer"):
            assert kernel_ran(programs(X))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "renamed-aside"])
@pytest.mark.parametrize("stuck", [MANIFEST, "program-1.pt2"])
def test_old_programs_that_cannot_be_removed_are_put_back_or_named(
    model: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool, stuck: str
) -> None:
    """What the permission check cannot see (an immutable file, a sticky folder): removing ``stuck`` fails."""
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer", "disable"], directory=folder)
    before = _contents(folder)
    if not exchange:
        monkeypatch.setattr(_manifest, "_exchange", lambda a, b: False)
    real, blocked = os.unlink, (folder / stuck).stat().st_ino  # that file cannot be removed, as if immutable

    def unlink(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> None:
        if os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_ino == blocked:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))
        real(path, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    if stuck == MANIFEST:  # nothing of the old folder removed: it is put back, the save fails
        with pytest.raises(PermissionError, match=r"old programs could not be removed .*put back as they were"):
            export_per_policy(model, (X,), policies=["disable"], directory=folder)
        monkeypatch.undo()
        assert _contents(folder) == before and _leftovers(folder) == []
    else:  # the old manifest removed: the save stands, and what is left is named
        with pytest.warns(RuntimeWarning, match=r"saved the programs in .*part of the old ones could not be removed"):
            export_per_policy(model, (X,), policies=["disable"], directory=folder)
        monkeypatch.undo()
        assert sorted(_contents(folder)) == [MANIFEST, "program-0.pt2"]
        (left,) = _leftovers(folder)
        assert sorted(p.name for p in (folder.parent / left).iterdir()) == ["program-1.pt2"]
    programs = load_per_policy(folder)
    assert [str(p) for p in programs.policies] == (["prefer", "disable"] if stuck == MANIFEST else ["disable"])
    with kp.kernels_disabled():
        assert not kernel_ran(programs(X))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "renamed-aside"])
def test_a_linked_folder_is_saved_through_its_link(
    model: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    release = tmp_path / "release-v1"
    export_per_policy(model, (X,), policies=["prefer"], directory=release)
    latest = tmp_path / "latest"
    latest.symlink_to("release-v1")
    if not exchange:
        monkeypatch.setattr(_manifest, "_exchange", lambda a, b: False)
    export_per_policy(model, (X,), policies=["disable"], directory=latest)
    # was: the link swapped out (a hidden name beside it), a real folder named latest, and rmtree's OSError
    assert latest.is_symlink() and os.readlink(latest) == "release-v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "release-v1"]
    programs = load_per_policy(latest)
    assert [str(p) for p in programs.policies] == ["disable"]
    with kp.kernels_disabled():
        assert not kernel_ran(programs(X))


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


@pytest.mark.timeout(120)  # was: reading a pipe in the manifest's place waited for a writer
def test_a_manifest_in_another_encoding_loads_and_one_that_cannot_be_read_names_the_file(
    model: DemoModel, tmp_path: Path
) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer", "disable"], directory=folder)
    manifest = folder / MANIFEST
    good = manifest.read_text()
    for encoding in ("utf-16", "utf-16-le", "utf-8-sig", "utf-32"):  # re-saved by an editor (was: UnicodeDecodeError)
        manifest.write_text(good, encoding=encoding)
        programs = load_per_policy(folder)
        assert [str(p) for p in programs.policies] == ["prefer", "disable"], encoding
        with kp.kernel_policy("prefer"):
            assert kernel_ran(programs(X)), encoding
    manifest.write_bytes(good.replace('"disable"', '"d\u00e9sable"').encode("latin-1"))  # in no JSON encoding
    with pytest.raises(
        ValueError, match=r"is not JSON text in UTF-8, UTF-16 or UTF-32 \('utf-8' codec can't"
    ) as raised:
        load_per_policy(folder)
    assert str(manifest) in str(raised.value) and "save the programs again" in str(raised.value)
    manifest.unlink()
    for make, remove in ((Path.mkdir, Path.rmdir), (os.mkfifo, Path.unlink)):  # a folder, a pipe
        make(manifest)
        with pytest.raises(ValueError, match=rf"{re.escape(str(manifest))} is not a file; save the programs again"):
            load_per_policy(folder)
        remove(manifest)


READ = """
import sys
from pathlib import Path
from kernelpolicy.artifacts._manifest import read_manifest

try:
    read_manifest(Path(sys.argv[1]))
except OSError as error:
    print(type(error).__name__, error)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drops capabilities with Linux's capset")
def test_a_manifest_this_process_cannot_read_names_the_file(model: DemoModel, tmp_path: Path) -> None:
    folder = tmp_path / "programs"
    export_per_policy(model, (X,), policies=["prefer"], directory=folder)
    (folder / MANIFEST).chmod(0)
    done = as_ordinary_user(READ, str(folder))  # what load_per_policy reads first (no torch to import)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (  # was: PermissionError: [Errno 13] Permission denied: '.../kernelpolicy-...'
        f"PermissionError [Errno 13] kernelpolicy: cannot read {folder / MANIFEST}: Permission denied; check its "
        "permissions (chmod a+r)"
    )


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

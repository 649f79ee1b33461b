"""The folder of programs ``kernelpolicy.artifacts`` saves: written whole or not at all, checked when read.

A folder holds the programs (``program-<i>.pt2`` or ``.bin``) and :data:`MANIFEST`, which lists each
program's policy and file, the kind of programs, the torch release that made them and the path each of the
model's kernel layers takes under each mode (see ``artifacts``).

Writing (:func:`write_folder`). Everything is written into a new sibling folder
(``.<name>.kernelpolicy-new-<random>``), each file flushed to disk, which then takes the folder's name:

- no folder of that name: one ``rename``;
- a folder there: on Linux one ``renameat2(RENAME_EXCHANGE)`` swaps the two atomically, then the old one
  (now under the temporary name) is removed. Where the system or the filesystem has no exchange, the old
  folder is renamed aside (``.<name>.kernelpolicy-old-<random>``), the new one renamed in, the old one
  removed: a crash between those two renames leaves no folder under the name and both complete folders
  beside it, and :func:`read_manifest` then says so, naming them (nothing is loaded silently).

A failed save (a full disk, an export that raises) removes its temporary folder: the folder that was there
is left as it was, programs and manifest together. Only a folder a save wrote (it has the manifest) or an
empty one is replaced: one holding other files is refused, since replacing it would delete them.

What a save needs is checked before anything is written (:func:`check_folder`, which ``artifacts`` calls
before exporting or compiling too): write permission on the folder's parent (the new folder is made there) and
on the folder (its old programs are removed once replaced); a read-only folder is refused with
``PermissionError``, as a save that wrote into it would have been. Removing the old programs starts with their
manifest: where even that fails (what the check cannot see: a sticky folder, an immutable file), the old
folder is swapped back and the error raised; where a later file cannot be removed, the save stands and a
warning names what is left. A folder that is a symbolic link (``latest -> release-v1``) is written through:
its target is replaced and the link kept, as writing a file through a link would.

Reading (:func:`read_manifest`) checks the whole manifest before anything is loaded, and names the manifest
file in every error: a file this process can read; valid JSON (in UTF-8 as written, or in UTF-16 or UTF-32,
with or without a byte order mark, as an editor may re-save it: the encodings JSON's bytes may have); an
object with ``format`` :data:`FORMAT`, a known ``kind``, a ``torch`` text and a non-empty ``programs`` list of
objects with a ``policy`` text and a ``file`` text; each file a plain name inside the folder that exists; no
policy or file listed twice; and ``layers`` as written. The torch release is checked by ``artifacts`` (it
decides what a mismatch means for each kind).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import secrets
import shutil
import stat
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from .._values._policy import Policy

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["FORMAT", "MANIFEST", "SUFFIX", "Layer", "Manifest", "check_folder", "read_manifest", "write_folder"]

#: The manifest beside the programs.
MANIFEST: Final = "kernelpolicy-programs.json"
#: The manifest's format: 3 adds ``layers`` (2: ``kind``).
FORMAT: Final = 3
#: Each kind of program and its files' suffix.
SUFFIX: Final[dict[str, str]] = {"export": ".pt2", "aoti": ".pt2", "aot_compile": ".bin"}
_NEW: Final = ".kernelpolicy-new-"
_OLD: Final = ".kernelpolicy-old-"


@dataclasses.dataclass(frozen=True)
class Layer:
    """A kernel layer of the saved model: its layer name, and the path it takes under each entry (mode)."""

    layer_name: str
    #: entry (``prefer``, ``kernel:a|b``, ...) -> ``kernel``, ``kernel:<variant>``, ``original`` or ``error``;
    #: empty where the path depends on a call's arguments (a rule, a kernel without backward).
    paths: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A checked manifest: the programs' kind, the torch that made them, each policy's file, the layers."""

    kind: str
    torch: str
    programs: dict[Policy, Path]
    layers: dict[str, Layer]


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl < 1.2.?)
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if done == 0:
        return True
    error = ctypes.get_errno()
    if error in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot exchange
        return False
    raise OSError(error, f"kernelpolicy: could not swap {b} with the new programs in {a}: {os.strerror(error)}")


def _replaceable(folder: Path) -> None:
    """Refuse a folder that is not a save's (it would be deleted with its files)."""
    if not folder.is_dir():
        raise NotADirectoryError(f"kernelpolicy: {folder} exists and is not a folder: pass a folder for the programs")
    if (folder / MANIFEST).is_file() or not any(folder.iterdir()):
        return
    raise FileExistsError(
        f"kernelpolicy: {folder} holds files and no {MANIFEST}, so it is not a folder of programs; saving replaces "
        "the whole folder and would delete them: pass a new or empty folder (directory=...)"
    )


def check_folder(folder: Path) -> Path:
    """Refuse now what :func:`write_folder` would refuse (called before anything is exported or compiled too):
    a folder that is not a save's, or one this process could not replace (see the module docstring). Returns the
    folder a save writes: a symbolic link's target, the link kept."""
    folder = folder.resolve()
    if folder.exists():
        _replaceable(folder)
    effective = os.access in os.supports_effective_ids
    parent = folder.parent
    while not parent.exists() and parent != parent.parent:  # made by the save: where it is made must be writable
        parent = parent.parent
    needs = (
        (parent, "a save writes the new programs in a folder beside it"),
        (folder, "a save removes its old programs once the new ones are in place"),
    )
    for path, why in needs:
        if path.exists() and not os.access(path, os.W_OK | os.X_OK, effective_ids=effective):
            raise PermissionError(
                errno.EACCES,
                f"kernelpolicy: cannot save programs in {folder}: {path} is not writable by this process, and {why}. "
                f"Nothing was written; make it writable (chmod u+w {path}) or pass another directory=",
            )
    return folder


def _place(new: Path, folder: Path) -> Path:
    """Put ``new`` in ``folder``'s place; return where ``folder``'s former content now is (see the docstring)."""
    if _exchange(new, folder):
        return new
    old = folder.parent / f".{folder.name}{_OLD}{secrets.token_hex(4)}"
    os.rename(folder, old)
    os.rename(new, folder)  # between the two renames, read_manifest names both folders
    return old


def _discard(old: Path, folder: Path) -> None:
    """Remove the old programs (``old``, replaced in ``folder``); where the first removal fails, put them back."""
    try:
        if (old / MANIFEST).exists():
            os.unlink(old / MANIFEST)
        else:
            os.rmdir(old)  # an empty folder (_replaceable)
    except OSError as error:
        shutil.rmtree(_place(old, folder), ignore_errors=True)  # the new programs, swapped out again
        raise type(error)(
            error.errno,
            f"kernelpolicy: cannot save programs in {folder}: its old programs could not be removed ({error.strerror}), "
            "so they were put back as they were. Check the permissions of the folder and its files, or pass another "
            "directory=",
        ) from None
    shutil.rmtree(old, ignore_errors=True)  # what cannot be removed is named below
    if old.exists():
        warnings.warn(
            f"kernelpolicy: saved the programs in {folder}, but part of the old ones could not be removed: "
            f"{old} is left beside it (no manifest: it loads as nothing); remove it",
            RuntimeWarning,
            stacklevel=5,  # the caller of export_per_policy or compile_per_policy
        )


def write_folder(folder: Path, fill: Callable[[Path], dict[str, Any]]) -> None:
    """Write a folder of programs atomically: ``fill(new)`` saves the programs into ``new`` and returns the
    manifest's content, which is written last; then ``new`` takes ``folder``'s place (see the module docstring).
    """
    folder = check_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    new = folder.parent / f".{folder.name}{_NEW}{secrets.token_hex(4)}"
    new.mkdir()
    try:
        manifest = fill(new)
        (new / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in new.iterdir():
            _fsync(path)
        _fsync(new)
        if folder.exists():
            _discard(_place(new, folder), folder)
        else:
            os.rename(new, folder)
        _fsync(folder.parent)
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)


def _interrupted(folder: Path) -> str:
    """What an interrupted save left beside ``folder`` (see the module docstring), as a sentence, or ''."""
    folder = folder.resolve()  # a link's save writes beside its target
    if not folder.parent.is_dir():
        return ""
    left = sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}{_OLD}"))
    if not left:
        return ""
    return (
        f"; a save was interrupted while replacing it: the previous programs are in {', '.join(left)} beside it "
        f"(complete; rename one to {folder.name} to load it), or save the programs again"
    )


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"kernelpolicy: {path} {what}; save the programs again (kernelpolicy.artifacts)")


def _field(path: Path, entry: Mapping[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(path, f"has {where}{key!r} = {value!r}, not a non-empty text")
    return value


def read_manifest(folder: Path) -> Manifest:
    """The checked manifest of ``folder`` (see the module docstring); every error names the manifest file."""
    path = folder / MANIFEST
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a folder, a pipe (reading one would wait for a writer)
            raise _bad(path, "is not a file")
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(
            f"kernelpolicy: {folder} has no {MANIFEST}{_interrupted(folder)}; save programs with "
            "kernelpolicy.artifacts.export_per_policy or compile_per_policy"
        ) from None
    except OSError as error:  # no permission to read it, an I/O error
        raise OSError(
            error.errno, f"kernelpolicy: cannot read {path}: {error.strerror}; check its permissions (chmod a+r)"
        ) from None
    try:
        manifest = json.loads(data)  # UTF-8 as written, or UTF-16 or UTF-32 re-saved by an editor: JSON's encodings
    except UnicodeDecodeError as error:
        raise _bad(path, f"is not JSON text in UTF-8, UTF-16 or UTF-32 ({error}): it was edited") from None
    except json.JSONDecodeError as error:
        raise _bad(path, f"is not valid JSON ({error}): it was cut short or edited") from None
    if not isinstance(manifest, dict):
        raise _bad(path, f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise _bad(path, f"has format {manifest.get('format')!r}, not {FORMAT} (written by another kernelpolicy)")
    kind = manifest.get("kind")
    if kind not in SUFFIX:
        raise _bad(path, f"has kind {kind!r}, not one of {sorted(SUFFIX)}")
    torch_release = _field(path, manifest, "torch", "")
    listed = manifest.get("programs")
    if not isinstance(listed, list) or not listed:
        raise _bad(path, f"has programs = {listed!r}, not a non-empty list of {{'policy': ..., 'file': ...}}")
    programs: dict[Policy, Path] = {}
    files: set[str] = set()
    for position, entry in enumerate(listed):
        where = f"programs[{position}]"
        if not isinstance(entry, dict):
            raise _bad(path, f"has {where} = {entry!r}, not an object {{'policy': ..., 'file': ...}}")
        policy = Policy.parse(_field(path, entry, "policy", f"{where}."), source=f"{path} {where}")
        name = _field(path, entry, "file", f"{where}.")
        if Path(name).name != name or name in (".", ".."):
            raise _bad(path, f"has {where}.file = {name!r}: a program's file must be a plain name inside {folder}")
        if not (folder / name).is_file():
            raise _bad(path, f"lists {where}.file = {name!r}, which is not in {folder}")
        if policy in programs:
            raise _bad(path, f"lists the policy {str(policy)!r} twice ({where} and an earlier entry)")
        if name in files:
            raise _bad(path, f"lists the file {name!r} twice ({where} and an earlier entry)")
        programs[policy] = folder / name
        files.add(name)
    return Manifest(kind, torch_release, programs, _layers(path, manifest.get("layers")))


def _layers(path: Path, layers: object) -> dict[str, Layer]:
    if not isinstance(layers, dict):
        raise _bad(path, f"has layers = {layers!r}, not an object of the model's kernel layers")
    checked: dict[str, Layer] = {}
    for module, layer in layers.items():
        if not isinstance(layer, dict):
            raise _bad(path, f"has layers[{module!r}] = {layer!r}, not an object")
        paths = layer.get("paths")
        if not isinstance(paths, dict) or not all(isinstance(v, str) for v in paths.values()):
            raise _bad(path, f"has layers[{module!r}].paths = {paths!r}, not an object of texts")
        checked[module] = Layer(_field(path, layer, "layer", f"layers[{module!r}]."), dict(paths))
    return checked

"""Compiled and exported programs that keep their policy: one program per policy, saved, loaded, dispatched.

A traced program runs the path of the policy it was traced under. A ``.pt2`` file or an AOTInductor
package loaded in another process has no policy left to read: called under any other policy it runs its
own path without a word. A program persisted by ``aot_compile`` or caching precompile carries a check of its
policy and raises :class:`ArtifactPolicyError` instead (see docs/compile.md, "Persisted artifacts"). Neither
serves several policies. This module makes the set explicit:

- :func:`export_per_policy` exports a model once under each listed policy (each inside
  ``kernel_policy(policy)``), as ``torch.export`` programs or, with ``package="aoti"``, as AOTInductor
  packages;
- :func:`compile_per_policy` compiles it once under each policy with ``torch.compile(...).aot_compile``
  (Inductor's code, loaded warm: no tracing or compiling in the process that loads it);
- both save the programs with a manifest of their policies (:data:`MANIFEST`); :func:`load_per_policy`
  loads them in any process;
- the :class:`PolicyPrograms` they return calls, at each call, the program of the policy in effect, and
  refuses a policy it has no program for with :class:`NoProgramError`, which names the policy in effect and
  the ones it has.

>>> import tempfile, torch, kernelpolicy
>>> from kernelpolicy.artifacts import export_per_policy, load_per_policy
>>> @kernelpolicy.use_kernel_forward_from_hub("Halve")
... class Halve(torch.nn.Module):
...     def forward(self, x):
...         return x / 2
>>> folder = tempfile.mkdtemp()
>>> _ = export_per_policy(torch.nn.Sequential(Halve()), (torch.ones(2),), policies=["prefer", "disable"], directory=folder)
>>> programs = load_per_policy(folder)  # in this process or another one
>>> with kernelpolicy.kernels_disabled():
...     programs(torch.ones(2))
tensor([0.5000, 0.5000])
>>> with kernelpolicy.kernel_policy("require"):
...     programs(torch.ones(2))
Traceback (most recent call last):
...
kernelpolicy.artifacts.NoProgramError: kernelpolicy: no exported program for the policy in effect 'require'; ... exported under 'prefer', 'disable'. ...
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from ._active import current_policy
from ._errors import ArtifactPolicyError
from ._policy import Policy
from ._scope import kernel_policy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from torch import nn

__all__ = [
    "MANIFEST",
    "ArtifactPolicyError",
    "NoProgramError",
    "PolicyPrograms",
    "compile_per_policy",
    "export_per_policy",
    "load_per_policy",
]

#: The manifest :func:`export_per_policy` and :func:`compile_per_policy` write beside the programs.
MANIFEST: Final = "kernelpolicy-programs.json"
_FORMAT: Final = 2
#: What a manifest's ``kind`` says the programs are, and how each is saved.
Kind = Literal["export", "aoti", "aot_compile"]
_SUFFIX: Final[dict[str, str]] = {"export": ".pt2", "aoti": ".pt2", "aot_compile": ".bin"}


class NoProgramError(LookupError):
    """A :class:`PolicyPrograms` was called under a policy it has no program for."""


class PolicyPrograms:
    """Programs by policy: calling it runs the program of the policy in effect (see the module docstring)."""

    def __init__(self, programs: Mapping[Policy, Callable[..., Any]], where: str = "", kind: str = "export") -> None:
        self.programs = dict(programs)
        self.where = where
        self.kind = kind

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(self.programs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = current_policy()
        program = self.programs.get(policy)
        if program is None:
            listed = ", ".join(repr(str(p)) for p in self.programs)
            made = "compiled" if self.kind == "aot_compile" else "exported"
            raise NoProgramError(
                f"kernelpolicy: no {made} program for the policy in effect {str(policy)!r}; the programs"
                f"{' in ' + self.where if self.where else ''} were {made} under {listed}. A traced program runs "
                f"the path of its trace's policy whatever the caller's, so this call is refused: make one for "
                f"this policy too ({'compile' if made == 'compiled' else 'export'}_per_policy(..., policies=[...]))"
            )
        return program(*args, **kwargs)

    def __repr__(self) -> str:
        return f"PolicyPrograms({[str(p) for p in self.programs]}, kind={self.kind!r})"


def _policies(policies: Iterable[Policy | str], caller: str) -> list[Policy]:
    """The listed policies as values, each once, in order."""
    checked: list[Policy] = []
    for given in policies:
        policy = given if isinstance(given, Policy) else Policy.parse(given, source=f"{caller} policy")
        if policy not in checked:
            checked.append(policy)
    if not checked:
        raise ValueError(f"kernelpolicy: {caller} needs at least one policy (policies=[...])")
    return checked


def _save(folder: Path, kind: Kind, programs: Mapping[Policy, Any], save: Callable[[Any, Path], object]) -> None:
    """Save each program with ``save(program, path)``, then :data:`MANIFEST` (last: it lists only saved files)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, (policy, program) in enumerate(programs.items()):
        name = f"program-{index}{_SUFFIX[kind]}"
        save(program, folder / name)
        entries.append({"policy": str(policy), "file": name})
    manifest = {"format": _FORMAT, "kind": kind, "torch": str(torch.__version__), "programs": entries}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def export_per_policy(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    policies: Iterable[Policy | str],
    directory: str | Path | None = None,
    strict: bool = False,
    package: Literal["export", "aoti"] = "export",
) -> PolicyPrograms:
    """``torch.export.export(model, args, kwargs, strict=strict)`` once under each policy, optionally saved.

    With ``directory``, each program is saved there (``program-<i>.pt2``) and :data:`MANIFEST` lists their
    policies, for :func:`load_per_policy`: with ``torch.export.save``, or with ``package="aoti"`` compiled
    by AOTInductor into a package (``torch._inductor.aoti_compile_and_package``; needs ``directory``).
    Policies are :class:`Policy` values or their text; equal policies are exported once.
    """
    import torch
    import torch._inductor

    if package not in ("export", "aoti"):
        raise ValueError(f"kernelpolicy: package must be 'export' or 'aoti', not {package!r}")
    if package == "aoti" and directory is None:
        raise ValueError("kernelpolicy: package='aoti' writes AOTInductor packages: pass directory=")
    exported = {}
    for policy in _policies(policies, "export_per_policy"):
        with kernel_policy(policy):
            exported[policy] = torch.export.export(model, args, kwargs, strict=strict)
    if directory is not None:
        folder = Path(directory)
        if package == "aoti":  # the packages exist only on disk: compiled there, loaded from there
            aoti = torch._inductor.aoti_compile_and_package
            _save(folder, package, exported, lambda program, path: aoti(program, package_path=str(path)))
            return load_per_policy(folder)
        _save(folder, package, exported, torch.export.save)
    return PolicyPrograms({policy: program.module() for policy, program in exported.items()}, str(directory or ""))


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What :func:`compile_per_policy` compiles: a call of the module (passed in, so nothing is closed over)."""
    return module(*args, **kwargs)


def compile_per_policy(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    policies: Iterable[Policy | str],
    directory: str | Path | None = None,
    backend: str = "inductor",
    dynamic: bool | None = None,
) -> PolicyPrograms:
    """``torch.compile(..., fullgraph=True).aot_compile`` of a call of ``model`` once under each policy.

    Each program carries the check of its policy (``ArtifactPolicyError``), and the :class:`PolicyPrograms`
    returned calls the one of the policy in effect with ``model``. With ``directory``, each is saved there
    (``program-<i>.bin``, ``save_compiled_function``) with :data:`MANIFEST`; :func:`load_per_policy`
    (``directory``, ``model=``) loads them in another process without tracing or compiling. Needs a torch
    whose ``torch.compile`` has ``aot_compile``.
    """
    import torch

    # Any: torch releases without aot_compile (2.9) type torch.compile's result without it (mypy strict on each)
    compiler: Any = torch.compile(_call, fullgraph=True, backend=backend, dynamic=dynamic)
    if not hasattr(compiler, "aot_compile"):
        raise NotImplementedError(f"kernelpolicy: torch {torch.__version__} has no torch.compile(...).aot_compile")
    compiled = {}
    for policy in _policies(policies, "compile_per_policy"):
        with kernel_policy(policy):
            compiled[policy] = compiler.aot_compile(((model, *args), kwargs or {}))
    if directory is not None:
        _save(Path(directory), "aot_compile", compiled, lambda program, path: program.save_compiled_function(str(path)))
    where = str(directory or "")
    return PolicyPrograms(
        {policy: functools.partial(program, model) for policy, program in compiled.items()}, where, "aot_compile"
    )


def load_per_policy(directory: str | Path, *, model: nn.Module | None = None) -> PolicyPrograms:
    """The programs :func:`export_per_policy` or :func:`compile_per_policy` saved in ``directory``.

    Programs of :func:`compile_per_policy` run ``model`` (the same architecture, kernelized the same way):
    pass it as ``model=``.
    """
    import torch
    import torch._inductor

    folder = Path(directory)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"kernelpolicy: {folder} has no {MANIFEST}; save programs with kernelpolicy.artifacts.export_per_policy "
            "or compile_per_policy"
        ) from None
    if manifest.get("format") not in (1, _FORMAT):
        raise ValueError(f"kernelpolicy: {folder / MANIFEST} has format {manifest.get('format')!r}, not {_FORMAT}")
    kind = manifest.get("kind", "export")
    if kind not in _SUFFIX:
        raise ValueError(f"kernelpolicy: {folder / MANIFEST} has kind {kind!r}, not one of {sorted(_SUFFIX)}")
    if kind == "aot_compile" and model is None:
        raise TypeError(
            f"kernelpolicy: the programs in {folder} were compiled with compile_per_policy and run a model: "
            "pass it, load_per_policy(directory, model=model)"
        )

    def load(path: Path) -> Callable[..., Any]:
        if kind == "aoti":
            package: Any = torch._inductor.aoti_load_package(str(path))
            return package  # type: ignore[no-any-return]
        if kind == "aot_compile":
            with path.open("rb") as file:
                torch_compiler: Any = torch.compiler  # load_compiled_function: absent from torch 2.9 (see above)
                return functools.partial(torch_compiler.load_compiled_function(file), model)
        return torch.export.load(path).module()

    source = str(folder / MANIFEST)
    programs = {
        Policy.parse(entry["policy"], source=source): load(folder / entry["file"]) for entry in manifest["programs"]
    }
    return PolicyPrograms(programs, str(folder), kind)

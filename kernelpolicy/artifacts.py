"""Exported programs that keep their policy: one ``torch.export`` program per policy, saved, loaded, dispatched.

A traced program runs the path of the policy it was traced under, and a ``.pt2`` file loaded in another
process has no policy left to read: called under any other policy it runs its own path without a word.
This module makes the set explicit. :func:`export_per_policy` exports a model once under each listed policy
(each inside ``kernel_policy(policy)``) and saves the programs with a manifest of their policies;
:func:`load_per_policy` loads them in any process; the :class:`PolicyPrograms` they return calls, at each
call, the program of the policy in effect, and refuses a policy it has no program for with
:class:`NoProgramError`, which names the policy in effect and the ones it has.

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

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    "export_per_policy",
    "load_per_policy",
]

#: The manifest :func:`export_per_policy` writes beside the programs.
MANIFEST = "kernelpolicy-programs.json"
_FORMAT = 1


class NoProgramError(LookupError):
    """A :class:`PolicyPrograms` was called under a policy it has no program for."""


class PolicyPrograms:
    """Programs by policy: calling it runs the program of the policy in effect (see the module docstring)."""

    def __init__(self, programs: Mapping[Policy, Callable[..., Any]], where: str = "") -> None:
        self.programs = dict(programs)
        self.where = where

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(self.programs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = current_policy()
        program = self.programs.get(policy)
        if program is None:
            listed = ", ".join(repr(str(p)) for p in self.programs)
            raise NoProgramError(
                f"kernelpolicy: no exported program for the policy in effect {str(policy)!r}; the programs"
                f"{' in ' + self.where if self.where else ''} were exported under {listed}. A traced program runs "
                "the path of its export's policy whatever the caller's, so this call is refused: export one for "
                "this policy too (export_per_policy(..., policies=[...]))"
            )
        return program(*args, **kwargs)

    def __repr__(self) -> str:
        return f"PolicyPrograms({[str(p) for p in self.programs]})"


def export_per_policy(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    policies: Iterable[Policy | str],
    directory: str | Path | None = None,
    strict: bool = False,
) -> PolicyPrograms:
    """``torch.export.export(model, args, kwargs, strict=strict)`` once under each policy, optionally saved.

    With ``directory``, each program is saved there with ``torch.export.save`` (``program-<i>.pt2``) and
    :data:`MANIFEST` lists their policies, for :func:`load_per_policy`. Policies are :class:`Policy` values
    or their text; equal policies are exported once.
    """
    import torch

    checked: list[Policy] = []
    for given in policies:
        policy = given if isinstance(given, Policy) else Policy.parse(given, source="export_per_policy policy")
        if policy not in checked:
            checked.append(policy)
    exported = {}
    for policy in checked:
        with kernel_policy(policy):
            exported[policy] = torch.export.export(model, args, kwargs, strict=strict)
    if directory is not None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        entries = []
        for index, (policy, program) in enumerate(exported.items()):
            name = f"program-{index}.pt2"
            torch.export.save(program, folder / name)
            entries.append({"policy": str(policy), "file": name})
        manifest = {"format": _FORMAT, "torch": str(torch.__version__), "programs": entries}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return PolicyPrograms({policy: program.module() for policy, program in exported.items()}, str(directory or ""))


def load_per_policy(directory: str | Path) -> PolicyPrograms:
    """The programs :func:`export_per_policy` saved in ``directory``, each under its policy."""
    import torch

    folder = Path(directory)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"kernelpolicy: {folder} has no {MANIFEST}; save programs with kernelpolicy.artifacts.export_per_policy"
        ) from None
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"kernelpolicy: {folder / MANIFEST} has format {manifest.get('format')!r}, not {_FORMAT}")
    programs = {
        Policy.parse(entry["policy"], source=f"{folder / MANIFEST}"): torch.export.load(folder / entry["file"]).module()
        for entry in manifest["programs"]
    }
    return PolicyPrograms(programs, str(folder))

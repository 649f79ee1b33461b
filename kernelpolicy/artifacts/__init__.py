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
- both save the programs with a manifest of their policies (:data:`MANIFEST`), atomically, and
  :func:`load_per_policy` checks it and loads them in any process (``_manifest``: the folder's format);
- the :class:`PolicyPrograms` they return calls, at each call, the program of the policy in effect, or of a
  policy that takes the same path on each of the model's kernel layers (:func:`model_layers` records them),
  and refuses a policy it has no program for with :class:`NoProgramError`, which names the policy in effect,
  the ones it has and the first layer where the paths differ.

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
kernelpolicy.artifacts.NoProgramError: kernelpolicy: no exported program for the policy in effect 'require'; ... exported under 'prefer', 'disable', which take other paths on the model's kernel layers ('0': error here, original under 'prefer'; ...
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from .._context._active import current_policy, layer_facts, register_variant
from .._context._scope import kernel_policy
from .._forward._binding import Binding
from .._tell._explain import ROW_SOURCES, _marked
from .._values._errors import ArtifactPolicyError
from .._values._policy import DEFAULT_VARIANT, MODES, VARIANTS, Policy, variant_names
from .._values._rules import RULES, VARIANT_RULES
from ._manifest import FORMAT, MANIFEST, SUFFIX, Layer, check_folder, read_manifest, write_folder

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from torch import nn

    from .._context._state import ExecutionState

__all__ = [
    "MANIFEST",
    "ArtifactPolicyError",
    "NoProgramError",
    "PolicyPrograms",
    "compile_per_policy",
    "export_per_policy",
    "load_per_policy",
]

#: What a manifest's ``kind`` says the programs are, and how each is saved.
Kind = Literal["export", "aoti", "aot_compile"]
#: Kinds whose programs are compiled code for one torch build: loading them under another torch is refused.
_COMPILED: Final = ("aoti", "aot_compile")


class NoProgramError(LookupError):
    """A :class:`PolicyPrograms` was called under a policy it has no program for."""


class PolicyPrograms:
    """Programs by policy: calling it runs the program of the policy in effect (see the module docstring).

    ``layers``: the model's kernel layers by module name (:func:`model_layers`), from which a policy's path
    on the model is known; a policy that takes the same path as a program's policy on each of them runs that
    program. None: only the programs' own policies are served.
    """

    def __init__(
        self,
        programs: Mapping[Policy, Callable[..., Any]],
        where: str = "",
        kind: str = "export",
        layers: Mapping[str, Layer] | None = None,
    ) -> None:
        self.programs = dict(programs)
        self.where = where
        self.kind = kind
        self.layers = None if layers is None else dict(layers)
        self._chosen: dict[Policy, Callable[..., Any] | None] = {}

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(self.programs)

    def path_of(self, policy: Policy) -> tuple[tuple[str, str], ...] | None:
        """What identifies ``policy``'s program on the model: each kernel layer's path (``aot_compile``: the facts
        a compiled program's policy check compares, see ``_persisted``); None without the model's layers.

        A layer whose path depends on a call's arguments (a rule, a kernel without backward) is identified by
        its policy entry, so only policies with the same entry share its program.
        """
        if self.layers is None:
            return None
        if self.kind == "aot_compile":
            names = sorted({layer.layer_name for layer in self.layers.values()})
            return tuple((name, repr(layer_facts(policy, name)[1:])) for name in names)
        found = []
        for module, layer in sorted(self.layers.items()):
            entry = policy.entry_for(layer.layer_name)
            path = _entry_path(layer.paths, entry)
            found.append((module, f"{entry!r} (a path that depends on each call)" if path is None else path))
        return tuple(found)

    def program_for(self, policy: Policy) -> Callable[..., Any] | None:
        """The program that runs ``policy``'s path on the model, or None."""
        program = self.programs.get(policy)
        if program is not None:
            return program
        if policy not in self._chosen:
            path = self.path_of(policy)
            same = [p for stored, p in self.programs.items() if path is not None and self.path_of(stored) == path]
            self._chosen[policy] = same[0] if same else None
        return self._chosen[policy]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = current_policy()
        program = self.program_for(policy)
        if program is None:
            listed = ", ".join(repr(str(p)) for p in self.programs)
            made = "compiled" if self.kind == "aot_compile" else "exported"
            raise NoProgramError(
                f"kernelpolicy: no {made} program for the policy in effect {str(policy)!r}; the programs"
                f"{' in ' + self.where if self.where else ''} were {made} under {listed}{self._differs(policy)}. "
                f"A traced program runs the path of its trace's policy whatever the caller's, so this call is refused: "
                f"make one for this policy too ({'compile' if made == 'compiled' else 'export'}_per_policy(..., "
                "policies=[...]))"
            )
        return program(*args, **kwargs)

    def _differs(self, policy: Policy) -> str:
        """Where ``policy``'s path on the model leaves every program's (the first layer for each), as a clause."""
        path = self.path_of(policy)
        if path is None:
            return ""
        differ = []
        for stored in self.programs:
            theirs = self.path_of(stored)
            assert theirs is not None
            layer, mine, its = next((a[0], a[1], b[1]) for a, b in zip(path, theirs, strict=True) if a != b)
            differ.append(f"{layer!r}: {mine} here, {its} under {str(stored)!r}")
        return f", which take other paths on the model's kernel layers ({'; '.join(differ)})"

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


def _path(binding: Binding, entry: str, state: ExecutionState) -> str:
    """The path of ``binding``'s calls under ``entry``: ``kernel``, ``kernel:<variant>``, ``original``, ``error``."""
    path, _ = binding.decide(entry, state)
    if path == "kernel" and entry.startswith(VARIANTS):
        name = binding.choose(entry, state)[3]
        if name is not None and name != DEFAULT_VARIANT:
            return f"kernel:{name}"
    return path


def _entry_path(paths: Mapping[str, str], entry: str) -> str | None:
    """The path under ``entry``: stored for modes and single variants; a list of variants takes the first that
    runs its kernel (``Binding.choose``); None where unknown."""
    if entry in paths or not entry.startswith(VARIANTS):
        return paths.get(entry)
    for name in variant_names(entry):
        path = paths.get(f"{VARIANTS}{name}")
        if path is None or path != "original":
            return path
    return "original"


def model_layers(model: nn.Module, state: ExecutionState) -> dict[str, Layer]:
    """The policy-aware kernel layers of ``model`` by module name, each with its path under every mode and under
    each bound variant alone (as ``explain`` decides it, in ``state``: ``export`` or ``compile``).

    A layer whose path depends on a call's arguments (a ``kernel_accepts`` rule, a kernel without backward)
    gets no paths: programs are matched by its entry.
    """
    entries = [*_marked(model), *(entry for source in ROW_SOURCES for entry in source(model))]
    layers: dict[str, Layer] = {}
    for name, found in entries:
        if not isinstance(found, Binding):
            continue  # not policy-aware: the same path under every policy
        layer = found.layer_name
        kernels = [found.kernel_named(DEFAULT_VARIANT), *found.variants.values()]
        if (
            layer in RULES
            or any(ruled == layer for ruled, _ in VARIANT_RULES)
            or any(kernel is not None and not kernel.has_backward for kernel in kernels)
        ):
            layers[name] = Layer(layer, {})
            continue
        asked = [*MODES, *(f"{VARIANTS}{variant}" for variant in (DEFAULT_VARIANT, *sorted(found.variants)))]
        layers[name] = Layer(layer, {entry: _path(found, entry, state) for entry in asked})
    return layers


def _save(
    folder: Path,
    kind: Kind,
    programs: Mapping[Policy, Any],
    layers: Mapping[str, Layer],
    save: Callable[[Any, Path], object],
) -> None:
    """Save each program with ``save(program, path)`` and :data:`MANIFEST`, atomically (see ``_manifest``)."""
    import torch

    def fill(new: Path) -> dict[str, Any]:
        entries = []
        for index, (policy, program) in enumerate(programs.items()):
            name = f"program-{index}{SUFFIX[kind]}"
            save(program, new / name)
            entries.append({"policy": str(policy), "file": name})
        described = {name: {"layer": layer.layer_name, "paths": layer.paths} for name, layer in sorted(layers.items())}
        return {
            "format": FORMAT,
            "kind": kind,
            "torch": str(torch.__version__),
            "programs": entries,
            "layers": described,
        }

    write_folder(folder, fill)


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
    listed = _policies(policies, "export_per_policy")
    if directory is not None:
        check_folder(Path(directory))  # before exporting: a folder the save would refuse is refused now
    layers = model_layers(model, "export")
    for policy in listed:
        with kernel_policy(policy):
            exported[policy] = torch.export.export(model, args, kwargs, strict=strict)
    if directory is not None:
        folder = Path(directory)
        if package == "aoti":  # the packages exist only on disk: compiled there, loaded from there
            aoti = torch._inductor.aoti_compile_and_package
            _save(folder, package, exported, layers, lambda program, path: aoti(program, package_path=str(path)))
            return load_per_policy(folder)
        _save(folder, package, exported, layers, torch.export.save)
    programs = {policy: program.module() for policy, program in exported.items()}
    return PolicyPrograms(programs, str(directory or ""), layers=layers)


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What :func:`compile_per_policy` compiles: a call of the module (passed in, so nothing is closed over)."""
    return module(*args, **kwargs)


def _save_compiled(program: Any, path: Path) -> None:
    program.save_compiled_function(str(path))


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
    listed = _policies(policies, "compile_per_policy")
    if directory is not None:
        check_folder(Path(directory))  # before compiling: a folder the save would refuse is refused now
    layers = model_layers(model, "compile")
    for policy in listed:
        with kernel_policy(policy):
            compiled[policy] = compiler.aot_compile(((model, *args), kwargs or {}))
    if directory is not None:
        _save(Path(directory), "aot_compile", compiled, layers, _save_compiled)
    programs = {policy: functools.partial(program, model) for policy, program in compiled.items()}
    return PolicyPrograms(programs, str(directory or ""), "aot_compile", layers)


def load_per_policy(directory: str | Path, *, model: nn.Module | None = None) -> PolicyPrograms:
    """The programs :func:`export_per_policy` or :func:`compile_per_policy` saved in ``directory``.

    Programs of :func:`compile_per_policy` run ``model`` (the same architecture, kernelized the same way):
    pass it as ``model=``.
    """
    import torch
    import torch._inductor

    folder = Path(directory)
    manifest = read_manifest(folder)
    kind = manifest.kind
    _check_torch(folder, kind, manifest.torch, str(torch.__version__))
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

    programs = {policy: load(path) for policy, path in manifest.programs.items()}
    _register_variants(manifest.programs, manifest.layers)
    return PolicyPrograms(programs, str(folder), kind, manifest.layers)


def _register_variants(policies: Iterable[Policy], layers: Mapping[str, Layer]) -> None:
    """Make the kernel variants the programs were saved with known here, so a scope can choose their programs.

    A scope checks that each variant it names is bound in the process (``_scope.check_variants``); a process
    that loads programs binds none, yet ``kernel_policy(RMSNorm="kernel:fast")`` is how it picks the program
    saved under that variant. The variants are the ones the manifest names: in the programs' policies (checked
    when they were saved) and in the paths of each layer.
    """
    for policy in policies:
        for layer_name, names in policy.variant_entries:
            for name in names:
                if name != DEFAULT_VARIANT:
                    register_variant(layer_name, name)
    for layer in layers.values():
        for entry in layer.paths:
            name = entry.removeprefix(VARIANTS)
            if entry.startswith(VARIANTS) and name != DEFAULT_VARIANT:
                register_variant(layer.layer_name, name)


def _check_torch(folder: Path, kind: str, saved: str, running: str) -> None:
    """Refuse compiled programs of another torch release; warn for ``torch.export`` programs (see the docs)."""
    if saved == running:
        return
    if kind in _COMPILED:
        raise RuntimeError(
            f"kernelpolicy: the programs in {folder} ({MANIFEST}: kind {kind!r}) were compiled by torch {saved}, and "
            f"this is torch {running}: compiled code is built against one torch release and is not portable to "
            "another. Compile them again under this torch (compile_per_policy / export_per_policy(package='aoti'))"
        )
    warnings.warn(
        f"kernelpolicy: the programs in {folder} were exported by torch {saved}, and this is torch {running}: "
        "torch.export does not promise that a .pt2 program runs alike on another release (torch.export.load "
        "refuses only an unreadable schema). Export them again under this torch to be sure",
        UserWarning,
        stacklevel=3,
    )

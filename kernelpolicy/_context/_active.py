"""What the forwards read: the policy in effect, resolved per layer, and the state that holds it.

This module owns:

- :class:`Active`, the interned object a forward reads: one per (policy,
  recording), with the resolved mode of every known kernel layer as an
  attribute (``active.modes.RMSNorm``) and the two facts a traced program
  depends on (``active.kernel_on.RMSNorm``, ``active.required.RMSNorm``);
- the state: one :class:`contextvars.ContextVar` for scopes, one
  process-wide default (``set_default_policy`` or ``KERNELPOLICY`` or the
  built-in ``prefer``), and the scopes entered where TorchDynamo traces
  (:class:`TracedFrame`), in :data:`DEFAULTS`; :func:`in_effect` reads them in that order;
- the known layer names (:func:`register_layer_name`, :func:`known_layers`);
- :data:`POLICY_CHECKS`, what features check a policy with before a scope or
  the process default puts it in effect.

How the hot path reads the policy in effect (it does exactly this)::

    DEFAULTS.active._current

``_current`` is ``property(_SCOPED.get)``: the ContextVar's builtin ``get``
called with the process default's :class:`Active` as its own fallback, so an
unset variable yields the process default itself. TorchDynamo traces this read
without a graph break and guards on it, which is what makes a compiled model
honour the caller's scope (see ``_dispatch``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

from .._values._policy import BUILTIN, ENV_VAR, MODES, Policy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = [
    "DEFAULTS",
    "MIXED",
    "POLICY_CHECKS",
    "Active",
    "TracedFrame",
    "activate",
    "activate_mixed",
    "any_variant",
    "current_policy",
    "ensure_env",
    "in_effect",
    "known_layers",
    "known_variants",
    "layer_facts",
    "named",
    "register_layer_name",
    "register_variant",
]

#: What ``active.modes`` holds for a mode while calls are recorded: a value the
#: forward's fast exits do not know, so every call takes the slow path that records.
#: What a recorded entry ends with: code that runs traced tests the suffix (a string constant), never membership
#: in :data:`UNRECORDED`, whose growth (a new variant entry) would fail the guards of every compiled program.
RECORD_SUFFIX: Final = "+record"
RECORDED: dict[str, str] = {mode: f"{mode}{RECORD_SUFFIX}" for mode in MODES}
#: The mode behind each of those entries. Variant entries (``"kernel:a|b"``) are added as policies name them.
UNRECORDED: dict[str, str] = {f"{mode}{RECORD_SUFFIX}": mode for mode in MODES}
#: The entry (in ``modes`` and ``kernel_on``) of a layer whose rows follow different paths in one call: a
#: mixed step of continuous batching (``_mixing``). The forwards' fast exits do not know it; their traced
#: branch tests ``kernel_on`` for it before testing it as a bool.
MIXED: Final = "mixed"

# Scopes. Unset means "no scope active in this context".
_SCOPED: ContextVar[Active] = ContextVar("kernelpolicy.scoped")
# The record_calls() recorders active in this context (read in the slow path only).
RECORDERS: ContextVar[tuple[Any, ...]] = ContextVar("kernelpolicy.recorders", default=())
# True while a reentrant checkpoint runs its forward under no_grad for a caller that had grad enabled:
# autograd will record the recomputation, so a kernel without backward must give way here too (set by
# kernelpolicy.training, read by _dispatch.autograd_records in eager code only).
RECOMPUTED_WITH_GRAD: ContextVar[bool] = ContextVar("kernelpolicy.recomputed_with_grad", default=False)
#: ``check(policy)``, called by a scope's entry and ``set_default_policy`` before ``policy`` takes effect
#: (so a check that warns or raises leaves the policy in effect as it was). Features append and remove
#: their checks; an empty list costs a scope entry one truth test.
POLICY_CHECKS: list[Callable[[Policy], None]] = []


@final
class _Entries:
    """An entry for every known kernel layer name, as attributes.

    A forward reads ``active.modes.RMSNorm``: TorchDynamo guards such a read
    on that one attribute's value, where a ``dict.get`` would be guarded on
    the whole dict and a fallback to the default on how the mode was derived.
    Entries are written when a name becomes known and never change.
    """


@final
class Active:
    """The policy in effect as a forward reads it (one interned object per policy and recording state).

    ``modes``: each known layer's mode, or its recording twin (see
    :data:`RECORDED`) while ``record_calls()`` is active; read by eager
    calls. ``variants``: the layer's variant entry (``"kernel:a|b"``) or
    ``""``, read under TorchDynamo by layers with variants (recording is not
    part of it, as it is not of the two below). ``kernel_on`` (the mode is not ``disable``) and ``required`` (it
    is ``require``): read under TorchDynamo, where they are all a traced
    program depends on, so policies that spell one program differently share
    its compiled graph (see ``_dispatch``). ``policy`` is the value the
    public API returns; recording is not part of it. ``name`` stands for the table's value: tables of one
    (policy, recording) share it for the life of the process, also once the first is gone (:func:`named`
    finds an equal table): traced code reads it as a constant where an object cannot be passed on, and
    TorchDynamo guards it by value, so an equal table made later passes the guard.

    ``mix`` is None, except in the table of a mixed step (:func:`activate_mixed`): there it holds the step's
    policies and rows (a ``_mixing.Members``), ``policy`` is the first of them, and each layer whose entries
    differ between them reads :data:`MIXED`.
    """

    __slots__ = ("__weakref__", "kernel_on", "mix", "modes", "name", "policy", "recording", "required", "variants")

    policy: Policy
    recording: bool
    name: str
    mix: Any
    modes: _Entries
    kernel_on: _Entries
    required: _Entries
    variants: _Entries

    # The scoped Active, or this object when no scope is active. Read it as
    # ``DEFAULTS.active._current`` (see the module docstring).
    _current = property(_SCOPED.get)

    def recorded(self, recording: bool) -> Active:
        """The same policy with call recording switched on or off."""
        return self if recording == self.recording else activate(self.policy, recording)

    def __repr__(self) -> str:
        return f"<Active {self.policy!r}{' recording' if self.recording else ''}>"


_INTERNED: weakref.WeakValueDictionary[tuple[Policy, bool], Active] = weakref.WeakValueDictionary()
_INTERN_LOCK = threading.Lock()
#: The tables alive by name. A plain table's name is made from its value (:func:`_value_name`), so an equal table
#: made once the first is gone gets the same name and nothing is held per value: memory follows the tables in use,
#: not every policy the process has seen. A mixed step's table has a name of its own.
_NAMED: weakref.WeakValueDictionary[str, Active] = weakref.WeakValueDictionary()
_KNOWN_LAYERS: set[str] = set()


def layer_facts(policy: Policy, name: str) -> tuple[str, bool, bool, str]:
    """(entry, kernel on, required, variant entry) of kernel layer ``name`` under ``policy``.

    What an :class:`Active`'s tables hold for the layer; ``_persisted`` compares a persisted program's with them.
    """
    mode = policy.mode_for(name)
    entry = policy.entry_for(name)  # the mode, or the variants a layer entry names
    return entry, mode != "disable", mode == "require", entry if entry != mode else ""


def _mixed_facts(policies: tuple[Policy, ...], name: str) -> tuple[str, bool | str, bool | str, str]:
    """The facts of layer ``name`` in a table for rows of ``policies``: theirs where they agree, else mixed.

    ``required`` is mixed too where a policy requires the layer: traced code that reads it (a layer without a
    kernel that compiles) then raises while tracing, and the eager frame fails those rows only.
    """
    facts = {(layer_facts(policy, name), policy.options) for policy in policies}
    if len(facts) == 1:
        return layer_facts(policies[0], name)
    return MIXED, MIXED, MIXED if any(policy.mode_for(name) == "require" for policy in policies) else False, ""


def _fill(active: Active, names: Iterable[str]) -> None:
    """Write the entries of ``names`` into ``active`` (never overwriting one; called with ``_INTERN_LOCK`` held)."""
    for name in names:
        facts = layer_facts(active.policy, name) if active.mix is None else _mixed_facts(active.mix.policies, name)
        entry, kernel_on, required, variant = facts
        if entry == MIXED:  # recorded per group of rows by the mixed call itself
            active.modes.__dict__.setdefault(name, entry)
        else:
            if entry not in RECORDED:
                RECORDED[entry] = f"{entry}{RECORD_SUFFIX}"
                UNRECORDED[RECORDED[entry]] = entry
            active.modes.__dict__.setdefault(name, RECORDED[entry] if active.recording else entry)
        active.kernel_on.__dict__.setdefault(name, kernel_on)
        active.required.__dict__.setdefault(name, required)
        active.variants.__dict__.setdefault(name, variant)


def _new(policy: Policy, recording: bool, mix: Any = None) -> Active:
    """A new :class:`Active` with the entries of every known layer (called with ``_INTERN_LOCK`` held)."""
    active = object.__new__(Active)
    active.policy = policy
    active.recording = recording
    active.mix = mix
    active.modes, active.kernel_on, active.required, active.variants = _Entries(), _Entries(), _Entries(), _Entries()
    active.name = _value_name(policy, recording) if mix is None else _mixed_name(mix.policies, recording)
    _NAMED[active.name] = active
    _fill(active, _KNOWN_LAYERS)
    return active


def _value_name(policy: Policy, recording: bool) -> str:
    """The name of the tables of ``(policy, recording)``: a digest of the value's content, the same in every process."""
    content = f"{policy!r}{RECORD_SUFFIX if recording else ''}".encode()  # repr: the whole content
    return f"table-{hashlib.blake2b(content, digest_size=12).hexdigest()}"


def _mixed_name(policies: tuple[Policy, ...], recording: bool) -> str:
    """The name of a mixed step's table: a digest of what it holds for every layer, not of which policies it serves.

    Per layer that is known or that a policy names: the facts the policies agree on, or :data:`MIXED` with their
    entries and options; and the policies' defaults and options (what a layer named later will hold). So tables
    serving other policies that spell the same facts share a name, and a compiled program guarded on it serves
    them all, whichever rows each policy has.
    """
    names = sorted(_KNOWN_LAYERS.union(*(policy.layers for policy in policies)))
    facts = []
    for name in names:
        agreed = {(layer_facts(policy, name), policy.options) for policy in policies}
        facts.append((name, sorted(map(repr, agreed)) if len(agreed) > 1 else repr(agreed.pop())))
    defaults = sorted({repr((policy.default, policy.options)) for policy in policies})
    content = repr((facts, defaults, recording)).encode()
    return f"mixed-{hashlib.blake2b(content, digest_size=12).hexdigest()}"


def named(name: str) -> Active:
    """The table named ``name`` (it must be alive: the table in effect where a compiled region began, say).

    Equal tables share a name and :data:`_NAMED` keeps the one made last; once that one is gone, another alive
    (the process default's own, an interned one) is found by looking.
    """
    found = _NAMED.get(name)
    if found is not None:
        return found
    for active in (DEFAULTS.active, *_INTERNED.values(), *_MIXED_TABLES):
        if active.name == name:
            _NAMED[name] = active
            return active
    raise KeyError(f"no table named {name!r} is alive")


def activate(policy: Policy, recording: bool = False) -> Active:
    """The interned :class:`Active` of ``policy``: equal policies give the same object.

    Scopes put these in the ContextVar. The process default is read through a
    separate object (see :class:`_Defaults`).
    """
    key = (policy, recording)
    found = _INTERNED.get(key)
    if found is not None:
        return found
    with _INTERN_LOCK:
        found = _INTERNED.get(key)
        if found is None:
            found = _INTERNED[key] = _new(policy, recording)
        return found


#: The tables of mixed steps alive (their owners keep them), filled as layer names become known.
_MIXED_TABLES: weakref.WeakSet[Active] = weakref.WeakSet()


def activate_mixed(mix: Any, recording: bool = False) -> Active:
    """A new table for one call whose rows follow ``mix.policies`` (at least two; not interned: the caller keeps it).

    A layer whose entries (and options) agree between the policies reads them; the others read :data:`MIXED`,
    which sends their calls to ``_mixing.run_mixed``.
    """
    with _INTERN_LOCK:
        active = _new(mix.policies[0], recording, mix)
        _MIXED_TABLES.add(active)
        return active


def register_layer_name(name: str) -> None:
    """Make ``name`` resolvable as ``active.modes.<name>`` in every :class:`Active`, now and later."""
    if name in _KNOWN_LAYERS:
        return
    with _INTERN_LOCK:
        if name not in _KNOWN_LAYERS:
            for active in [*_INTERNED.values(), *_MIXED_TABLES, DEFAULTS.active]:
                _fill(active, (name,))
            _KNOWN_LAYERS.add(name)


_KNOWN_VARIANTS: dict[str, set[str]] = {}


def register_variant(layer_name: str, variant: str) -> None:
    """Record that a kernel variant ``variant`` is bound for ``layer_name`` somewhere in this process (or that
    programs loaded here were saved with it: ``artifacts.load_per_policy``)."""
    with _INTERN_LOCK:
        _KNOWN_VARIANTS.setdefault(layer_name, set()).add(variant)


def any_variant(name: str) -> bool:
    """Whether a kernel variant ``name`` is bound for any layer in this process."""
    return any(name in names for names in list(_KNOWN_VARIANTS.values()))


def known_variants(layer_name: str) -> frozenset[str]:
    """The kernel variant names bound for ``layer_name`` so far in this process."""
    return frozenset(_KNOWN_VARIANTS.get(layer_name, ()))


def known_layers() -> frozenset[str]:
    """The kernel layer names of every policy-aware layer bound so far in this process.

    A policy entry for a name not in here reaches no layer yet (see also
    ``explain(model).unmatched``).

    >>> import torch, kernelpolicy
    >>> @kernelpolicy.use_kernel_forward_from_hub("Triple")
    ... class Triple(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 3 * x
    >>> _ = Triple()
    >>> "Triple" in kernelpolicy.introspect.known_layers()
    True
    """
    return frozenset(_KNOWN_LAYERS)


@final
class _Defaults:
    """The process-wide part of the state (one instance, :data:`DEFAULTS`).

    ``active`` is what unscoped code sees: the resolved ``explicit`` or ``env``
    policy or the built-in ``prefer``. It is an :class:`Active` of its own,
    never the interned one a scope puts in the ContextVar, so that a scope
    equal to the default still reads another object than the property's
    owner: TorchDynamo guards a read that returns its owner on identity
    (``DEFAULTS.active is DEFAULTS.active._current``), which every scope
    fails, and a read that returns another object on its attribute values,
    which the default passes too. So a program compiled under any scope,
    also one equal to the default, serves unscoped calls.

    ``traced`` is the innermost scope entered inside a region TorchDynamo compiles (see
    :class:`TracedFrame`); outside one it is None.
    """

    __slots__ = ("active", "env", "env_loaded", "explicit", "lock", "traced")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Active = _new(BUILTIN, False)
        self.traced: TracedFrame | None = None
        self.explicit: Policy | None = None
        self.env: Policy | None = None
        self.env_loaded = False

    def set(self, policy: Policy) -> None:
        """Make ``policy`` the process default (called with :attr:`lock` held)."""
        with _INTERN_LOCK:
            self.active = _new(policy, False)


class TracedFrame(NamedTuple):
    """A scope entered inside a region TorchDynamo compiles, and the one it is nested in.

    TorchDynamo cannot trace ``ContextVar.set``, but it traces writes to a plain object's attributes
    (keeping them as side effects of the compiled program): a scope entered while tracing writes
    ``DEFAULTS.traced``, the forwards' traced branch reads it first (:func:`in_effect`), and the scope's
    exit restores it, so the program ends with it as it began (None).
    """

    scope: object
    active: Active
    enclosing: TracedFrame | None
    #: What ``active`` was resolved from: the table's name where the region began, then each scope's value.
    chain: tuple[Any, ...]


DEFAULTS = _Defaults()


def in_effect() -> Active:
    """The :class:`Active` in effect: a scope entered in the compiled region being traced, else the scoped or default one.

    The forwards' eager branch reads ``DEFAULTS.active._current`` directly (nothing is traced there).
    """
    traced = DEFAULTS.traced
    return DEFAULTS.active._current if traced is None else traced.active


def _after_fork_in_child() -> None:
    """A forked child starts with fresh locks: one another thread held at fork time is never released there."""
    global _INTERN_LOCK
    _INTERN_LOCK = threading.Lock()
    DEFAULTS.lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


def ensure_env() -> None:
    """Read ``KERNELPOLICY`` once, at the first use of the public API.

    An empty or unset variable means the built-in ``prefer``. A malformed one
    raises :class:`PolicyError` naming the variable, the bad token and the
    valid modes (and is read again at the next use, so a fixed value works).
    """
    if DEFAULTS.env_loaded:
        return
    with DEFAULTS.lock:
        if DEFAULTS.env_loaded:
            return
        text = os.environ.get(ENV_VAR, "")
        env = Policy.parse(text, source=ENV_VAR) if text.strip() else None
        DEFAULTS.env = env
        if DEFAULTS.explicit is None:
            DEFAULTS.set(env if env is not None else BUILTIN)
        DEFAULTS.env_loaded = True


def reload_env() -> Policy | None:
    """Forget the cached ``KERNELPOLICY`` value and read it again (for tests and tools)."""
    with DEFAULTS.lock:
        DEFAULTS.env_loaded = False
        DEFAULTS.env = None
        if DEFAULTS.explicit is None:
            DEFAULTS.set(BUILTIN)
    ensure_env()
    return DEFAULTS.env


def current_policy() -> Policy:
    """The policy in effect in this thread or task.

    The innermost active scope, else the process default.

    >>> import kernelpolicy
    >>> with kernelpolicy.kernel_policy(RMSNorm="disable"):
    ...     kernelpolicy.current_policy().mode_for("RMSNorm")
    'disable'
    """
    ensure_env()
    return in_effect().policy

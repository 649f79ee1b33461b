"""Policy values and the state that holds the one in effect.

This module owns:

- the modes (``prefer``, ``disable``, ``require``) and their validation;
- :class:`Policy`, an immutable, hashable, interned value: a default mode plus
  per-layer modes keyed by kernel layer name;
- the text syntax shared by the ``KERNELPOLICY`` variable and
  :meth:`Policy.parse` (``"prefer,RMSNorm=disable,SiLU=require"``);
- the state: one :class:`contextvars.ContextVar` for scoped policies and one
  process-wide default (``set_default_policy`` or ``KERNELPOLICY`` or the
  built-in ``prefer``).

How the policy in effect is read (the hot path does exactly this)::

    DEFAULTS.policy._current

``_current`` is ``property(_SCOPED.get)``: the ContextVar's builtin ``get``
called with the process default as its own fallback, so an unset variable
yields the process default itself. TorchDynamo traces this read without a
graph break and guards on it, which is what makes a compiled model honour the
caller's scope (see ``_dispatch``).
"""

from __future__ import annotations

import os
import threading
import weakref
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, cast, final

from ._errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = ["ENV_VAR", "MODES", "Mode", "Policy", "current_policy", "known_layers"]

Mode = Literal["prefer", "disable", "require", "verify"]
#: The valid modes, in the order error messages list them.
MODES: tuple[Mode, ...] = ("prefer", "disable", "require", "verify")
OnMismatch = Literal["raise", "warn"]
#: Keyword arguments of a policy that are options of ``verify``, not layer names.
VERIFY_OPTIONS = ("atol", "rtol", "on_mismatch")
#: What a policy's table holds for a mode while calls are recorded: a value the
#: forward's fast exits do not know, so every call takes the slow path that records.
RECORDING: dict[str, str] = {mode: f"{mode}+record" for mode in MODES}
PLAIN: dict[str, Mode] = {f"{mode}+record": mode for mode in MODES}
#: The environment variable read once, at the first use of the library.
ENV_VAR = "KERNELPOLICY"

_VALID = ", ".join(repr(m) for m in MODES)
_FORBIDDEN_IN_NAMES = frozenset(",= \t\r\n")

# (default, sorted layer modes, verify options, recording)
_Verify = tuple[float | None, float | None, str]
_Key = tuple[Mode, tuple[tuple[str, Mode], ...], _Verify, bool]
NO_OPTIONS: _Verify = (None, None, "raise")

# Scoped policies. Unset means "no scope active in this context".
_SCOPED: ContextVar[Policy] = ContextVar("kernelpolicy.scoped")
# The record_calls() recorders active in this context (read in the slow path only).
RECORDERS: ContextVar[tuple[Any, ...]] = ContextVar("kernelpolicy.recorders", default=())


def check_mode(value: object, what: str) -> Mode:
    """Return ``value`` as a canonical mode or raise :class:`PolicyError` naming it."""
    if isinstance(value, str):
        for mode in MODES:
            if value == mode:
                return mode
        raise PolicyError(f"unknown kernel policy mode {value!r} for {what}; valid modes are {_VALID}")
    if value is None:
        raise PolicyError(f"a mode is required for {what}, got None; valid modes are {_VALID}")
    raise PolicyError(
        f"a mode must be a string, got {value!r} ({type(value).__name__}) for {what}; valid modes are {_VALID}"
    )


def check_layer_name(name: object) -> str:
    """Return ``name`` if it is a usable kernel layer name, else raise :class:`PolicyError`."""
    if not isinstance(name, str):
        raise PolicyError(f"a kernel layer name must be a string, got {name!r} ({type(name).__name__})")
    if not name:
        raise PolicyError("a kernel layer name must not be empty")
    if name in VERIFY_OPTIONS:
        raise PolicyError(f"{name!r} is an option of 'verify', not a kernel layer name")
    if name.startswith("__"):
        raise PolicyError(f"kernel layer name {name!r} starts with '__', which is reserved")
    bad = sorted(set(name) & _FORBIDDEN_IN_NAMES)
    if bad:
        raise PolicyError(
            f"kernel layer name {name!r} contains {', '.join(repr(c) for c in bad)}; "
            "names may not contain commas, '=' or whitespace"
        )
    return name


def check_verify_options(options: Mapping[str, object]) -> dict[str, object]:
    """Validate ``atol``/``rtol``/``on_mismatch`` given to a policy or scope."""
    checked: dict[str, object] = {}
    for name in ("atol", "rtol"):
        if name in options:
            value = options[name]
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    raise PolicyError(f"{name} must be a number >= 0, got {options[name]!r}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise PolicyError(f"{name} must be a number >= 0, got {options[name]!r}")
            checked[name] = float(value)
    if "on_mismatch" in options:
        value = options["on_mismatch"]
        if value not in ("raise", "warn"):
            raise PolicyError(f"on_mismatch must be 'raise' or 'warn', got {value!r}")
        checked["on_mismatch"] = value
    return checked


def split_options(layers: Mapping[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """(layer modes, verify options) from the keyword arguments of a policy or scope."""
    modes = {name: value for name, value in layers.items() if name not in VERIFY_OPTIONS}
    options = {name: value for name, value in layers.items() if name in VERIFY_OPTIONS}
    return modes, check_verify_options(options)


@final
class Policy:
    """An immutable policy: a default mode plus per-layer modes.

    Modes: ``prefer``, ``disable``, ``require`` and ``verify`` (run the kernel
    and the original, compare, return the kernel's output; ``atol``,
    ``rtol`` and ``on_mismatch="raise"|"warn"`` tune it).

    Policies are interned: equal policies are the same object, so comparing
    them is an identity check and a scope equal to the enclosing one never
    looks like a change (to Python or to ``torch.compile``'s guards). Layer
    entries equal to the default are dropped, so ``Policy("prefer",
    RMSNorm="prefer") is Policy("prefer")``.

    >>> from kernelpolicy import Policy
    >>> p = Policy("prefer", RMSNorm="disable")
    >>> p.mode_for("RMSNorm"), p.mode_for("SiLU")
    ('disable', 'prefer')
    >>> p is Policy.parse("RMSNorm=disable, prefer")
    True
    >>> str(p)
    'prefer,RMSNorm=disable'
    >>> Policy("verify", atol=1e-3)
    Policy('verify', atol=0.001)
    """

    __slots__ = (
        "__weakref__",
        "_default",
        "_kernel_on",
        "_key",
        "_logical",
        "_modes",
        "_recording",
        "_required",
        "_table",
        "_verify",
    )

    _default: Mode
    _modes: dict[str, Mode]
    _table: _ModeTable
    _kernel_on: _ModeTable
    _required: _ModeTable
    _verify: _Verify
    _recording: bool
    _logical: Policy
    _key: _Key

    def __new__(cls, default: Mode = "prefer", /, **layers: Any) -> Policy:
        modes, options = split_options(layers)
        return _make(check_mode(default, "the default"), modes, _options(NO_OPTIONS, options))

    # The scoped policy, or this object when no scope is active. Read it as
    # ``DEFAULTS.policy._current`` (see the module docstring).
    _current = property(_SCOPED.get)

    @property
    def default(self) -> Mode:
        """The mode of every layer this policy does not name."""
        return self._default

    @property
    def layers(self) -> Mapping[str, Mode]:
        """The per-layer modes that differ from :attr:`default` (read-only)."""
        return MappingProxyType(self._modes)

    @property
    def atol(self) -> float | None:
        """``verify``'s absolute tolerance (None: by dtype)."""
        return self._verify[0]

    @property
    def rtol(self) -> float | None:
        """``verify``'s relative tolerance (None: by dtype)."""
        return self._verify[1]

    @property
    def on_mismatch(self) -> OnMismatch:
        """What ``verify`` does on a mismatch: ``"raise"`` or ``"warn"``."""
        return cast("OnMismatch", self._verify[2])

    def mode_for(self, layer_name: str) -> Mode:
        """The mode for layers marked with kernel layer name ``layer_name``."""
        return self._modes.get(layer_name, self._default)

    def overlay(
        self, default: Mode | None, layers: Mapping[str, Mode], options: Mapping[str, object] | None = None
    ) -> Policy:
        """This policy with what ``default``, ``layers`` and verify ``options`` name replaced.

        A non-``None`` ``default`` names every layer, so the result ignores
        this policy's modes altogether; otherwise only ``layers`` change.
        Options not given are kept; recording is kept.
        """
        verify = _options(self._verify, options or {})
        if default is not None:
            return _make(default, layers, verify, self._recording)
        if not layers and verify == self._verify:
            return self
        return _make(self._default, {**self._modes, **layers}, verify, self._recording)

    def recorded(self, recording: bool) -> Policy:
        """This policy with call recording switched on or off (see ``record_calls``)."""
        if recording == self._recording:
            return self
        return _from_key((self._key[0], self._key[1], self._key[2], recording))

    @classmethod
    def parse(cls, text: str, *, source: str | None = None) -> Policy:
        """Parse ``"mode"`` or ``"mode,Layer=mode,..."`` (the default mode may be omitted).

        ``atol=``, ``rtol=`` and ``on_mismatch=`` entries set the options of
        ``verify``. ``source`` names where the text came from in error
        messages, e.g. ``"KERNELPOLICY"`` or ``"header X-Kernel-Policy"``.

        >>> Policy.parse("disable,RMSNorm=require")
        Policy('disable', RMSNorm='require')
        >>> Policy.parse("RMSNorm=fast")
        Traceback (most recent call last):
        ...
        kernelpolicy._errors.PolicyError: policy 'RMSNorm=fast': unknown kernel policy mode 'fast' for layer 'RMSNorm'; valid modes are 'prefer', 'disable', 'require', 'verify'
        """
        where = f"{source}={text!r}" if source else f"policy {text!r}"
        if not isinstance(text, str):
            raise PolicyError(f"{where}: a policy must be given as a string, got {type(text).__name__}")
        default: Mode | None = None
        layers: dict[str, Mode] = {}
        options: dict[str, object] = {}
        tokens = text.split(",")
        for position, raw in enumerate(tokens, start=1):
            token = raw.strip()
            try:
                if not token:
                    raise PolicyError(f"empty entry at position {position} (stray comma?)")
                if "=" not in token:
                    if default is not None:
                        raise PolicyError(
                            f"default mode given twice ({default!r} and {token!r}); give at most one bare mode"
                        )
                    default = check_mode(token, "the default")
                    continue
                name, _, mode = (part.strip() for part in token.partition("="))
                if name in layers or name in options:
                    raise PolicyError(f"{'option' if name in options else 'layer'} {name!r} named twice")
                if name in VERIFY_OPTIONS:
                    options.update(check_verify_options({name: mode}))
                    continue
                check_layer_name(name)
                layers[name] = check_mode(mode, f"layer {name!r}")
            except PolicyError as exc:
                detail = str(exc) if _VALID in str(exc) else f"{exc}; valid modes are {_VALID}"
                raise PolicyError(f"{where}: {detail}") from None
        return _make(default if default is not None else "prefer", layers, _options(NO_OPTIONS, options))

    def _option_items(self) -> list[tuple[str, object]]:
        names = ("atol", "rtol", "on_mismatch")
        return [(n, v) for n, v, d in zip(names, self._verify, NO_OPTIONS, strict=True) if v != d]

    def __str__(self) -> str:
        entries = [self._default, *(f"{name}={mode}" for name, mode in self._key[1])]
        return ",".join(entries + [f"{name}={value}" for name, value in self._option_items()])

    def __repr__(self) -> str:
        args = [repr(self._default), *(f"{name}={mode!r}" for name, mode in self._key[1])]
        args += [f"{name}={value!r}" for name, value in self._option_items()]
        return f"Policy({', '.join(args)})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Policy is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Policy is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_from_key, (self._key,))

    def __copy__(self) -> Policy:
        return self

    def __deepcopy__(self, memo: object) -> Policy:
        return self


def _options(base: _Verify, options: Mapping[str, object]) -> _Verify:
    atol = options.get("atol", base[0])
    rtol = options.get("rtol", base[1])
    on_mismatch = options.get("on_mismatch", base[2])
    return (cast("float | None", atol), cast("float | None", rtol), str(on_mismatch))


@final
class _ModeTable:
    """An entry for every known kernel layer name, as attributes.

    Each policy has three: ``_table``, the resolved mode (or its recording
    twin, see :data:`RECORDING`), read by eager calls; ``_kernel_on`` (the mode
    is not ``disable``) and ``_required`` (it is ``require``), read under
    TorchDynamo, where they are all a traced program depends on (see
    ``_dispatch``).

    The hot path reads ``policy._table.RMSNorm``. TorchDynamo guards such a
    read on that one attribute's value, where a ``dict.get`` would be guarded
    on the whole dict and a fallback to the default on how the mode was
    derived. So a compiled model recompiles only when the mode of one of
    *its* layers changes: policies that differ in other layers, or that reach
    the same mode through the default or an explicit entry, share its graphs.

    "Known" names are those of policy-aware layers (:func:`register_layer_name`,
    called when a layer is bound); registering a name adds its resolved mode
    to every live policy's table. Entries never change once written.
    """


_INTERNED: weakref.WeakValueDictionary[_Key, Policy] = weakref.WeakValueDictionary()
_INTERN_LOCK = threading.Lock()
_KNOWN_LAYERS: set[str] = set()


def _entry(mode: Mode, recording: bool) -> str:
    return RECORDING[mode] if recording else mode


def _fill(policy: Policy, names: Iterable[str]) -> None:
    """Write the entries of ``names`` into ``policy``'s tables (never overwriting one)."""
    for name in names:
        mode = policy._modes.get(name, policy._default)
        policy._table.__dict__.setdefault(name, _entry(mode, policy._recording))
        policy._kernel_on.__dict__.setdefault(name, mode != "disable")
        policy._required.__dict__.setdefault(name, mode == "require")


def register_layer_name(name: str) -> None:
    """Make ``name`` resolvable as ``policy._table.<name>`` in every policy, now and later."""
    if name in _KNOWN_LAYERS:
        return
    with _INTERN_LOCK:
        if name not in _KNOWN_LAYERS:
            for policy in list(_INTERNED.values()):
                _fill(policy, (name,))
            _KNOWN_LAYERS.add(name)


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
    >>> "Triple" in kernelpolicy.known_layers()
    True
    """
    return frozenset(_KNOWN_LAYERS)


def _make(default: Mode, layers: Mapping[str, object], verify: _Verify = NO_OPTIONS, recording: bool = False) -> Policy:
    modes: dict[str, Mode] = {}
    for name, mode in layers.items():
        checked = check_mode(mode, f"layer {check_layer_name(name)!r}")
        if checked != default:
            modes[name] = checked
    return _from_key((default, tuple(sorted(modes.items())), verify, recording))


def _from_key(key: _Key) -> Policy:
    found = _INTERNED.get(key)
    if found is not None:
        return found
    recording = key[3]
    logical = _from_key((*key[:3], False)) if recording else None  # before taking the (non-reentrant) lock
    with _INTERN_LOCK:
        found = _INTERNED.get(key)
        if found is None:
            found = object.__new__(Policy)
            object.__setattr__(found, "_default", key[0])
            object.__setattr__(found, "_modes", dict(key[1]))
            for table in ("_table", "_kernel_on", "_required"):
                object.__setattr__(found, table, _ModeTable())
            object.__setattr__(found, "_verify", key[2])
            object.__setattr__(found, "_recording", recording)
            object.__setattr__(found, "_logical", logical if logical is not None else found)
            object.__setattr__(found, "_key", key)
            _fill(found, _KNOWN_LAYERS)
            _INTERNED[key] = found
        return found


BUILTIN: Policy = Policy("prefer")


@final
class _Defaults:
    """The process-wide part of the state (one instance, :data:`DEFAULTS`)."""

    __slots__ = ("env", "env_loaded", "explicit", "lock", "policy")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: What unscoped code sees: ``explicit`` or ``env`` or :data:`BUILTIN`.
        self.policy: Policy = BUILTIN
        self.explicit: Policy | None = None
        self.env: Policy | None = None
        self.env_loaded = False


DEFAULTS = _Defaults()


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
            DEFAULTS.policy = env if env is not None else BUILTIN
        DEFAULTS.env_loaded = True


def reload_env() -> Policy | None:
    """Forget the cached ``KERNELPOLICY`` value and read it again (for tests and tools)."""
    with DEFAULTS.lock:
        DEFAULTS.env_loaded = False
        DEFAULTS.env = None
        if DEFAULTS.explicit is None:
            DEFAULTS.policy = BUILTIN
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
    return cast("Policy", DEFAULTS.policy._current)._logical

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
from typing import TYPE_CHECKING, Literal, cast, final

from ._errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["ENV_VAR", "MODES", "Mode", "Policy", "current_policy"]

Mode = Literal["prefer", "disable", "require"]
#: The valid modes, in the order error messages list them.
MODES: tuple[Mode, ...] = ("prefer", "disable", "require")
#: The environment variable read once, at the first use of the library.
ENV_VAR = "KERNELPOLICY"

_VALID = ", ".join(repr(m) for m in MODES)
_FORBIDDEN_IN_NAMES = frozenset(",= \t\r\n")

_Key = tuple[str, tuple[tuple[str, str], ...]]

# Scoped policies. Unset means "no scope active in this context".
_SCOPED: ContextVar[Policy] = ContextVar("kernelpolicy.scoped")


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
    if name.startswith("__"):
        raise PolicyError(f"kernel layer name {name!r} starts with '__', which is reserved")
    bad = sorted(set(name) & _FORBIDDEN_IN_NAMES)
    if bad:
        raise PolicyError(
            f"kernel layer name {name!r} contains {', '.join(repr(c) for c in bad)}; "
            "names may not contain commas, '=' or whitespace"
        )
    return name


@final
class Policy:
    """An immutable policy: a default mode plus per-layer modes.

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
    """

    __slots__ = ("__weakref__", "_default", "_key", "_modes", "_table")

    _default: Mode
    _modes: dict[str, Mode]
    _table: _ModeTable
    _key: _Key

    def __new__(cls, default: Mode = "prefer", /, **layers: Mode) -> Policy:
        return _make(check_mode(default, "the default"), layers)

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

    def mode_for(self, layer_name: str) -> Mode:
        """The mode for layers marked with kernel layer name ``layer_name``."""
        return self._modes.get(layer_name, self._default)

    def overlay(self, default: Mode | None, layers: Mapping[str, Mode]) -> Policy:
        """This policy with what ``default`` and ``layers`` name replaced.

        A non-``None`` ``default`` names every layer, so the result ignores
        this policy altogether; otherwise only ``layers`` change.
        """
        if default is not None:
            return _make(default, layers)
        if not layers:
            return self
        return _make(self._default, {**self._modes, **layers})

    @classmethod
    def parse(cls, text: str, *, source: str | None = None) -> Policy:
        """Parse ``"mode"`` or ``"mode,Layer=mode,..."`` (the default mode may be omitted).

        ``source`` names where the text came from in error messages, e.g.
        ``"KERNELPOLICY"`` or ``"header X-Kernel-Policy"``.

        >>> Policy.parse("disable,RMSNorm=require")
        Policy('disable', RMSNorm='require')
        >>> Policy.parse("RMSNorm=fast")
        Traceback (most recent call last):
        ...
        kernelpolicy._errors.PolicyError: policy 'RMSNorm=fast': unknown kernel policy mode 'fast' for layer 'RMSNorm'; valid modes are 'prefer', 'disable', 'require'
        """
        where = f"{source}={text!r}" if source else f"policy {text!r}"
        if not isinstance(text, str):
            raise PolicyError(f"{where}: a policy must be given as a string, got {type(text).__name__}")
        default: Mode | None = None
        layers: dict[str, Mode] = {}
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
                check_layer_name(name)
                if name in layers:
                    raise PolicyError(f"layer {name!r} named twice")
                layers[name] = check_mode(mode, f"layer {name!r}")
            except PolicyError as exc:
                detail = str(exc) if _VALID in str(exc) else f"{exc}; valid modes are {_VALID}"
                raise PolicyError(f"{where}: {detail}") from None
        return _make(default if default is not None else "prefer", layers)

    def __str__(self) -> str:
        return ",".join([self._default, *(f"{name}={mode}" for name, mode in self._key[1])])

    def __repr__(self) -> str:
        args = [repr(self._default), *(f"{name}={mode!r}" for name, mode in self._key[1])]
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


@final
class _ModeTable:
    """The resolved mode of every known kernel layer name, as attributes.

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


def register_layer_name(name: str) -> None:
    """Make ``name`` resolvable as ``policy._table.<name>`` in every policy, now and later."""
    if name in _KNOWN_LAYERS:
        return
    with _INTERN_LOCK:
        if name not in _KNOWN_LAYERS:
            for policy in list(_INTERNED.values()):
                policy._table.__dict__.setdefault(name, policy._modes.get(name, policy._default))
            _KNOWN_LAYERS.add(name)


def _make(default: Mode, layers: Mapping[str, object]) -> Policy:
    modes: dict[str, Mode] = {}
    for name, mode in layers.items():
        checked = check_mode(mode, f"layer {check_layer_name(name)!r}")
        if checked != default:
            modes[name] = checked
    return _from_key((default, tuple(sorted(modes.items()))))


def _from_key(key: _Key) -> Policy:
    found = _INTERNED.get(key)
    if found is not None:
        return found
    with _INTERN_LOCK:
        found = _INTERNED.get(key)
        if found is None:
            found = object.__new__(Policy)
            modes = dict(key[1])
            table = _ModeTable()
            table.__dict__.update({name: modes.get(name, key[0]) for name in _KNOWN_LAYERS})
            object.__setattr__(found, "_default", key[0])
            object.__setattr__(found, "_modes", modes)
            object.__setattr__(found, "_table", table)
            object.__setattr__(found, "_key", key)
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
    return cast("Policy", DEFAULTS.policy._current)

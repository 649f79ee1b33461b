"""Policy values: modes, the :class:`Policy` value and its text syntax.

This module owns:

- the modes (``prefer``, ``disable``, ``require``, ``verify``) and their validation;
- :class:`Policy`, a plain immutable value: a default mode, per-layer modes
  keyed by kernel layer name and the options of ``verify``; equal, hashable
  and pickled by content;
- the text syntax shared by the ``KERNELPOLICY`` variable and
  :meth:`Policy.parse` (``"prefer,RMSNorm=disable,SiLU=require"``).

A policy holds no dispatch machinery: what the forwards read, and the state
that says which policy is in effect, are in ``_active``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, final

from ._errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["ENV_VAR", "MODES", "VALID_MODES", "Policy", "PolicyMode"]

PolicyMode = Literal["prefer", "disable", "require", "verify"]
"""What a policy says for a layer. Not ``kernels.Mode``, the flags that
``kernelize(mode=...)`` takes (inference, training, torch_compile)."""
MODES: tuple[PolicyMode, ...] = ("prefer", "disable", "require", "verify")
"""The policy modes, in the order error messages list them."""
OnMismatch = Literal["raise", "warn"]
#: Keyword arguments of a policy that are options of ``verify``, not layer names.
VERIFY_OPTIONS = ("atol", "rtol", "on_mismatch")
#: The environment variable that sets the process default (read in ``_active``).
ENV_VAR = "KERNELPOLICY"

#: The modes as error messages list them.
VALID_MODES = ", ".join(repr(m) for m in MODES)


class VerifyOptions(NamedTuple):
    """The options of ``verify``: tolerances (None: by dtype) and what a mismatch does."""

    atol: float | None = None
    rtol: float | None = None
    on_mismatch: OnMismatch = "raise"


NO_OPTIONS = VerifyOptions()


class _Key(NamedTuple):
    """What a policy is: equality, hashing and pickling use exactly this."""

    default: PolicyMode
    layers: tuple[tuple[str, PolicyMode], ...]  # sorted by name; entries equal to the default dropped
    options: VerifyOptions


#: How much of a text an error message quotes (a policy from an HTTP header can be any size).
SHOWN_CHARS = 200


def _shown(text: object) -> str:
    """``repr(text)``, cut to :data:`SHOWN_CHARS` characters of a long string."""
    if isinstance(text, str) and len(text) > SHOWN_CHARS:
        return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"
    return repr(text)


def check_mode(value: object, what: str) -> PolicyMode:
    """Return ``value`` as a canonical mode or raise :class:`PolicyError` naming it."""
    if isinstance(value, str):
        for mode in MODES:
            if value == mode:
                return mode
        raise PolicyError(f"unknown kernel policy mode {_shown(value)} for {what}; valid modes are {VALID_MODES}")
    if value is None:
        raise PolicyError(f"a mode is required for {what}, got None; valid modes are {VALID_MODES}")
    raise PolicyError(
        f"a mode must be a string, got {_shown(value)} ({type(value).__name__}) for {what}; valid modes are {VALID_MODES}"
    )


def check_layer_name(name: object) -> str:
    """Return ``name`` if it is a usable kernel layer name, else raise :class:`PolicyError`."""
    if not isinstance(name, str):
        raise PolicyError(f"a kernel layer name must be a string, got {_shown(name)} ({type(name).__name__})")
    if not name:
        raise PolicyError("a kernel layer name must not be empty")
    if name in VERIFY_OPTIONS:
        raise PolicyError(f"{_shown(name)} is an option of 'verify', not a kernel layer name")
    if name.startswith("__"):
        raise PolicyError(f"kernel layer name {_shown(name)} starts with '__', which is reserved")
    # What the text syntax cannot carry: separators, any whitespace (str.strip drops Unicode spaces
    # too) and unprintable characters, so that every accepted name round-trips through str and parse.
    bad = sorted({c for c in name if c in ",=" or c.isspace() or not c.isprintable()})
    if bad:
        raise PolicyError(
            f"kernel layer name {_shown(name)} contains {', '.join(repr(c) for c in bad)}; "
            "names may not contain commas, '=', whitespace or unprintable characters"
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
                    raise PolicyError(f"{name} must be a number >= 0, got {_shown(options[name])}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise PolicyError(f"{name} must be a number >= 0, got {_shown(options[name])}")
            checked[name] = float(value)
    if "on_mismatch" in options:
        value = options["on_mismatch"]
        if value not in ("raise", "warn"):
            raise PolicyError(f"on_mismatch must be 'raise' or 'warn', got {_shown(value)}")
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

    A policy is a plain value: two policies with the same modes and options
    are equal and hash alike, however they were written, and a policy pickles
    as its content. Layer entries equal to the default are dropped, so
    ``Policy("prefer", RMSNorm="prefer") == Policy("prefer")``.

    >>> from kernelpolicy import Policy
    >>> p = Policy("prefer", RMSNorm="disable")
    >>> p.mode_for("RMSNorm"), p.mode_for("SiLU")
    ('disable', 'prefer')
    >>> p == Policy.parse("RMSNorm=disable, prefer")
    True
    >>> str(p)
    'prefer,RMSNorm=disable'
    >>> Policy("verify", atol=1e-3)
    Policy('verify', atol=0.001)
    """

    __module__ = "kernelpolicy"  # the public name (see kernelpolicy/__init__.py)

    __slots__ = ("_hash", "_key", "_modes")

    _key: _Key
    _modes: dict[str, PolicyMode]
    _hash: int

    def __new__(cls, default: PolicyMode = "prefer", /, **layers: Any) -> Policy:
        modes, options = split_options(layers)
        return _make(check_mode(default, "the default"), modes, _options(NO_OPTIONS, options))

    @property
    def default(self) -> PolicyMode:
        """The mode of every layer this policy does not name."""
        return self._key.default

    @property
    def layers(self) -> Mapping[str, PolicyMode]:
        """The per-layer modes that differ from :attr:`default` (read-only)."""
        return MappingProxyType(self._modes)

    @property
    def options(self) -> VerifyOptions:
        """The options of ``verify``."""
        return self._key.options

    @property
    def atol(self) -> float | None:
        """``verify``'s absolute tolerance (None: by dtype)."""
        return self._key.options.atol

    @property
    def rtol(self) -> float | None:
        """``verify``'s relative tolerance (None: by dtype)."""
        return self._key.options.rtol

    @property
    def on_mismatch(self) -> OnMismatch:
        """What ``verify`` does on a mismatch: ``"raise"`` or ``"warn"``."""
        return self._key.options.on_mismatch

    def mode_for(self, layer_name: str) -> PolicyMode:
        """The mode for layers marked with kernel layer name ``layer_name``."""
        return self._modes.get(layer_name, self._key.default)

    def overlay(
        self, default: PolicyMode | None, layers: Mapping[str, PolicyMode], options: Mapping[str, object] | None = None
    ) -> Policy:
        """This policy with what ``default``, ``layers`` and verify ``options`` name replaced.

        A non-``None`` ``default`` names every layer, so the result ignores
        this policy's modes altogether; otherwise only ``layers`` change.
        Options not given are kept.

        >>> Policy("disable", SiLU="require").overlay(None, {"RMSNorm": "prefer"})
        Policy('disable', RMSNorm='prefer', SiLU='require')
        """
        verify = _options(self._key.options, options or {})
        if default is not None:
            return _make(default, layers, verify)
        if not layers and verify == self._key.options:
            return self
        return _make(self._key.default, {**self._modes, **layers}, verify)

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
        kernelpolicy.PolicyError: policy 'RMSNorm=fast': unknown kernel policy mode 'fast' for layer 'RMSNorm'; valid modes are 'prefer', 'disable', 'require', 'verify'
        """
        shown = _shown(text)
        where = f"{source}={shown}" if source else f"policy {shown}"
        if not isinstance(text, str):
            raise PolicyError(f"{where}: a policy must be given as a string, got {type(text).__name__}")
        default: PolicyMode | None = None
        layers: dict[str, PolicyMode] = {}
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
                            f"default mode given twice ({default!r} and {_shown(token)}); give at most one bare mode"
                        )
                    default = check_mode(token, "the default")
                    continue
                name, _, mode = (part.strip() for part in token.partition("="))
                if name in layers or name in options:
                    raise PolicyError(f"{'option' if name in options else 'layer'} {_shown(name)} named twice")
                if name in VERIFY_OPTIONS:
                    options.update(check_verify_options({name: mode}))
                    continue
                check_layer_name(name)
                layers[name] = check_mode(mode, f"layer {_shown(name)}")
            except PolicyError as exc:
                raise PolicyError(f"{where}: {exc}") from None
        return _make(default if default is not None else "prefer", layers, _options(NO_OPTIONS, options))

    def _option_items(self) -> list[tuple[str, object]]:
        return [(n, v) for n, v, d in zip(VerifyOptions._fields, self._key.options, NO_OPTIONS, strict=True) if v != d]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Policy):
            return self is other or self._key == other._key
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        entries = [self._key.default, *(f"{name}={mode}" for name, mode in self._key.layers)]
        return ",".join(entries + [f"{name}={value}" for name, value in self._option_items()])

    def __repr__(self) -> str:
        args = [repr(self._key.default), *(f"{name}={mode!r}" for name, mode in self._key.layers)]
        args += [f"{name}={value!r}" for name, value in self._option_items()]
        return f"Policy({', '.join(args)})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Policy is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Policy is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[object, ...]:
        key = self._key
        return (_restore, (key.default, key.layers, tuple(key.options)))

    def __copy__(self) -> Policy:
        return self

    def __deepcopy__(self, memo: object) -> Policy:
        return self


def _options(base: VerifyOptions, options: Mapping[str, object]) -> VerifyOptions:
    return base._replace(**options) if options else base  # type: ignore[arg-type]  # checked by check_verify_options


def _make(default: PolicyMode, layers: Mapping[str, object], options: VerifyOptions = NO_OPTIONS) -> Policy:
    modes: dict[str, PolicyMode] = {}
    for name, mode in sorted(layers.items()):
        checked = check_mode(mode, f"layer {_shown(check_layer_name(name))}")
        if checked != default:
            modes[name] = checked
    policy = object.__new__(Policy)
    key = _Key(default, tuple(modes.items()), options)
    object.__setattr__(policy, "_key", key)
    object.__setattr__(policy, "_modes", modes)
    object.__setattr__(policy, "_hash", hash(key))
    return policy


def _restore(default: object, layers: object, options: object) -> Policy:
    """A pickled policy, checked again (a pickle is data from outside)."""
    if not isinstance(layers, tuple) or not isinstance(options, tuple) or len(options) != len(VerifyOptions._fields):
        raise PolicyError(f"not a pickled Policy: {(default, layers, options)!r}")
    given = {name: value for name, value in zip(VerifyOptions._fields, options, strict=True) if value is not None}
    checked = check_verify_options(given)
    return _make(check_mode(default, "the default"), dict(layers), _options(NO_OPTIONS, checked))


BUILTIN: Policy = Policy("prefer")

"""Policy values: modes, the :class:`Policy` value and its text syntax.

This module owns:

- the modes (``prefer``, ``disable``, ``require``, ``verify``) and their validation;
- :class:`Policy`, a plain immutable value: a default mode, per-layer modes
  keyed by kernel layer name and the options (:data:`OPTIONS`: those of
  ``verify``, and what ``prefer`` does when a kernel raises); equal, hashable
  and pickled by content;
- the text syntax shared by the ``KERNELPOLICY`` variable and
  :meth:`Policy.parse` (``"prefer,RMSNorm=disable,SiLU=require"``);
- variant entries: a layer entry ``"kernel:liger|triton"`` names kernel
  variants (bound with ``kernelize(..., variant="liger")``) in order of
  preference; the first that can run does, else the original forward.

A policy holds no dispatch machinery: what the forwards read, and the state
that says which policy is in effect, are in ``_active``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, cast, final

from ._errors import PolicyError
from ._errors import shown as _shown
from ._exceptions import check_fallback_on as _check_fallback_on

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "DEFAULT_VARIANT",
    "ENV_VAR",
    "MODES",
    "OPTIONS",
    "VALID_MODES",
    "VARIANTS",
    "Policy",
    "PolicyMode",
    "check_entry",
    "options_text",
    "variant_names",
]

PolicyMode = Literal["prefer", "disable", "require", "verify"]
"""What a policy says for a layer. Not ``kernels.Mode``, the flags that
``kernelize(mode=...)`` takes (inference, training, torch_compile)."""
MODES: tuple[PolicyMode, ...] = ("prefer", "disable", "require", "verify")
"""The policy modes, in the order error messages list them."""
OnMismatch = Literal["raise", "warn"]
#: Keyword arguments of a policy that are options, not layer names: ``verify``'s tolerances, what a
#: mismatch does and what it compares with (``reference``: the original forward or a variant); the exception types on which ``prefer`` runs the original when a kernel raises, and after
#: how many such failures a module stops trying its kernel.
OPTIONS = ("atol", "rtol", "on_mismatch", "reference", "fallback_on", "max_failures")
#: The environment variable that sets the process default (read in ``_active``).
ENV_VAR = "KERNELPOLICY"

#: The modes as error messages list them.
VALID_MODES = ", ".join(repr(m) for m in MODES)
#: How a layer entry names kernel variants: ``"kernel:liger|triton"``; ``default`` is the unnamed kernel.
VARIANTS = "kernel:"
#: The name of the kernel bound without a variant name.
DEFAULT_VARIANT = "default"


class PolicyOptions(NamedTuple):
    """The options of a policy.

    ``verify``'s tolerances (None: by dtype; see :data:`Tolerance`) and what a mismatch does;
    ``reference``, what a kernel is compared with: ``"original"`` (what ``verify`` does without it) or a
    variant name; under a variant entry it makes the chosen variant be compared too; ``fallback_on``, the exception
    types (names) on which ``prefer`` runs the original forward when a kernel raises (empty: the error
    propagates), and ``max_failures``, after how many of those a module stops trying its kernel (None:
    never stops).
    """

    atol: Tolerance = None
    rtol: Tolerance = None
    on_mismatch: OnMismatch = "raise"
    reference: str | None = None
    fallback_on: tuple[str, ...] = ()
    max_failures: int | None = None


NO_OPTIONS = PolicyOptions()
#: ``Policy()``'s default mode when none is given (None is a bad mode, named in the error).
_NOT_GIVEN: Final = cast("PolicyMode", object())


class _Key(NamedTuple):
    """What a policy is: equality, hashing and pickling use exactly this."""

    default: PolicyMode
    layers: tuple[
        tuple[str, str], ...
    ]  # sorted by name: a mode or a variant entry; entries equal to the default dropped
    options: PolicyOptions


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


def check_entry(value: object, what: str) -> str:
    """A layer entry: a mode, or variants ``"kernel:name|name"`` (canonical: names once each, in order)."""
    if isinstance(value, str) and value.startswith(VARIANTS):
        names: list[str] = []
        for raw in value[len(VARIANTS) :].split("|"):
            name = raw.strip()
            if not name.isidentifier() or name in MODES:
                raise PolicyError(
                    f"variant {_shown(name)} in {_shown(value)} for {what}: a variant name is an identifier other "
                    f"than a mode; write 'kernel:liger' or 'kernel:liger|triton' ({DEFAULT_VARIANT!r}: the kernel "
                    "bound without a variant name)"
                )
            if name in names:
                raise PolicyError(f"variant {name!r} named twice in {_shown(value)} for {what}")
            names.append(name)
        return VARIANTS + "|".join(names)
    try:
        return check_mode(value, what)
    except PolicyError as error:
        if isinstance(value, str) and value.isidentifier():
            raise PolicyError(f"{error}; a kernel variant is written {_shown(VARIANTS + value)}") from None
        raise


def variant_names(entry: str) -> tuple[str, ...]:
    """The variants a layer entry names, in order (none for a mode)."""
    return tuple(entry[len(VARIANTS) :].split("|")) if entry.startswith(VARIANTS) else ()


def check_layer_name(name: object) -> str:
    """Return ``name`` if it is a usable kernel layer name, else raise :class:`PolicyError`."""
    if not isinstance(name, str):
        raise PolicyError(f"a kernel layer name must be a string, got {_shown(name)} ({type(name).__name__})")
    if not name:
        raise PolicyError("a kernel layer name must not be empty")
    if name in OPTIONS:
        raise PolicyError(f"{_shown(name)} is a policy option, not a kernel layer name")
    if name == "mode":
        raise PolicyError("'mode' names the mode of every layer (mode='disable', or the bare 'disable'), not a layer")
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


def check_options(options: Mapping[str, object]) -> dict[str, object]:
    """Validate the options (:data:`OPTIONS`) given to a policy or scope."""
    checked: dict[str, object] = {}
    for name in ("atol", "rtol"):
        if name in options:
            checked[name] = _check_tolerance(name, options[name])
    if "on_mismatch" in options:
        value = options["on_mismatch"]
        if value not in ("raise", "warn"):
            raise PolicyError(f"on_mismatch must be 'raise' or 'warn', got {_shown(value)}")
        checked["on_mismatch"] = value
    if "reference" in options:
        value = options["reference"]
        if value is not None and (not isinstance(value, str) or not value.isidentifier() or value in MODES):
            raise PolicyError(
                f"reference must be 'original' or a kernel variant name ({DEFAULT_VARIANT!r}: the kernel bound "
                f"without a variant name), got {_shown(value)}"
            )
        checked["reference"] = value
    if "fallback_on" in options:
        checked["fallback_on"] = _check_fallback_on(options["fallback_on"])
    if "max_failures" in options:
        value = options["max_failures"]
        if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
            value = int(value)  # ASCII digits only: str.isdigit also takes '³' and other digits int() refuses
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PolicyError(f"max_failures must be a whole number >= 1 (or None: never stop), got {_shown(value)}")
        checked["max_failures"] = value
    return checked


#: The dtypes a tolerance may name: torch's names without ``torch.`` (``_verify.DEFAULT_TOLERANCES`` has their defaults).
TOLERANCE_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
#: A tolerance: one number for every dtype, or ``(dtype name, number)`` pairs sorted by name, where the name
#: ``*`` is every dtype not named; None: the defaults by dtype.
Tolerance = float | tuple[tuple[str, float], ...] | None


def _check_tolerance(name: str, value: object) -> float | tuple[tuple[str, float], ...]:
    """``atol``/``rtol``: a number >= 0 for every dtype, or per dtype (a mapping, or text ``1e-4|bfloat16:2e-2``)."""
    form = (
        f"{name} must be a number >= 0, or numbers per dtype: {name}={{'bfloat16': 2e-2, '*': 1e-4}} "
        f"(text: {name}=1e-4|bfloat16:2e-2); dtypes: {', '.join(TOLERANCE_DTYPES)}"
    )
    if isinstance(value, str) and ("|" in value or ":" in value):
        pairs: list[tuple[object, object]] = []
        for part in value.split("|"):
            named, _, text = part.rpartition(":")
            pairs.append((named.strip() or "*", text.strip()))
    elif isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        pairs = list(value)  # the canonical form (a pickled policy)
    else:
        pairs = [("*", value)]
    per_dtype: dict[str, float] = {}
    for dtype, given in pairs:
        key = str(dtype).removeprefix("torch.")
        if key != "*" and key not in TOLERANCE_DTYPES:
            raise PolicyError(f"{form}; got the dtype {_shown(dtype)}")
        if key in per_dtype:
            raise PolicyError(f"{name} names {key!r} twice")
        number = given
        if isinstance(given, str):
            try:
                number = float(given)
            except ValueError:
                raise PolicyError(f"{form}; got {_shown(value)}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0:
            raise PolicyError(f"{form}; got {_shown(value)}")
        per_dtype[key] = float(number)
    if list(per_dtype) == ["*"]:
        return per_dtype["*"]
    return tuple(sorted(per_dtype.items()))


def split_options(layers: Mapping[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """(layer modes, options) from the keyword arguments of a policy or scope."""
    modes = {name: value for name, value in layers.items() if name not in OPTIONS}
    options = {name: value for name, value in layers.items() if name in OPTIONS}
    return modes, check_options(options)


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

    __slots__ = ("_hash", "_key", "_modes", "_names_variants", "_options_text", "_variants")

    _key: _Key
    _options_text: str  # options_text(options); traced code passes it on (see _traced._value)
    _modes: dict[str, str]
    _hash: int
    _variants: tuple[tuple[str, tuple[str, ...]], ...]  # (layer, variant names) of the variant entries
    _names_variants: bool  # variant entries, or a reference that is a variant: scopes check they are bound

    def __new__(cls, default: PolicyMode = _NOT_GIVEN, /, **layers: Any) -> Policy:
        if "mode" in layers:  # as in kernel_policy(mode=...): the mode of every layer
            layers = dict(layers)
            keyword = layers.pop("mode")
            if default is not _NOT_GIVEN:
                raise PolicyError(f"Policy got its mode twice: {default!r} (positional) and mode={keyword!r}")
            default = keyword
        modes, options = split_options(layers)
        mode = "prefer" if default is _NOT_GIVEN else default
        return _make(check_mode(mode, "the default"), modes, _options(NO_OPTIONS, options))

    @property
    def default(self) -> PolicyMode:
        """The mode of every layer this policy does not name."""
        return self._key.default

    @property
    def layers(self) -> Mapping[str, str]:
        """The per-layer entries that differ from :attr:`default`: modes or variants (read-only)."""
        return MappingProxyType(self._modes)

    @property
    def variant_entries(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(layer name, variant names)`` of each layer entry that names variants."""
        return self._variants

    @property
    def names_variants(self) -> bool:
        """Whether this policy names kernel variants (layer entries, or the ``reference`` option)."""
        return self._names_variants

    @property
    def options(self) -> PolicyOptions:
        """The options: ``verify``'s, and what ``prefer`` does when a kernel raises."""
        return self._key.options

    @property
    def atol(self) -> Tolerance:
        """``verify``'s absolute tolerance (None: by dtype)."""
        return self._key.options.atol

    @property
    def rtol(self) -> Tolerance:
        """``verify``'s relative tolerance (None: by dtype)."""
        return self._key.options.rtol

    @property
    def on_mismatch(self) -> OnMismatch:
        """What ``verify`` does on a mismatch: ``"raise"`` or ``"warn"``."""
        return self._key.options.on_mismatch

    @property
    def fallback_on(self) -> tuple[str, ...]:
        """The exception types (names) on which ``prefer`` runs the original when a kernel raises."""
        return self._key.options.fallback_on

    @property
    def max_failures(self) -> int | None:
        """After how many ``fallback_on`` failures a module stops trying its kernel (None: never)."""
        return self._key.options.max_failures

    def mode_for(self, layer_name: str) -> PolicyMode:
        """The mode for layers marked with kernel layer name ``layer_name`` (``prefer`` for a variant entry)."""
        entry = self._modes.get(layer_name, self._key.default)
        return "prefer" if entry.startswith(VARIANTS) else entry  # type: ignore[return-value]

    def entry_for(self, layer_name: str) -> str:
        """What this policy says for ``layer_name``: a mode, or its variants (``"kernel:liger|triton"``)."""
        return self._modes.get(layer_name, self._key.default)

    def overlay(
        self, default: PolicyMode | None, layers: Mapping[str, str], options: Mapping[str, object] | None = None
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
        ``verify``; ``fallback_on=RuntimeError|torch.OutOfMemoryError`` and
        ``max_failures=3`` what ``prefer`` does when a kernel raises. ``source`` names where the text came from in error
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
        layers: dict[str, str] = {}
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
                if name == "mode":  # one meaning everywhere: the mode of every layer
                    if default is not None:
                        raise PolicyError(
                            f"default mode given twice ({default!r} and {_shown(token)}); give at most one bare mode"
                        )
                    default = check_mode(mode, "the default")
                    continue
                if name in layers or name in options:
                    raise PolicyError(f"{'option' if name in options else 'layer'} {_shown(name)} named twice")
                if name in OPTIONS:
                    options.update(check_options({name: mode}))
                    continue
                check_layer_name(name)
                layers[name] = check_entry(mode, f"layer {_shown(name)}")
            except PolicyError as exc:
                raise PolicyError(f"{where}: {exc}") from None
        return _make(default if default is not None else "prefer", layers, _options(NO_OPTIONS, options))

    def _option_items(self) -> list[tuple[str, object]]:
        return [(n, v) for n, v, d in zip(PolicyOptions._fields, self._key.options, NO_OPTIONS, strict=True) if v != d]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Policy):
            return self is other or self._key == other._key
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        entries = [self._key.default, *(f"{name}={mode}" for name, mode in self._key.layers)]
        return ",".join(entries + [f"{name}={_option_text(value)}" for name, value in self._option_items()])

    def __repr__(self) -> str:
        args = [repr(self._key.default), *(f"{name}={mode!r}" for name, mode in self._key.layers)]
        args += [f"{name}={_option_repr(value)}" for name, value in self._option_items()]
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


def _option_text(value: object) -> str:
    """An option's value in the text syntax: ``|`` joins names, and per-dtype tolerances as ``dtype:number``."""
    if not isinstance(value, tuple):
        return str(value)
    return "|".join(item if isinstance(item, str) else _dtype_text(*item) for item in value)


def _dtype_text(dtype: str, number: float) -> str:
    return str(number) if dtype == "*" else f"{dtype}:{number}"


def _option_repr(value: object) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return repr(dict(value))
    return repr(value)


def _options(base: PolicyOptions, options: Mapping[str, object]) -> PolicyOptions:
    return base._replace(**options) if options else base  # type: ignore[arg-type]  # checked by check_options


def _make(default: PolicyMode, layers: Mapping[str, object], options: PolicyOptions = NO_OPTIONS) -> Policy:
    modes: dict[str, str] = {}
    for name, mode in sorted(layers.items()):
        checked = check_entry(mode, f"layer {_shown(check_layer_name(name))}")
        if checked != default:
            modes[name] = checked
    policy = object.__new__(Policy)
    key = _Key(default, tuple(modes.items()), options)
    object.__setattr__(policy, "_key", key)
    object.__setattr__(policy, "_modes", modes)
    object.__setattr__(policy, "_hash", hash(key))
    object.__setattr__(policy, "_options_text", "" if options is NO_OPTIONS else options_text(options._asdict()))
    variants = tuple((name, variant_names(entry)) for name, entry in modes.items() if entry.startswith(VARIANTS))
    object.__setattr__(policy, "_variants", variants)
    named = options.reference not in (None, "original", DEFAULT_VARIANT)
    object.__setattr__(policy, "_names_variants", bool(variants) or named)
    return policy


def options_text(options: Mapping[str, object]) -> str:
    """Checked options as text that ``ast.literal_eval`` reads back ("" for none; those equal to the default dropped).

    Code TorchDynamo traces passes options on as this string: a number read from an argument may become a
    symbol when it changes, a string never does.
    """
    given = [(name, value) for name, value in options.items() if value != getattr(NO_OPTIONS, name)]
    return repr(tuple(sorted(given))) if given else ""


def _restore(default: object, layers: object, options: object) -> Policy:
    """A pickled policy, checked again (a pickle is data from outside)."""
    if not isinstance(layers, tuple) or not isinstance(options, tuple) or len(options) != len(PolicyOptions._fields):
        raise PolicyError(f"not a pickled Policy: {(default, layers, options)!r}")
    given = {name: value for name, value in zip(PolicyOptions._fields, options, strict=True) if value is not None}
    checked = check_options(given)
    return _make(check_mode(default, "the default"), dict(layers), _options(NO_OPTIONS, checked))


BUILTIN: Policy = Policy("prefer")

"""What a vLLM request's ``kernel_policy`` says, checked where vLLM admits the request.

This module owns :class:`RequestPolicy` (a request's policy and the vLLM ops it names), :func:`request_policy` (the
``extra_args["kernel_policy"]`` value of a request, parsed by kernelpolicy's own policy syntax: a string such as
``"disable"`` or ``"prefer,rms_norm=disable"``, or a dict ``{"rms_norm": "disable"}``), :func:`op_names` (the names
a policy may give: vLLM's ``CustomOp`` and IR op names) and the admission check that vLLM's input processor runs on
every request (:func:`check_admitted`), so that bad input fails the request that carries it, never a step.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from .._values._errors import PolicyError, shown
from .._values._policy import DEFAULT_VARIANT, NO_OPTIONS, OPTIONS, VARIANTS, Policy, variant_names

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "KEY",
    "SALT_PREFIX",
    "RequestPolicy",
    "admitted_salt",
    "check_admitted",
    "op_names",
    "policy_salt",
    "request_policy",
]

#: The key of ``SamplingParams.extra_args`` (and of the OpenAI server's ``vllm_xargs``) that carries a policy.
KEY = "kernel_policy"
#: The modes a request's policy may give in vLLM, besides variants.
_BUILT = ("prefer", "disable", "require", "verify")


class RequestPolicy(NamedTuple):
    """A request's policy: ``policy``, the ops it names, and whether it gives a default mode. An op a policy
    neither names nor covers by a default it gives runs as vLLM chose."""

    policy: Policy
    named: frozenset[str]
    default_given: bool

    def entry(self, op: str) -> str | None:
        """``prefer``, ``disable`` or a variant entry for ``op``; None where vLLM's own choice stands."""
        if not self.default_given and op not in self.named:
            return None
        return self.policy.entry_for(op)

    def __str__(self) -> str:
        if self.default_given:
            return str(self.policy)
        options = [part for part in str(self.policy).split(",") if part.partition("=")[0] in OPTIONS]
        return ",".join([f"{op}={self.policy.entry_for(op)}" for op in sorted(self.named)] + options)


@functools.lru_cache(maxsize=1)
def op_names() -> frozenset[str]:
    """The op names a request's policy may give: vLLM's ``CustomOp`` names and its IR ops."""
    import vllm.ir.ops
    import vllm.model_executor.layers.activation
    import vllm.model_executor.layers.layernorm
    import vllm.model_executor.layers.rotary_embedding  # noqa: F401  # their CustomOps register on import
    from vllm.ir.op import IrOp
    from vllm.model_executor.custom_op import op_registry

    return frozenset(op_registry) | frozenset(IrOp.registry)


def _valid(names: frozenset[str]) -> str:
    return ", ".join(sorted(names))


@functools.lru_cache(maxsize=256)
def _parsed_text(text: str) -> RequestPolicy:
    where = f"{KEY}={shown(text)}"
    policy = Policy.parse(text, source=KEY)
    named: set[str] = set()
    given = False
    for token in text.split(","):
        name, equals, _ = (part.strip() for part in token.partition("="))
        if not equals or name == "mode":
            given = True
        elif name not in OPTIONS:
            named.add(name)
    return _checked(RequestPolicy(policy, frozenset(named), given), where)


def request_policy(value: object) -> RequestPolicy | None:
    """The policy a request's ``extra_args["kernel_policy"]`` gives (None: no policy, vLLM's own choice).

    A string in kernelpolicy's policy syntax, or a dict of entries (``"mode"`` for the default). Bad input raises
    :class:`~kernelpolicy.PolicyError` naming the value and the valid ones.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return _parsed_text(value)
    if isinstance(value, dict):
        return _parsed_dict(value)
    raise PolicyError(
        f"{KEY}={shown(value)}: a request's kernel policy is a string (such as 'disable' or 'rms_norm=disable') or "
        f"a dict of op entries (such as {{'rms_norm': 'disable'}}), not {type(value).__name__}"
    )


def _parsed_dict(value: Mapping[Any, Any]) -> RequestPolicy:
    where = f"{KEY}={shown(value)}"
    bad = [key for key in value if not isinstance(key, str)]
    if bad:
        raise PolicyError(f"{where}: op names are strings, got {shown(bad[0])}")
    try:
        policy = Policy(**value)
    except PolicyError as exc:
        raise PolicyError(f"{where}: {exc}") from None
    given = "mode" in value
    named = frozenset(key for key in value if key != "mode" and key not in OPTIONS)
    return _checked(RequestPolicy(policy, named, given), where)


def _checked(found: RequestPolicy, where: str) -> RequestPolicy:
    """``found`` if vLLM can serve it: op names vLLM has, modes built so far, variants of IR ops naming providers
    this platform supports, no option but ``fallback_on``."""
    policy, names = found.policy, op_names()
    unknown = sorted((set(policy.layers) | found.named) - names)
    if unknown:
        raise PolicyError(f"{where}: vLLM has no op {shown(unknown[0])}; the ops a policy names are {_valid(names)}")
    modes = [("the default", policy.default)] + [(f"op {shown(op)}", entry) for op, entry in policy.layers.items()]
    for what, entry in modes:
        if entry.startswith(VARIANTS):
            _check_variants(what, entry, where)
        elif entry not in _BUILT:
            raise PolicyError(
                f"{where}: {shown(entry)} for {what} is not built for vLLM yet; a request's policy in vLLM gives "
                f"{' or '.join(repr(mode) for mode in _BUILT)}, or an IR op's providers as variants "
                f"(such as 'rms_norm=kernel:vllm_c')"
            )
    if policy.options._replace(fallback_on=()) != NO_OPTIONS:
        others = ", ".join(option for option in OPTIONS if option != "fallback_on")
        raise PolicyError(f"{where}: policy options other than fallback_on ({others}) are not built for vLLM yet")
    return found


def _check_variants(what: str, entry: str, where: str) -> None:
    """A variant entry for ``what`` (``op 'rms_norm'``) names providers of that IR op, one of them supported here."""
    from vllm.ir.op import IrOp

    op = what.removeprefix("op ").strip("'")
    ir_op = IrOp.registry.get(op)
    if ir_op is None:
        raise PolicyError(
            f"{where}: {shown(entry)} for {what}: variants name an IR op's providers, and {op!r} is not an IR op "
            f"(IR ops: {_valid(frozenset(IrOp.registry))})"
        )
    supported = [name for name in ir_op.supported_providers() if name != "native"]
    names = variant_names(entry)
    bad = [name for name in names if name != DEFAULT_VARIANT and name not in ir_op.impls]
    if bad or not any(name == DEFAULT_VARIANT or name in supported for name in names):
        problem = f"no provider {bad[0]!r}" if bad else "none of these providers on this platform"
        raise PolicyError(
            f"{where}: {shown(entry)} for {what}: IR op {op!r} has {problem}; its providers here are "
            f"{', '.join(map(repr, supported)) or 'none but native'} ({DEFAULT_VARIANT!r}: the op's kernel; "
            "'native' is its original: write 'disable')"
        )


def check_admitted(params: Any) -> RequestPolicy | None:
    """The policy the request's ``SamplingParams`` carry (None: none); a bad one raises a :class:`PolicyError` that
    is also vLLM's ``VLLMValidationError``, so that ``vllm serve`` answers it with a 400 on every route."""
    extra = getattr(params, "extra_args", None)
    if not extra or KEY not in extra:
        return None
    try:
        return request_policy(extra[KEY])
    except PolicyError as error:
        raise _validation_error()(str(error)) from None


#: How every salt kernelpolicy gives starts; a request without a policy may not give one (refused), so that no
#: request shares the prefix-cache blocks of a policy it does not carry.
SALT_PREFIX: Final = "kernelpolicy:"


def policy_salt(policy: str, salt: str | None = None) -> str:
    """The ``cache_salt`` of a request of ``policy`` (its canonical text) whose client gave ``salt`` (or none):
    :data:`SALT_PREFIX`, a digest of the policy, and a digest of the client's salt; 78 characters at most, the
    same for the same policy and salt, so that requests of one policy still share their blocks.

    >>> policy_salt("rms_norm=disable")
    'kernelpolicy:aed12251edbdbc2e7547ebfc78ff3b41'
    """
    found = SALT_PREFIX + hashlib.sha256(policy.encode()).hexdigest()[:32]
    return found if salt is None else f"{found}:{hashlib.sha256(salt.encode()).hexdigest()[:32]}"


def admitted_salt(policy: RequestPolicy | None, salt: str | None) -> str | None:
    """The ``cache_salt`` an admitted request gets (its policy's, combined with its client's); a client salt with
    :data:`SALT_PREFIX` on a request without a policy is refused (the error of :func:`check_admitted`)."""
    if policy is not None:
        return policy_salt(str(policy), salt)
    if salt is not None and salt.startswith(SALT_PREFIX):
        raise _validation_error()(
            f"cache_salt {shown(salt)} starts with {SALT_PREFIX!r}, which kernelpolicy keeps for the salts of "
            "requests that carry a kernel policy; give a salt that does not"
        )
    return salt


@functools.cache
def _validation_error() -> type[PolicyError]:
    """A :class:`PolicyError` that is also vLLM's ``VLLMValidationError`` (made where vLLM is imported)."""
    from vllm.exceptions import VLLMValidationError

    class RequestPolicyError(PolicyError, VLLMValidationError):  # type: ignore[misc, unused-ignore]  # Any without vLLM
        """A request's bad kernel policy (or reserved salt): kernelpolicy's error, and a 400 in ``vllm serve``."""

        __module__ = "kernelpolicy.vllm"

        def __init__(self, message: str) -> None:
            VLLMValidationError.__init__(self, message, parameter=f"extra_args.{KEY}")

    return RequestPolicyError

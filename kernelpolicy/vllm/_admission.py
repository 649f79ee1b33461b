"""What a vLLM request's ``kernel_policy`` says, checked where vLLM admits the request.

This module owns :class:`RequestPolicy` (a request's policy and the vLLM ops it names), :func:`request_policy` (the
``extra_args["kernel_policy"]`` value of a request, parsed by kernelpolicy's own policy syntax: a string such as
``"disable"`` or ``"prefer,rms_norm=disable"``, or a dict ``{"rms_norm": "disable"}``), :func:`op_names` (the names
a policy may give: vLLM's ``CustomOp`` and IR op names) and the admission check that vLLM's input processor runs on
every request (:func:`check_admitted`), so that bad input fails the request that carries it, never a step.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

from .._values._errors import PolicyError, shown
from .._values._policy import OPTIONS, Policy

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["KEY", "RequestPolicy", "check_admitted", "op_names", "request_policy"]

#: The key of ``SamplingParams.extra_args`` (and of the OpenAI server's ``vllm_xargs``) that carries a policy.
KEY = "kernel_policy"
#: The modes a request's policy may give in vLLM so far (``require`` and ``verify`` are not built yet).
_BUILT = ("prefer", "disable")


class RequestPolicy(NamedTuple):
    """A request's policy: ``policy``, the ops it names, and whether it gives a default mode. An op a policy
    neither names nor covers by a default it gives runs as vLLM chose."""

    policy: Policy
    named: frozenset[str]
    default_given: bool

    def entry(self, op: str) -> str | None:
        """``prefer`` or ``disable`` for ``op``; None where vLLM's own choice stands."""
        if not self.default_given and op not in self.named:
            return None
        return self.policy.entry_for(op)

    def __str__(self) -> str:
        if self.default_given:
            return str(self.policy)
        return ",".join(f"{op}={self.policy.entry_for(op)}" for op in sorted(self.named))


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
    """``found`` if vLLM can serve it: op names vLLM has, modes built so far, no options yet."""
    policy, names = found.policy, op_names()
    unknown = sorted((set(policy.layers) | found.named) - names)
    if unknown:
        raise PolicyError(f"{where}: vLLM has no op {shown(unknown[0])}; the ops a policy names are {_valid(names)}")
    modes = [("the default", policy.default)] + [(f"op {shown(op)}", entry) for op, entry in policy.layers.items()]
    for what, entry in modes:
        if entry not in _BUILT:
            raise PolicyError(
                f"{where}: {shown(entry)} for {what} is not built for vLLM yet; a request's policy in vLLM gives "
                f"{' or '.join(repr(mode) for mode in _BUILT)}"
            )
    if policy.options != Policy().options:
        raise PolicyError(f"{where}: policy options ({', '.join(OPTIONS)}) are not built for vLLM yet")
    return found


def check_admitted(params: Any) -> RequestPolicy | None:
    """Raise :class:`~kernelpolicy.PolicyError` where the request's ``SamplingParams`` carry a bad policy."""
    extra = getattr(params, "extra_args", None)
    if not extra or KEY not in extra:
        return None
    return request_policy(extra[KEY])

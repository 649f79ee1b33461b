"""Who may choose a policy on ``python -m kernelpolicy serve``: the operator's rules for the ``X-Kernel-Policy`` header.

This module owns :class:`Access`. The set of policies a client may choose is the union of:

- **the server's default policy** (what a request without the header gets): asking for it changes nothing;
- **whole policies** the operator lists (``--allow-policy TEXT``, repeatable): exactly those, compared as
  values (``RMSNorm=disable`` is ``prefer,RMSNorm=disable``), with any modes, variants and options; the arms
  of an A/B test;
- **modes** (``--allow-modes``, default ``prefer,disable``): any policy whose default and layer entries are
  all among these modes, naming no variant and no option (``atol``, ``fallback_on``, ``max_failures``, ...).

The default lets a client turn a kernel off for its own request and nothing more: ``verify`` runs both paths
(about 1.8x the cost), ``require`` fails requests on purpose, a variant picks code the operator may not have
warmed up, and ``fallback_on``/``max_failures`` change failure counts the whole process shares (a client could
switch a kernel off for everyone). ``--ignore-policy-header`` makes the server not read the header at all.

A header value is bounded before it is parsed: :data:`MAX_HEADER` bytes, ASCII, :data:`MAX_ENTRIES` entries;
after, :data:`MAX_VARIANTS` variants per layer. Metrics label a request with :meth:`Access.label`, which takes
its values from the operator's set only (a client cannot create new series).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Final, cast

from .._values._errors import PolicyError
from .._values._policy import MODES, NO_OPTIONS, Policy, PolicyMode

__all__ = ["Access"]

#: The request header that chooses a request's policy.
HEADER: Final = "X-Kernel-Policy"
#: The longest header value taken (longer: 400); a policy is a few dozen characters.
MAX_HEADER: Final = 1024
#: The most comma-separated entries a header value may have (modes, layers and options).
MAX_ENTRIES: Final = 32
#: The most variants one layer entry of a header may name (``kernel:a|b|c|d``).
MAX_VARIANTS: Final = 4
#: The modes a client may set when the operator says nothing: a kernel on or off, for its own request.
SAFE_MODES: Final = ("prefer", "disable")
#: The metrics label of an allowed policy that is not in the operator's list (bounded label sets).
OTHER: Final = "other"


@dataclasses.dataclass(frozen=True)
class Access:
    """The operator's rules: whether the header is read, and which policies a client may choose."""

    header: bool = True
    modes: tuple[PolicyMode, ...] = SAFE_MODES
    policies: tuple[Policy, ...] = ()

    @classmethod
    def from_options(cls, modes: str | None, policies: list[str], *, ignore_header: bool = False) -> Access:
        """The rules of the command's options (``--allow-modes``, ``--allow-policy``, ``--ignore-policy-header``)."""
        chosen: tuple[PolicyMode, ...] = SAFE_MODES
        if modes is not None:
            names = [name.strip() for name in modes.split(",")]
            if names == ["none"]:
                chosen = ()
            else:
                unknown = [name for name in names if name not in MODES]
                if unknown:
                    raise PolicyError(
                        f"--allow-modes {modes!r}: unknown mode {unknown[0]!r}; give modes among "
                        f"{', '.join(map(repr, MODES))}, comma-separated, or 'none'"
                    )
                chosen = tuple(dict.fromkeys(cast("list[PolicyMode]", names)))
        allowed = tuple(Policy.parse(text, source="--allow-policy") for text in policies)
        return cls(header=not ignore_header, modes=chosen, policies=tuple(dict.fromkeys(allowed)))

    def to_json(self) -> str:
        return json.dumps({"header": self.header, "modes": self.modes, "policies": [str(p) for p in self.policies]})

    @classmethod
    def from_json(cls, text: str) -> Access:
        data = json.loads(text)
        return cls(
            header=bool(data["header"]),
            modes=tuple(data["modes"]),
            policies=tuple(Policy.parse(p) for p in data["policies"]),
        )

    def parse(self, value: bytes) -> Policy:
        """The policy of a raw header value; :class:`PolicyError` naming what is wrong (a 400)."""
        if len(value) > MAX_HEADER:
            raise PolicyError(f"header {HEADER} is {len(value)} bytes long; at most {MAX_HEADER} are taken")
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            raise PolicyError(f"header {HEADER} must be ASCII text, got {value[:100]!r}") from None
        entries = text.count(",") + 1
        if entries > MAX_ENTRIES:
            raise PolicyError(f"header {HEADER} has {entries} entries; at most {MAX_ENTRIES} are taken")
        policy = Policy.parse(text, source=f"header {HEADER}")
        for layer, names in policy.variant_entries:
            if len(names) > MAX_VARIANTS:
                raise PolicyError(
                    f"header {HEADER} names {len(names)} variants for layer {layer!r}; at most {MAX_VARIANTS} are taken"
                )
        return policy

    def refusal(self, policy: Policy, default: Policy) -> str | None:
        """Why a client may not choose ``policy`` (a 403 naming the allowed set), or None if it may."""
        if policy == default or policy in self.policies or self._by_modes(policy):
            return None
        return f"policy {str(policy)!r} (header {HEADER}) is not allowed on this server; {self.describe(default)}"

    def _by_modes(self, policy: Policy) -> bool:
        entries = [policy.default, *policy.layers.values()]
        return policy.options == NO_OPTIONS and all(entry in self.modes for entry in entries)

    def describe(self, default: Policy) -> str:
        """The allowed set, in words (error messages and the server's start-up log)."""
        if not self.header:
            return f"the {HEADER} header is ignored: every request runs under the server's default {str(default)!r}"
        modes = (
            f"modes {', '.join(map(repr, dict.fromkeys(self.modes)))} for the default and any layer (no variants, "
            "no options)"
            if self.modes
            else "no mode by itself"
        )
        listed = "".join(f", {str(p)!r}" for p in dict.fromkeys(self.policies) if p != default)  # each named once
        return f"allowed: {modes}; the policies {str(default)!r} (the default){listed}"

    def label(self, policy: Policy, default: Policy) -> str:
        """The policy's metrics label: its text if the operator named it (the default, a listed policy, or an
        allowed mode alone), else :data:`OTHER`; a bounded set whatever clients send."""
        named = (default, *self.policies, *(Policy(mode) for mode in self.modes))
        return str(policy) if policy in named else OTHER

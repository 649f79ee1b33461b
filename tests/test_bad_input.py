"""Every malformed policy input is a PolicyError naming the bad value (issue 33, findings 5 and 7).

Hypothesis writes the input: arbitrary text (Unicode digits, separators and spaces included) and texts built
from the policy grammar's own pieces, for ``Policy.parse``; arbitrary keyword names and values for
``kernel_policy`` and ``Policy``. What is accepted round-trips through ``str``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernelpolicy as kp
from kernelpolicy._context import _active

PIECES = [
    "prefer", "disable", "require", "verify", "mode", "RMSNorm", "SiLU", "kernel:fast", "kernel:a|b", "=", ",",
    "|", " ", "\u00a0", "\u2003", "³", "٣", "\uff11", "1", "0", "-1", "1e-3", "nan", "inf", "atol", "rtol",
    "on_mismatch", "warn", "raise", "reference", "original", "fallback_on", "RuntimeError", "torch.OutOfMemoryError",
    "torch.OutOfMemoryErrr", "max_failures", "bfloat16:2e-2", "*:1e-4", "__x", "\x00", "\n",
]  # fmt: skip
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parses_or_refuses(text: str) -> None:
    try:
        policy = kp.Policy.parse(text)
    except kp.PolicyError:
        return
    assert kp.Policy.parse(str(policy)) == policy


@FUZZ
@given(st.text())
def test_parse_of_arbitrary_text(text: str) -> None:
    _parses_or_refuses(text)


@FUZZ
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_parse_of_texts_made_of_the_grammars_pieces(pieces: list[str]) -> None:
    _parses_or_refuses("".join(pieces))


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12), st.sampled_from(PIECES),
    st.sampled_from([RuntimeError, KeyboardInterrupt, int, (RuntimeError,), {"bfloat16": 1e-2}, {"x": "y"}]),
)  # fmt: skip


@FUZZ
@given(st.dictionaries(st.one_of(st.text(max_size=10), st.sampled_from(PIECES)), VALUES, max_size=3))
def test_kernel_policy_and_policy_with_arbitrary_keywords(arguments: dict[str, Any]) -> None:
    def entered() -> kp.Policy:
        with kp.kernel_policy(**arguments) as policy:  # a variant entry is checked on entry: a PolicyError too
            return policy

    for build in (entered, lambda: kp.Policy(**arguments)):
        try:
            policy = build()
        except kp.PolicyError:
            continue
        assert kp.Policy.parse(str(policy)) == policy


def test_max_failures_takes_ascii_digits_only() -> None:
    for text in ("max_failures=³", "max_failures=٣", "max_failures=\uff11"):
        with pytest.raises(kp.PolicyError, match="max_failures must be a whole number"):
            kp.Policy.parse(text)
    assert kp.Policy.parse("max_failures=12").max_failures == 12


def test_mode_has_one_meaning_the_mode_of_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kp.Policy(mode="disable") == kp.Policy("disable") == kp.Policy.parse("mode=disable")
    assert kp.Policy.parse("mode=disable,RMSNorm=prefer") == kp.Policy("disable", RMSNorm="prefer")
    with pytest.raises(kp.PolicyError, match="got its mode twice"):
        kp.Policy("prefer", mode="disable")
    with pytest.raises(kp.PolicyError, match="default mode given twice"):
        kp.Policy.parse("prefer,mode=disable")
    with pytest.raises(kp.PolicyError, match="'mode' names the mode of every layer"):
        kp.kernels_disabled("mode")
    monkeypatch.setenv("KERNELPOLICY", "mode=disable")
    _active.reload_env()
    assert kp.current_policy().mode_for("RMSNorm") == "disable"


def test_classmethods_and_staticmethods_are_decorated() -> None:
    class Model:
        @kp.kernels_disabled
        @classmethod
        def bare(cls) -> tuple[str, str]:
            return cls.__name__, kp.current_policy().default

        @kp.kernel_policy("require")
        @staticmethod
        def static(x: int) -> tuple[int, str]:
            return x, kp.current_policy().default

        @kp.kernels_disabled("RMSNorm")
        @classmethod
        def named(cls) -> str:
            return kp.current_policy().mode_for("RMSNorm")

    assert Model.bare() == Model().bare() == ("Model", "disable")
    assert Model.static(1) == Model().static(1) == (1, "require")
    assert Model.named() == "disable"
    assert kp.current_policy().default == "prefer"

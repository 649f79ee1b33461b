"""Policy values: construction, interning, text syntax, immutability and errors."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelpolicy as kp
from kernelpolicy._values._policy import MODES

LAYER_NAMES = ("RMSNorm", "SiLU", "GELU", "LayerNorm", "Attention")
VALID_MODES_TEXT = ("'prefer'", "'disable'", "'require'")


def assert_lists_valid_modes(message: str) -> None:
    for mode in VALID_MODES_TEXT:
        assert mode in message, f"{mode} missing from {message!r}"


# --- modes and basic accessors -------------------------------------------------


def test_modes_constant() -> None:
    assert MODES == ("prefer", "disable", "require", "verify")


def test_policy_error_and_scope_error_hierarchy() -> None:
    assert issubclass(kp.PolicyError, ValueError)
    assert issubclass(kp.errors.ScopeError, RuntimeError)
    assert not issubclass(kp.PolicyError, kp.errors.ScopeError)


def test_default_argument_is_prefer() -> None:
    assert kp.Policy() == kp.Policy("prefer")
    assert kp.Policy().default == "prefer"
    assert dict(kp.Policy().layers) == {}


@pytest.mark.parametrize("mode", ["prefer", "disable", "require"])
def test_default_and_mode_for(mode: str) -> None:
    policy = kp.Policy(mode)
    assert policy.default == mode
    assert policy.mode_for("RMSNorm") == mode
    assert policy.mode_for("AnythingElse") == mode
    assert dict(policy.layers) == {}


def test_layers_and_mode_for() -> None:
    policy = kp.Policy("prefer", RMSNorm="disable", SiLU="require")
    assert policy.default == "prefer"
    assert dict(policy.layers) == {"RMSNorm": "disable", "SiLU": "require"}
    assert policy.mode_for("RMSNorm") == "disable"
    assert policy.mode_for("SiLU") == "require"
    assert policy.mode_for("GELU") == "prefer"


def test_layers_equal_to_default_are_dropped() -> None:
    assert kp.Policy("prefer", RMSNorm="prefer") == kp.Policy("prefer")
    assert kp.Policy("disable", RMSNorm="disable", SiLU="prefer") == kp.Policy("disable", SiLU="prefer")
    assert dict(kp.Policy("require", RMSNorm="require").layers) == {}


def test_layers_mapping_is_read_only() -> None:
    policy = kp.Policy("prefer", RMSNorm="disable")
    layers = policy.layers
    with pytest.raises(TypeError):
        layers["SiLU"] = "disable"  # type: ignore[index]
    with pytest.raises(TypeError):
        del layers["RMSNorm"]  # type: ignore[attr-defined]
    assert policy.mode_for("SiLU") == "prefer"
    assert dict(policy.layers) == {"RMSNorm": "disable"}


def test_default_is_positional_only() -> None:
    # ``default`` as a keyword names a layer called "default", it does not set the default mode.
    policy = kp.Policy(default="disable")
    assert policy.default == "prefer"
    assert policy.mode_for("default") == "disable"


# --- value semantics: equality, hashing, pickling, copying; the interned Active -------------


def test_equal_by_content_however_written() -> None:
    a = kp.Policy("disable", RMSNorm="require", SiLU="prefer")
    b = kp.Policy("disable", SiLU="prefer", RMSNorm="require")
    c = kp.Policy.parse("SiLU=prefer, disable ,RMSNorm=require")
    assert a == b == c
    assert str(a) == str(b) == str(c) == "disable,RMSNorm=require,SiLU=prefer"
    assert a != kp.Policy("disable", RMSNorm="require")
    assert a != kp.Policy("prefer", RMSNorm="require", SiLU="prefer")
    assert kp.Policy("verify", atol=1e-3) != kp.Policy("verify")
    assert kp.Policy("verify", atol=1e-3) == kp.Policy.parse("verify,atol=0.001")
    assert a != "disable,RMSNorm=require,SiLU=prefer"  # no equality with its text


def test_policies_are_hashable_and_usable_as_keys() -> None:
    a = kp.Policy("prefer", RMSNorm="disable")
    table = {a: "a", kp.Policy("disable"): "b"}
    assert table[kp.Policy.parse("prefer,RMSNorm=disable")] == "a"
    assert table[kp.Policy.parse("disable")] == "b"
    assert hash(a) == hash(kp.Policy("prefer", RMSNorm="disable"))
    assert len({kp.Policy("require"), kp.Policy("require", X="require"), kp.Policy.parse("require")}) == 1


def test_a_policy_holds_its_value_only() -> None:
    policy = kp.Policy("prefer", RMSNorm="disable")
    assert not hasattr(policy, "__dict__")
    assert set(type(policy).__slots__) == {"_hash", "_key", "_modes", "_names_variants", "_options_text", "_variants"}
    assert policy.options == kp.Policy("prefer").options
    assert not hasattr(policy, "_current")  # the ContextVar reader lives on _active.Active


def test_active_objects_are_interned_per_policy_and_recording() -> None:
    from kernelpolicy._context._active import activate

    policy = kp.Policy("disable", RMSNorm="require")
    active = activate(policy)
    assert activate(kp.Policy.parse("RMSNorm=require,disable")) is active
    assert active.policy == policy and not active.recording
    assert activate(policy, True) is active.recorded(True) is not active
    assert active.recorded(True).recorded(False) is active


def test_interning_is_thread_safe() -> None:
    from kernelpolicy._context._active import activate

    barrier = threading.Barrier(8)
    results: list[list[object]] = [[] for _ in range(8)]

    def worker(slot: int) -> None:
        barrier.wait(timeout=10)
        for i in range(200):
            results[slot].append(activate(kp.Policy("disable", **{f"Layer{i}": "require"})))

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(len(r) == 200 for r in results)
    for i in range(200):
        first = results[0][i]
        assert all(r[i] is first for r in results)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_by_value(protocol: int) -> None:
    policy = kp.Policy("require", RMSNorm="disable", SiLU="prefer", atol=0.5, on_mismatch="warn")
    data = pickle.dumps(policy, protocol=protocol)
    assert b"_current" not in data and b"_table" not in data
    restored = pickle.loads(data)
    assert restored == policy and hash(restored) == hash(policy) and str(restored) == str(policy)
    assert restored.atol == 0.5 and restored.on_mismatch == "warn"


def test_a_tampered_pickle_is_checked() -> None:
    from kernelpolicy._values._policy import _restore

    with pytest.raises(kp.PolicyError, match="unknown kernel policy mode 'fast'"):
        _restore("prefer", (("RMSNorm", "fast"),), (None, None, "raise", None, (), None))
    with pytest.raises(kp.PolicyError, match="on_mismatch must be 'raise' or 'warn', got 'ignore'"):
        _restore("prefer", (), (None, None, "ignore", None, (), None))
    with pytest.raises(kp.PolicyError, match="fallback_on: 'KeyboardInterrupt' is not an Exception subclass"):
        _restore("prefer", (), (None, None, "raise", None, ("KeyboardInterrupt",), None))


def test_copy_and_deepcopy_return_the_same_object() -> None:
    policy = kp.Policy("prefer", RMSNorm="disable")
    assert copy.copy(policy) == policy
    assert copy.deepcopy(policy) == policy
    nested = copy.deepcopy({"x": [policy]})
    assert nested["x"][0] is policy


# --- immutability ----------------------------------------------------------------


@pytest.mark.parametrize("attribute", ["default", "layers", "options", "_key", "_modes", "new_attribute"])
def test_setting_attributes_raises(attribute: str) -> None:
    policy = kp.Policy("prefer", RMSNorm="disable")
    with pytest.raises(AttributeError):
        setattr(policy, attribute, "disable")
    assert policy.default == "prefer"
    assert dict(policy.layers) == {"RMSNorm": "disable"}


@pytest.mark.parametrize("attribute", ["default", "_key", "_modes"])
def test_deleting_attributes_raises(attribute: str) -> None:
    policy = kp.Policy("disable")
    with pytest.raises(AttributeError):
        delattr(policy, attribute)
    assert policy.default == "disable"


def test_internal_modes_cannot_be_changed_through_layers() -> None:
    policy = kp.Policy("prefer", RMSNorm="disable")
    as_dict = dict(policy.layers)
    as_dict["RMSNorm"] = "require"
    assert policy.mode_for("RMSNorm") == "disable"


# --- str / repr ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "text"),
    [
        (kp.Policy(), "prefer"),
        (kp.Policy("disable"), "disable"),
        (kp.Policy("prefer", RMSNorm="disable"), "prefer,RMSNorm=disable"),
        (kp.Policy("prefer", SiLU="require", RMSNorm="disable"), "prefer,RMSNorm=disable,SiLU=require"),
        (kp.Policy("require", b="prefer", a="disable", C="disable"), "require,C=disable,a=disable,b=prefer"),
    ],
)
def test_str_syntax_sorts_layers(policy: kp.Policy, text: str) -> None:
    assert str(policy) == text


def test_repr() -> None:
    assert repr(kp.Policy()) == "Policy('prefer')"
    assert repr(kp.Policy("disable", SiLU="require", RMSNorm="prefer")) == (
        "Policy('disable', RMSNorm='prefer', SiLU='require')"
    )


def test_repr_evaluates_to_the_same_object() -> None:
    policy = kp.Policy("require", RMSNorm="disable", SiLU="prefer")
    assert eval(repr(policy), {"Policy": kp.Policy}) == policy


policies = st.builds(
    lambda default, layers: kp.Policy(default, **layers),
    st.sampled_from(MODES),
    st.dictionaries(st.sampled_from(LAYER_NAMES), st.sampled_from(MODES)),
)


@settings(max_examples=200, deadline=None)
@given(policies)
def test_str_and_repr_round_trip(policy: kp.Policy) -> None:
    assert kp.Policy.parse(str(policy)) == policy
    assert eval(repr(policy), {"Policy": kp.Policy}) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy


# --- parse -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("disable", kp.Policy("disable")),
        ("prefer", kp.Policy("prefer")),
        ("require", kp.Policy("require")),
        ("prefer,RMSNorm=disable,SiLU=require", kp.Policy("prefer", RMSNorm="disable", SiLU="require")),
        ("RMSNorm=disable", kp.Policy("prefer", RMSNorm="disable")),
        ("RMSNorm=disable,SiLU=require", kp.Policy("prefer", RMSNorm="disable", SiLU="require")),
        ("RMSNorm=disable,require", kp.Policy("require", RMSNorm="disable")),
        ("RMSNorm=disable,require,SiLU=prefer", kp.Policy("require", RMSNorm="disable", SiLU="prefer")),
        ("  disable  ", kp.Policy("disable")),
        (" prefer , RMSNorm = disable ,\tSiLU=require\n", kp.Policy("prefer", RMSNorm="disable", SiLU="require")),
        ("disable,RMSNorm=disable", kp.Policy("disable")),
    ],
)
def test_parse_valid(text: str, expected: kp.Policy) -> None:
    assert kp.Policy.parse(text) == expected


def test_parse_with_source_parses_the_same() -> None:
    assert kp.Policy.parse("disable,SiLU=require", source="header X-Policy") == kp.Policy("disable", SiLU="require")


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("bogus", ["'bogus'"]),
        ("Prefer", ["'Prefer'"]),
        ("RMSNorm=fast", ["'fast'", "'RMSNorm'"]),
        ("prefer,RMSNorm=", ["''", "'RMSNorm'"]),
        ("prefer,RMSNorm=disable=x", ["'disable=x'"]),
    ],
)
def test_parse_unknown_mode_names_value_and_lists_modes(text: str, fragments: list[str]) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy.parse(text)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    assert_lists_valid_modes(message)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("prefer,RMSNorm=disable,RMSNorm=require", "'RMSNorm'"),
        ("RMSNorm=disable, RMSNorm = disable", "'RMSNorm'"),
        ("prefer,disable", "'disable'"),
        ("disable,RMSNorm=prefer,disable", "twice"),
        ("prefer,prefer", "twice"),
        ("", "empty"),
        ("   ", "empty"),
        (",", "empty"),
        ("prefer,", "empty"),
        (",prefer", "empty"),
        ("prefer,,RMSNorm=disable", "empty"),
        ("prefer, ,RMSNorm=disable", "empty"),
        ("=disable", "empty"),
        ("RMS Norm=disable", "'RMS Norm'"),
    ],
)
def test_parse_syntax_errors(text: str, fragment: str) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy.parse(text)
    assert fragment in str(info.value)


def test_parse_error_message_names_source_and_text() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy.parse("prefer,SiLU=turbo", source="MY_SOURCE")
    message = str(info.value)
    assert "MY_SOURCE" in message
    assert "'turbo'" in message
    assert_lists_valid_modes(message)


@pytest.mark.parametrize("value", [None, 3, b"prefer", ["prefer"]])
def test_parse_rejects_non_strings(value: object) -> None:
    with pytest.raises(kp.PolicyError):
        kp.Policy.parse(value)  # type: ignore[arg-type]


# --- construction errors ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["bogus", "", "PREFER", "disabled", " prefer"])
def test_unknown_default_mode(mode: str) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy(mode)  # type: ignore[arg-type]
    assert repr(mode) in str(info.value)
    assert_lists_valid_modes(str(info.value))


@pytest.mark.parametrize("mode", [1, 2.5, b"prefer", object, True])
def test_non_string_default_mode(mode: object) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy(mode)  # type: ignore[arg-type]
    assert repr(mode) in str(info.value)
    assert_lists_valid_modes(str(info.value))


def test_none_default_mode() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy(None)  # type: ignore[arg-type]
    assert "None" in str(info.value)
    assert_lists_valid_modes(str(info.value))


@pytest.mark.parametrize("mode", ["fast", None, 0, "Disable"])
def test_bad_layer_mode(mode: object) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy("prefer", RMSNorm=mode)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(mode) in message
    assert "RMSNorm" in message
    assert_lists_valid_modes(message)


@pytest.mark.parametrize("name", ["a,b", "a=b", "a b", "a\tb", "trailing\n", " lead", ""])
def test_bad_layer_names(name: str) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy("prefer", **{name: "disable"})
    if name:
        assert repr(name) in str(info.value)
    else:
        assert "empty" in str(info.value)


def test_bad_layer_name_is_rejected_even_when_mode_equals_default() -> None:
    with pytest.raises(kp.PolicyError):
        kp.Policy("prefer", **{"a,b": "prefer"})


@settings(max_examples=500, deadline=None)
@given(st.text(min_size=1, max_size=12), st.sampled_from(MODES))
def test_every_name_the_constructor_accepts_round_trips(name: str, mode: str) -> None:
    try:
        policy = kp.Policy("prefer" if mode != "prefer" else "disable", **{name: mode})
    except kp.PolicyError:
        return
    assert kp.Policy.parse(str(policy)) == policy
    assert dict(kp.Policy.parse(str(policy)).layers) == {name: mode}


@pytest.mark.parametrize("name", ["RMSNorm\xa0", "\u2003RMSNorm", "RMS\u200bNorm", "RMS\x00Norm", "RMS\u2028Norm"])
def test_unicode_spaces_and_unprintable_characters_are_rejected_by_name(name: str) -> None:
    with pytest.raises(kp.PolicyError, match=r"names may not contain commas, '=', whitespace or unprintable") as info:
        kp.Policy(**{name: "disable"})
    assert repr(name) in str(info.value)


def test_a_long_text_is_cut_in_error_messages() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy.parse("prefer," + "A" * 10_000 + "=fast", source="header X-Kernel-Policy")
    message = str(info.value)
    assert message.startswith("header X-Kernel-Policy='prefer,AAAA") and "... (10012 characters)" in message
    assert len(message) < 10_000 // 10

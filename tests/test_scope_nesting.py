"""Nesting of kernel_policy scopes: "a scope decides what it names", and scope misuse."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelpolicy as kp
from kernelpolicy import Policy, current_policy, kernel_policy
from kernelpolicy._values._policy import MODES

LAYERS = ("RMSNorm", "SiLU", "GELU", "LayerNorm")
UNNAMED = "NeverNamed"
VALID_MODES_TEXT = ("'prefer'", "'disable'", "'require'")


def modes_of(policy: Policy, names: tuple[str, ...] = (*LAYERS, UNNAMED)) -> dict[str, str]:
    return {name: policy.mode_for(name) for name in names}


# --- the nesting rule -------------------------------------------------------------


def test_no_scope_is_builtin_prefer() -> None:
    assert current_policy() == Policy("prefer")


def test_enter_returns_effective_policy() -> None:
    with kernel_policy("disable", SiLU="require") as outer:
        assert outer == Policy("disable", SiLU="require")
        assert current_policy() == outer
        with kernel_policy(RMSNorm="prefer") as inner:
            assert inner == Policy("disable", SiLU="require", RMSNorm="prefer")
            assert current_policy() == inner
        assert current_policy() == outer
    assert current_policy() == Policy("prefer")


def test_keyword_scope_inherits_unnamed_layers() -> None:
    with kernel_policy("prefer", RMSNorm="disable"), kernel_policy(SiLU="require"):
        policy = current_policy()
        assert policy.mode_for("RMSNorm") == "disable"
        assert policy.mode_for("SiLU") == "require"
        assert policy.mode_for("GELU") == "prefer"
        assert policy == Policy("prefer", RMSNorm="disable", SiLU="require")


def test_positional_mode_names_every_layer() -> None:
    with kernel_policy("prefer", RMSNorm="disable", SiLU="prefer"):
        with kernel_policy("require"):
            assert current_policy() == Policy("require")
            assert modes_of(current_policy()) == dict.fromkeys((*LAYERS, UNNAMED), "require")
        assert current_policy() == Policy("prefer", RMSNorm="disable")


def test_positional_mode_with_layers_ignores_enclosing() -> None:
    with kernel_policy("disable", RMSNorm="require", GELU="prefer"), kernel_policy("prefer", SiLU="disable"):
        assert current_policy() == Policy("prefer", SiLU="disable")
        assert current_policy().mode_for("RMSNorm") == "prefer"
        assert current_policy().mode_for("GELU") == "prefer"


def test_keyword_scope_overrides_only_what_it_names() -> None:
    with kernel_policy("disable", RMSNorm="require"):
        with kernel_policy(RMSNorm="prefer", SiLU="require"):
            assert modes_of(current_policy()) == {
                "RMSNorm": "prefer",
                "SiLU": "require",
                "GELU": "disable",
                "LayerNorm": "disable",
                UNNAMED: "disable",
            }
        with kernel_policy(RMSNorm="disable"):
            # Naming a layer with the enclosing default collapses to the default.
            assert current_policy() == Policy("disable")


def test_empty_scope_changes_nothing() -> None:
    with kernel_policy("disable", SiLU="require") as outer, kernel_policy() as inner:
        assert inner == outer
        assert current_policy() == outer
    with kernel_policy(None) as top:
        assert top == Policy("prefer")


def test_three_levels_deep() -> None:
    with kernel_policy("require"):
        with kernel_policy(RMSNorm="disable"):
            with kernel_policy(SiLU="prefer") as innermost:
                assert innermost == Policy("require", RMSNorm="disable", SiLU="prefer")
            with kernel_policy("disable", GELU="require") as reset:
                assert reset == Policy("disable", GELU="require")
            assert current_policy() == Policy("require", RMSNorm="disable")
        assert current_policy() == Policy("require")
    assert current_policy() == Policy("prefer")


def test_policy_value_applies_exactly_that_policy() -> None:
    fixed = Policy("prefer", RMSNorm="require")
    with kernel_policy("disable", SiLU="require", GELU="prefer"), kernel_policy(fixed) as entered:
        assert entered == fixed
        assert current_policy() == fixed
        assert current_policy().mode_for("SiLU") == "prefer"
        assert current_policy().mode_for("LayerNorm") == "prefer"


def test_captured_policy_can_be_reapplied() -> None:
    with kernel_policy("disable", SiLU="require"):
        captured = current_policy()
    with kernel_policy("require", RMSNorm="prefer"), kernel_policy(captured):
        assert current_policy() is captured


def test_enclosing_is_captured_at_enter_not_at_creation() -> None:
    scope = kernel_policy(SiLU="require")
    with kernel_policy("disable"), scope as first:
        assert first == Policy("disable", SiLU="require")
    with kernel_policy("prefer", RMSNorm="disable"), scope as second:
        assert second == Policy("prefer", RMSNorm="disable", SiLU="require")
    with scope as bare:
        assert bare == Policy("prefer", SiLU="require")


def test_same_scope_object_nested_in_itself() -> None:
    scope = kernel_policy(RMSNorm="disable")
    with kernel_policy("require"):
        with scope as once:
            assert once == Policy("require", RMSNorm="disable")
            with scope as twice:
                assert twice is once
                with kernel_policy("prefer"), scope as inside:
                    assert inside == Policy("prefer", RMSNorm="disable")
                assert current_policy() is once
            assert current_policy() is once
        assert current_policy() == Policy("require")


def test_scope_result_cache_is_correct_for_many_enclosing_policies() -> None:
    # More enclosing policies than any reasonable per-scope cache: results must stay exact.
    scope = kernel_policy(RMSNorm="disable")
    for round_ in range(2):
        for i in range(150):
            enclosing_mode = MODES[(i + round_) % 3]
            with kernel_policy(enclosing_mode, **{f"L{i}": "require" if enclosing_mode != "require" else "prefer"}):
                enclosing = current_policy()
                with scope as entered:
                    expected = Policy(enclosing.default, **dict(enclosing.layers), RMSNorm="disable")
                    assert entered == expected
                assert current_policy() is enclosing


# --- kernels_disabled -----------------------------------------------------------------


def test_kernels_disabled_everything() -> None:
    with kernel_policy("require", RMSNorm="prefer"), kp.kernels_disabled() as entered:
        assert entered == Policy("disable")
        assert current_policy() == Policy("disable")
    assert current_policy() == Policy("prefer")


def test_kernels_disabled_named_layers_only() -> None:
    with kernel_policy("require", GELU="prefer"), kp.kernels_disabled("RMSNorm", "SiLU"):
        assert modes_of(current_policy()) == {
            "RMSNorm": "disable",
            "SiLU": "disable",
            "GELU": "prefer",
            "LayerNorm": "require",
            UNNAMED: "require",
        }


def test_kernels_disabled_equals_kernel_policy_disable() -> None:
    with kernel_policy("prefer", SiLU="require"):
        with kp.kernels_disabled() as a:
            pass
        with kernel_policy("disable") as b:
            pass
        with kp.kernels_disabled("SiLU") as c:
            pass
        with kernel_policy(SiLU="disable") as d:
            pass
    assert a == b
    assert c == d


@pytest.mark.parametrize(
    "names",
    [("a,b",), ("a=b",), ("a b",), ("",), ("RMSNorm", "RMSNorm"), (1,), (None,)],
)
def test_kernels_disabled_rejects_bad_names(names: tuple[object, ...]) -> None:
    with pytest.raises(kp.PolicyError):
        kp.kernels_disabled(*names)  # type: ignore[arg-type]


def test_kernels_disabled_non_string_name_message_names_value() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.kernels_disabled("RMSNorm", 42)  # type: ignore[arg-type]
    assert "42" in str(info.value)


# --- errors raised at scope creation ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (("bogus",), {}, "'bogus'"),
        (("",), {}, "''"),
        ((3,), {}, "3"),
        ((b"disable",), {}, "b'disable'"),
        ((), {"RMSNorm": "fast"}, "'fast'"),
        ((), {"RMSNorm": None}, "None"),
        ((), {"RMSNorm": 1}, "1"),
        (("prefer",), {"SiLU": "Require"}, "'Require'"),
    ],
)
def test_bad_modes_raise_at_creation(args: tuple[object, ...], kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kernel_policy(*args, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert fragment in message
    for mode in VALID_MODES_TEXT:
        assert mode in message
    assert current_policy() == Policy("prefer")


@pytest.mark.parametrize("name", ["a,b", "a=b", "a b", "", "x\n"])
def test_bad_layer_names_raise_at_creation(name: str) -> None:
    with pytest.raises(kp.PolicyError) as info:
        kernel_policy(**{name: "disable"})
    assert (repr(name) if name else "empty") in str(info.value)


def test_policy_and_layers_together_raise() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kernel_policy(Policy("disable"), RMSNorm="prefer")  # type: ignore[call-overload]
    assert "RMSNorm" in str(info.value)


def test_bad_scope_is_never_entered() -> None:
    entered = False
    with pytest.raises(kp.PolicyError), kernel_policy("bogus"):  # type: ignore[arg-type]
        entered = True
    assert not entered
    assert current_policy() == Policy("prefer")


def test_bad_decorator_arguments_raise_before_decorating() -> None:
    with pytest.raises(kp.PolicyError):
        kernel_policy(SiLU="sometimes")  # type: ignore[arg-type]


# --- scope misuse ---------------------------------------------------------------------------


def test_exiting_twice_raises_scope_error() -> None:
    scope = kernel_policy("disable")
    scope.__enter__()
    scope.__exit__(None, None, None)
    with pytest.raises(kp.errors.ScopeError):
        scope.__exit__(None, None, None)
    assert current_policy() == Policy("prefer")


def test_exiting_twice_inside_an_outer_scope_raises_and_keeps_outer() -> None:
    with kernel_policy("require") as outer:
        scope = kernel_policy(SiLU="disable")
        scope.__enter__()
        scope.__exit__(None, None, None)
        with pytest.raises(kp.errors.ScopeError):
            scope.__exit__(None, None, None)
        assert current_policy() == outer
    assert current_policy() == Policy("prefer")


def test_exiting_never_entered_scope_raises() -> None:
    with pytest.raises(kp.errors.ScopeError):
        kernel_policy("disable").__exit__(None, None, None)


def test_exiting_out_of_order_raises_and_changes_nothing() -> None:
    a = kernel_policy("disable")
    b = kernel_policy(SiLU="require")
    policy_a = a.__enter__()
    policy_b = b.__enter__()
    assert policy_b == Policy("disable", SiLU="require")
    try:
        with pytest.raises(kp.errors.ScopeError):
            a.__exit__(None, None, None)
        # The failed exit must not have changed the policy in effect.
        assert current_policy() == policy_b
    finally:
        b.__exit__(None, None, None)
        assert current_policy() == policy_a
        a.__exit__(None, None, None)
    assert current_policy() == Policy("prefer")


def test_exiting_in_another_thread_raises() -> None:
    scope = kernel_policy("disable")
    entered = scope.__enter__()
    errors: list[BaseException] = []
    seen: list[Policy] = []

    def other_thread() -> None:
        try:
            scope.__exit__(None, None, None)
        except kp.errors.ScopeError as exc:
            errors.append(exc)
        seen.append(current_policy())

    try:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=10)
        assert len(errors) == 1
        assert isinstance(errors[0], kp.errors.ScopeError)
        assert seen == [Policy("prefer")]
        assert current_policy() is entered
    finally:
        scope.__exit__(None, None, None)
    assert current_policy() == Policy("prefer")


def test_exiting_in_a_copied_context_raises_scope_error() -> None:
    scope = kernel_policy("disable")
    scope.__enter__()
    ctx = contextvars.copy_context()
    try:
        with pytest.raises(kp.errors.ScopeError):
            ctx.run(scope.__exit__, None, None, None)
        assert current_policy() == Policy("disable")
    finally:
        scope.__exit__(None, None, None)
    assert current_policy() == Policy("prefer")


def test_exiting_in_a_copied_context_after_the_owner_exited_raises_scope_error() -> None:
    # Once the owning context has exited the scope, exiting it again from a context copied while it
    # was active (a task created inside the scope) finds a used token: ContextVar.reset raises
    # RuntimeError there, which kernel_policy.__exit__ turns into ScopeError.
    scope = kernel_policy("disable")
    scope.__enter__()
    ctx = contextvars.copy_context()
    scope.__exit__(None, None, None)
    assert current_policy() == Policy("prefer")
    with pytest.raises(kp.errors.ScopeError):
        ctx.run(scope.__exit__, None, None, None)


def test_exiting_in_a_child_task_raises_scope_error() -> None:
    # The same through asyncio: a task created inside the scope inherits it; after the parent exits
    # the scope, the child's exit raises ScopeError (a RuntimeError).
    scope = kernel_policy("disable")
    outcome: list[BaseException] = []

    async def child() -> None:
        await asyncio.sleep(0)
        try:
            scope.__exit__(None, None, None)
        except RuntimeError as exc:
            outcome.append(exc)

    async def main() -> None:
        scope.__enter__()
        task = asyncio.create_task(child())
        scope.__exit__(None, None, None)
        await task

    asyncio.run(main())
    assert len(outcome) == 1
    assert isinstance(outcome[0], kp.errors.ScopeError), repr(outcome[0])


def test_exiting_in_a_child_task_while_parent_still_inside_raises_scope_error() -> None:
    scope = kernel_policy("disable")
    outcome: list[BaseException] = []

    async def child() -> None:
        try:
            scope.__exit__(None, None, None)
        except RuntimeError as exc:
            outcome.append(exc)
        outcome_policy.append(current_policy())

    outcome_policy: list[Policy] = []

    async def main() -> None:
        with scope:
            await asyncio.create_task(child())
            assert current_policy() == Policy("disable")

    asyncio.run(main())
    assert len(outcome) == 1
    assert isinstance(outcome[0], kp.errors.ScopeError)
    assert outcome_policy == [Policy("disable")]


def test_scope_error_message_names_the_scope() -> None:
    scope = kernel_policy("disable", RMSNorm="require")
    with pytest.raises(kp.errors.ScopeError) as info:
        scope.__exit__(None, None, None)
    assert repr(scope) in str(info.value)


def test_scope_repr() -> None:
    assert repr(kernel_policy("disable", RMSNorm="require")) == "kernel_policy('disable', RMSNorm='require')"
    assert repr(kernel_policy(SiLU="prefer")) == "kernel_policy(SiLU='prefer')"
    assert repr(kernel_policy()) == "kernel_policy()"
    assert repr(kernel_policy(Policy("require"))) == "kernel_policy(Policy('require'))"


# --- property test against a reference model ---------------------------------------------

_modes = st.sampled_from(MODES)
_specs = st.tuples(st.one_of(st.none(), _modes), st.dictionaries(st.sampled_from(LAYERS), _modes, max_size=3))
# An op is either the index of a scope object in the pool (enter it) or None (exit the innermost).
_ops = st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=5)), max_size=40)


def _ref_overlay(enclosing: dict[str, str], spec: tuple[str | None, dict[str, str]]) -> dict[str, str]:
    mode, layers = spec
    if mode is not None:
        return {"*": mode, **layers}
    return {**enclosing, **layers}


def _ref_mode(model: dict[str, str], name: str) -> str:
    return model.get(name, model["*"])


def _check(model: dict[str, str]) -> None:
    policy = current_policy()
    for name in (*LAYERS, UNNAMED):
        assert policy.mode_for(name) == _ref_mode(model, name), (name, policy, model)
    assert policy.default == model["*"]


@settings(max_examples=300, deadline=None)
@given(
    base=st.one_of(st.none(), _specs),
    pool_specs=st.lists(_specs, min_size=1, max_size=6),
    ops=_ops,
)
def test_nesting_matches_reference_model(
    base: tuple[str | None, dict[str, str]] | None,
    pool_specs: list[tuple[str | None, dict[str, str]]],
    ops: list[int | None],
) -> None:
    pool = [kernel_policy(mode, **layers) for mode, layers in pool_specs]  # type: ignore[arg-type]
    model_base = {"*": "prefer"}
    if base is not None and (base[0] is not None or base[1]):
        model_base = _ref_overlay(model_base, base)
        kp.set_default_policy(base[0], **base[1])  # type: ignore[arg-type]
    try:
        stack: list[tuple[kernel_policy, Policy, dict[str, str]]] = []
        _check(model_base)
        for op in ops:
            model_top = stack[-1][2] if stack else model_base
            if op is None:
                if not stack:
                    continue
                scope, before, _ = stack.pop()
                scope.__exit__(None, None, None)
                assert current_policy() == before
                _check(stack[-1][2] if stack else model_base)
                continue
            index = op % len(pool)
            before = current_policy()
            entered = pool[index].__enter__()
            model = _ref_overlay(model_top, pool_specs[index])
            stack.append((pool[index], before, model))
            assert entered is current_policy()
            _check(model)
        while stack:
            scope, before, _ = stack.pop()
            scope.__exit__(None, None, None)
            assert current_policy() == before
            _check(stack[-1][2] if stack else model_base)
    finally:
        kp.set_default_policy()
    assert current_policy() == Policy("prefer")

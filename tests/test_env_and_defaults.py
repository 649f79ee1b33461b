"""The process default: KERNELPOLICY, set_default_policy and precedence."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

import pytest

import kernelpolicy as kp
from kernelpolicy import Policy, current_policy, kernel_policy
from kernelpolicy._context import _active
from kernelpolicy._values._policy import ENV_VAR

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

VALID_MODES_TEXT = ("'prefer'", "'disable'", "'require'")


@pytest.fixture
def set_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Policy | None]]:
    """Set KERNELPOLICY and re-read it as a fresh process would; undo both afterwards."""

    def setter(text: str) -> Policy | None:
        monkeypatch.setenv(ENV_VAR, text)
        return _active.reload_env()

    yield setter
    monkeypatch.delenv(ENV_VAR, raising=False)
    _active.reload_env()
    kp.set_default_policy()


def read_in_new_thread() -> Policy:
    seen: list[Policy] = []
    thread = threading.Thread(target=lambda: seen.append(current_policy()))
    thread.start()
    thread.join(timeout=10)
    assert len(seen) == 1
    return seen[0]


def subprocess_env(value: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if value is not None:
        env[ENV_VAR] = value
    return env


def test_env_var_name() -> None:
    assert ENV_VAR == "KERNELPOLICY"


# --- KERNELPOLICY ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("disable", Policy("disable")),
        ("prefer,RMSNorm=disable,SiLU=require", Policy("prefer", RMSNorm="disable", SiLU="require")),
        ("RMSNorm=disable", Policy("prefer", RMSNorm="disable")),
        (" require , GELU = prefer ", Policy("require", GELU="prefer")),
    ],
)
def test_env_sets_process_default(set_env: Callable[[str], Policy | None], text: str, expected: Policy) -> None:
    assert set_env(text) == expected
    assert current_policy() == expected
    assert read_in_new_thread() == expected
    assert asyncio.run(_read_in_task()) == expected


async def _read_in_task() -> Policy:
    return current_policy()


@pytest.mark.parametrize("text", ["", " ", "  \t\n "])
def test_empty_env_means_builtin_prefer(set_env: Callable[[str], Policy | None], text: str) -> None:
    assert set_env(text) is None
    assert current_policy() == Policy("prefer")


def test_env_is_read_once(set_env: Callable[[str], Policy | None], monkeypatch: pytest.MonkeyPatch) -> None:
    set_env("disable")
    assert current_policy() == Policy("disable")
    monkeypatch.setenv(ENV_VAR, "require")
    assert current_policy() == Policy("disable")
    with kernel_policy(RMSNorm="require"):
        assert current_policy() == Policy("disable", RMSNorm="require")
    assert read_in_new_thread() == Policy("disable")
    # Only a re-read (a fresh process) picks the new value up.
    assert _active.reload_env() == Policy("require")
    assert current_policy() == Policy("require")


@pytest.mark.parametrize(
    ("text", "bad_token"),
    [
        ("bogus", "'bogus'"),
        ("prefer,RMSNorm=fast", "'fast'"),
        ("RMSNorm=Disable", "'Disable'"),
        ("prefer,SiLU=", "''"),
    ],
)
def test_malformed_env_mode_raises_naming_variable_token_and_modes(
    set_env: Callable[[str], Policy | None], text: str, bad_token: str
) -> None:
    with pytest.raises(kp.PolicyError) as info:
        set_env(text)
    message = str(info.value)
    assert "KERNELPOLICY" in message
    assert bad_token in message
    for mode in VALID_MODES_TEXT:
        assert mode in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("prefer,,RMSNorm=disable", "empty"),
        ("prefer,disable", "'disable'"),
        ("RMSNorm=disable,RMSNorm=prefer", "'RMSNorm'"),
        ("RMS Norm=disable", "'RMS Norm'"),
    ],
)
def test_malformed_env_syntax_raises_naming_variable(
    set_env: Callable[[str], Policy | None], text: str, fragment: str
) -> None:
    with pytest.raises(kp.PolicyError) as info:
        set_env(text)
    assert "KERNELPOLICY" in str(info.value)
    assert fragment in str(info.value)


def test_malformed_env_raises_at_every_use_until_fixed(
    set_env: Callable[[str], Policy | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(kp.PolicyError):
        set_env("prefer,RMSNorm=sometimes")
    with pytest.raises(kp.PolicyError, match="KERNELPOLICY"):
        current_policy()
    with pytest.raises(kp.PolicyError, match="KERNELPOLICY"):
        kernel_policy("disable").__enter__()
    with pytest.raises(kp.PolicyError, match="KERNELPOLICY"):
        kp.set_default_policy("disable")
    # A fixed value is picked up at the next use, without an explicit reload.
    monkeypatch.setenv(ENV_VAR, "prefer,RMSNorm=disable")
    assert current_policy() == Policy("prefer", RMSNorm="disable")


# --- set_default_policy ---------------------------------------------------------------------


def test_set_default_policy_applies_everywhere_without_scope() -> None:
    previous = kp.set_default_policy("disable", SiLU="require")
    try:
        assert previous == Policy("prefer")
        expected = Policy("disable", SiLU="require")
        assert current_policy() == expected
        assert read_in_new_thread() == expected
        assert asyncio.run(_read_in_task()) == expected
    finally:
        kp.set_default_policy()
    assert current_policy() == Policy("prefer")
    assert read_in_new_thread() == Policy("prefer")


def test_set_default_policy_returns_previous_and_can_restore_it() -> None:
    try:
        first = kp.set_default_policy("require")
        second = kp.set_default_policy(RMSNorm="disable")
        third = kp.set_default_policy(Policy("disable", GELU="prefer"))
        assert first == Policy("prefer")
        assert second == Policy("require")
        assert third == Policy("prefer", RMSNorm="disable")
        assert kp.set_default_policy(second) == Policy("disable", GELU="prefer")
        assert current_policy() == Policy("require")
    finally:
        kp.set_default_policy()


def test_set_default_policy_seen_by_already_running_thread() -> None:
    ready = threading.Event()
    changed = threading.Event()
    seen: list[Policy] = []

    def worker() -> None:
        seen.append(current_policy())
        ready.set()
        changed.wait(timeout=10)
        seen.append(current_policy())

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        ready.wait(timeout=10)
        kp.set_default_policy("disable")
        changed.set()
        thread.join(timeout=10)
    finally:
        changed.set()
        kp.set_default_policy()
    assert seen == [Policy("prefer"), Policy("disable")]


def test_set_default_policy_layers_over_env(set_env: Callable[[str], Policy | None]) -> None:
    env = set_env("prefer,RMSNorm=disable,SiLU=require")
    assert env == Policy("prefer", RMSNorm="disable", SiLU="require")
    previous = kp.set_default_policy(SiLU="prefer", GELU="disable")
    assert previous is env
    assert current_policy() == Policy("prefer", RMSNorm="disable", GELU="disable")
    # Each call layers over the environment, not over the previous call.
    kp.set_default_policy(LayerNorm="require")
    assert current_policy() == Policy("prefer", RMSNorm="disable", SiLU="require", LayerNorm="require")
    # A positional mode names every layer, so the environment no longer shows through.
    kp.set_default_policy("require")
    assert current_policy() == Policy("require")
    kp.set_default_policy("disable", SiLU="require")
    assert current_policy() == Policy("disable", SiLU="require")
    # A Policy value applies exactly.
    kp.set_default_policy(Policy("prefer", GELU="require"))
    assert current_policy() == Policy("prefer", GELU="require")
    # No arguments: back to the environment's default.
    assert kp.set_default_policy() == Policy("prefer", GELU="require")
    assert current_policy() is env
    assert read_in_new_thread() is env


def test_set_default_policy_no_args_restores_builtin() -> None:
    kp.set_default_policy("disable")
    assert kp.set_default_policy() == Policy("disable")
    assert current_policy() == Policy("prefer")
    assert kp.set_default_policy(None) == Policy("prefer")
    assert current_policy() == Policy("prefer")


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("bogus",), {}),
        ((None,), {"RMSNorm": "fast"}),
        ((1,), {}),
        ((Policy("disable"),), {"RMSNorm": "prefer"}),
        ((), {"a,b": "disable"}),
    ],
)
def test_set_default_policy_bad_input_raises_and_changes_nothing(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    kp.set_default_policy("require", SiLU="disable")
    try:
        with pytest.raises(kp.PolicyError):
            kp.set_default_policy(*args, **kwargs)  # type: ignore[arg-type]
        assert current_policy() == Policy("require", SiLU="disable")
    finally:
        kp.set_default_policy()


def test_scopes_take_precedence_over_set_default_policy() -> None:
    kp.set_default_policy("require", SiLU="disable")
    try:
        with kernel_policy(RMSNorm="prefer") as scoped:
            assert scoped == Policy("require", SiLU="disable", RMSNorm="prefer")
            with kernel_policy("disable"):
                assert current_policy() == Policy("disable")
            # Changing the default inside a scope does not change the captured scope.
            kp.set_default_policy("prefer")
            assert current_policy() is scoped
            assert read_in_new_thread() == Policy("prefer")
        assert current_policy() == Policy("prefer")
    finally:
        kp.set_default_policy()


# --- precedence ------------------------------------------------------------------------------


def test_full_precedence_chain(set_env: Callable[[str], Policy | None]) -> None:
    # builtin prefer < KERNELPOLICY < set_default_policy < enclosing scope < innermost scope
    names = ("A", "B", "C", "D", "E")

    def modes() -> tuple[str, ...]:
        policy = current_policy()
        return tuple(policy.mode_for(name) for name in names)

    assert modes() == ("prefer",) * 5
    set_env("prefer,A=disable,B=disable,C=disable,D=disable")
    assert modes() == ("disable", "disable", "disable", "disable", "prefer")
    kp.set_default_policy(A="require", B="require", C="require")
    assert modes() == ("require", "require", "require", "disable", "prefer")
    with kernel_policy(A="prefer", B="prefer"):
        assert modes() == ("prefer", "prefer", "require", "disable", "prefer")
        with kernel_policy(A="disable"):
            assert modes() == ("disable", "prefer", "require", "disable", "prefer")
        assert modes() == ("prefer", "prefer", "require", "disable", "prefer")
    assert modes() == ("require", "require", "require", "disable", "prefer")
    kp.set_default_policy()
    assert modes() == ("disable", "disable", "disable", "disable", "prefer")


# --- real subprocesses -----------------------------------------------------------------------


def test_subprocess_reads_env() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import kernelpolicy; print(kernelpolicy.current_policy())"],
        env=subprocess_env("disable,RMSNorm=require"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "disable,RMSNorm=require"


def test_subprocess_malformed_env_fails_with_message() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import kernelpolicy; print(kernelpolicy.current_policy())"],
        env=subprocess_env("prefer,RMSNorm=turbo"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert result.stdout == ""
    assert "PolicyError" in result.stderr
    assert "KERNELPOLICY" in result.stderr
    assert "'turbo'" in result.stderr
    for mode in VALID_MODES_TEXT:
        assert mode in result.stderr


def test_subprocess_import_does_not_import_kernels_or_hub_and_torch_only_when_needed() -> None:
    # Policies and scopes need no torch (the pytest plugin is loaded in every
    # pytest run); the layer machinery imports it on first use, never kernels.
    code = (
        "import sys, kernelpolicy\n"
        "def loaded():\n"
        "    return ','.join(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'kernels', 'huggingface_hub'}))\n"
        "kernelpolicy.current_policy()\n"
        "with kernelpolicy.kernels_disabled():\n"
        "    pass\n"
        "print('SCOPES:' + loaded())\n"
        "kernelpolicy.use_kernel_forward_from_hub, kernelpolicy.introspect.execution_state()\n"
        "print('LAYERS:' + loaded())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(None),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SCOPES:", "LAYERS:torch"]


def test_public_names_resolve_and_star_import() -> None:
    namespace: dict[str, object] = {}
    exec("from kernelpolicy import *", namespace)
    assert set(kp.__all__) <= set(namespace)
    assert set(kp.__all__) <= set(dir(kp))
    with pytest.raises(AttributeError, match="has no attribute 'kernelise'"):
        kp.kernelise  # noqa: B018

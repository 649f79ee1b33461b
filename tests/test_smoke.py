from __future__ import annotations

import typing

import pytest

import kernelpolicy


def test_default_is_prefer() -> None:
    assert kernelpolicy.current_policy() == kernelpolicy.Policy("prefer")


def test_public_classes_report_the_package_as_their_module() -> None:
    classes = [getattr(kernelpolicy, name) for name in kernelpolicy.__all__]
    classes = [obj for obj in classes if isinstance(obj, type)]
    assert len(classes) >= 11
    assert {cls.__qualname__: cls.__module__ for cls in classes} == {
        cls.__qualname__: "kernelpolicy" for cls in classes
    }


def test_the_old_name_mode_warns_and_is_policy_mode() -> None:
    with pytest.warns(DeprecationWarning, match=r"kernelpolicy\.Mode is now kernelpolicy\.PolicyMode"):
        old = kernelpolicy.Mode  # type: ignore[attr-defined]
    assert old is kernelpolicy.PolicyMode
    assert typing.get_args(kernelpolicy.PolicyMode) == kernelpolicy.MODES
    assert "Mode" not in kernelpolicy.__all__

from __future__ import annotations

import typing

import kernelpolicy
import kernelpolicy.distributed
import kernelpolicy.processes


def test_default_is_prefer() -> None:
    assert kernelpolicy.current_policy() == kernelpolicy.Policy("prefer")


def test_public_classes_report_the_package_as_their_module() -> None:
    classes = [getattr(kernelpolicy, name) for name in kernelpolicy.__all__]
    classes = [obj for obj in classes if isinstance(obj, type)]
    assert len(classes) >= 11
    assert {cls.__qualname__: cls.__module__ for cls in classes} == {
        cls.__qualname__: "kernelpolicy" for cls in classes
    }


def test_the_top_level_is_what_a_user_needs() -> None:
    assert not hasattr(kernelpolicy, "Mode")  # kernels' Mode is kernels.Mode; the policy modes are PolicyMode
    assert typing.get_args(kernelpolicy.PolicyMode) == ("prefer", "disable", "require", "verify")
    moved = {"MODES", "ENV_VAR", "PolicyMismatchError", "child_env", "worker_init_fn"}
    assert not moved & set(kernelpolicy.__all__)
    assert len(kernelpolicy.__all__) == 27
    assert kernelpolicy.distributed.PolicyMismatchError.__module__ == "kernelpolicy.distributed"
    assert callable(kernelpolicy.processes.worker_init_fn) and callable(kernelpolicy.processes.child_env)

from __future__ import annotations

import subprocess
import sys
import typing

import kernelpolicy
import kernelpolicy.distributed
import kernelpolicy.processes


def test_default_is_prefer() -> None:
    assert kernelpolicy.current_policy() == kernelpolicy.Policy("prefer")


def test_public_classes_report_their_public_module() -> None:
    import kernelpolicy.errors
    import kernelpolicy.types

    for module in (kernelpolicy, kernelpolicy.errors, kernelpolicy.types):
        classes = [getattr(module, name) for name in module.__all__]
        classes = [obj for obj in classes if isinstance(obj, type)]
        assert classes
        for cls in classes:  # where it is documented, and where pickle finds it
            assert getattr(__import__(cls.__module__, fromlist=["_"]), cls.__qualname__) is cls, cls


def test_the_top_level_is_what_a_user_needs() -> None:
    assert not hasattr(kernelpolicy, "Mode")  # kernels' Mode is kernels.Mode; the policy modes are PolicyMode
    assert typing.get_args(kernelpolicy.types.PolicyMode) == ("prefer", "disable", "require", "verify")
    moved = {"MODES", "ENV_VAR", "PolicyMismatchError", "child_env", "worker_init_fn"}
    assert not moved & set(kernelpolicy.__all__)
    assert len(kernelpolicy.__all__) == 20  # the names a user types; return types and rarer helpers: submodules
    assert kernelpolicy.distributed.PolicyMismatchError.__module__ == "kernelpolicy.distributed"
    assert callable(kernelpolicy.processes.worker_init_fn) and callable(kernelpolicy.processes.child_env)


def test_names_that_moved_to_submodules_still_work_with_a_deprecation_warning() -> None:
    import warnings

    import kernelpolicy.errors
    import kernelpolicy.introspect
    import kernelpolicy.types

    for name, where in kernelpolicy._MOVED.items():
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            value = getattr(kernelpolicy, name)
        assert value is getattr(getattr(kernelpolicy, where), name)
        [warning] = told
        assert warning.category is DeprecationWarning and warning.filename == __file__
        assert f"kernelpolicy.{name} moved to kernelpolicy.{where}.{name}" in str(warning.message)
        assert name not in kernelpolicy.__all__ and name in getattr(kernelpolicy, where).__all__


#: Runs ``python -m kernelpolicy demo`` where numpy cannot be imported, as in the demo's environment (the package
#: alone: ``.ci/run --demo``), whatever this environment has.
DEMO_WITHOUT_NUMPY = """
import sys

sys.modules["numpy"] = None  # import numpy fails, and importlib.util.find_spec("numpy") finds nothing
from kernelpolicy.__main__ import main

sys.exit(main(["demo"]))
"""


def test_the_demo_shows_each_scene_with_the_numbers_it_claims() -> None:
    """In a fresh process without numpy: the scenes and their numbers, and none of the warnings a newcomer cannot act
    on that its first screen showed (torch's at its import without numpy; kernels', from 0.18, on the demo's own
    repositories: their metadata recorded no digest)."""
    done = subprocess.run(
        [sys.executable, "-c", DEMO_WITHOUT_NUMPY], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert not [line for line in done.stderr.splitlines() if "NumPy" in line or "digest" in line], done.stderr
    assert text.startswith("kernelpolicy demo: "), text[:500]
    assert "calls {'RMSNorm': {'kernel': 3}, 'SiLU': {'kernel': 2}}" in text  # prefer
    assert "calls {'RMSNorm': {'original': 3}, 'SiLU': {'original': 2}}" in text  # kernels_disabled()
    assert "calls {'RMSNorm': {'kernel': 3}, 'SiLU': {'original': 2}}" in text  # the per-layer override
    assert "kernel minus original: +0.5000 to +0.5000" in text  # what the text says the kernel adds
    assert "KernelMismatchError: kernel output differs from the original forward for module 'blocks.0.1'" in text
    assert "the SiLU kernel passes: {'RMSNorm': {'original': 3}, 'SiLU': {'kernel': 2}}" in text
    assert text.count("(equal to eager)") == 2 and "backend='eager'" in text
    assert (
        "kernel_policy('require'): KernelUnavailableError: kernel required but unavailable for module 'blocks.0.2'"
        in text
    )

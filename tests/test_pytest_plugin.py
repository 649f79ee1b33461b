"""The pytest plugin (kernelpolicy.pytest_plugin): marker, fixtures, --kernel-policy, ini option.

Each test writes a small test file and runs pytest on it with ``pytester``, which
loads the plugin from its ``pytest11`` entry point as a user would get it. Most
runs are in-process (about 0.1 s each; a subprocess pays for importing torch again,
about 4 s): an in-process run shares this test's context, so the repository's
conftest would also catch a scope leaked by the inner run. The end-to-end test and
the marker listing run in a subprocess, as pytest is started by users.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

pytest_plugins = ["pytester"]

USAGE_ERROR = 4
Run = Callable[..., pytest.RunResult]


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Run:
    """``run(source, *args, in_subprocess=False)``: write ``source`` as test_inner.py and run pytest on it."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("KERNELPOLICY", raising=False)

    def go(source: str, *args: str, in_subprocess: bool = False) -> pytest.RunResult:
        pytester.makepyfile(test_inner=textwrap.dedent(source))
        # hypothesis's plugin re-imports (and pytest re-rewrites) its modules in every in-process run: ~1.5 s
        args = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--strict-markers", "-rA", *args)
        if in_subprocess:
            return pytester.runpytest_subprocess(*args, timeout=120)
        return pytester.runpytest_inprocess(*args)

    return go


def test_marker_applies_the_policy(run: Run) -> None:
    result = run(
        """
        import pytest
        import kernelpolicy

        @pytest.mark.kernel_policy("disable", RMSNorm="require")
        def test_marked():
            policy = kernelpolicy.current_policy()
            assert policy.mode_for("RMSNorm") == "require"
            assert policy.mode_for("SiLU") == "disable"
            assert str(policy) == "disable,RMSNorm=require"

        @pytest.mark.kernel_policy(SiLU="verify")
        def test_layers_only():
            assert str(kernelpolicy.current_policy()) == "prefer,SiLU=verify"
        """
    )
    result.assert_outcomes(passed=2)


def test_markers_nest_module_class_function(run: Run) -> None:
    result = run(
        """
        import pytest
        from kernelpolicy import current_policy

        pytestmark = pytest.mark.kernel_policy(SiLU="require", GELU="require")

        @pytest.mark.kernel_policy("disable", GELU="verify")
        class TestNesting:
            def test_class_only(self):
                # the class's positional mode names every layer: the module's SiLU entry is replaced
                assert str(current_policy()) == "disable,GELU=verify"

            @pytest.mark.kernel_policy(RMSNorm="require", GELU="prefer")
            def test_function_innermost(self):
                assert str(current_policy()) == "disable,GELU=prefer,RMSNorm=require"

            @pytest.mark.kernel_policy("prefer")
            @pytest.mark.kernel_policy(RMSNorm="disable")
            def test_stacked_top_is_outer(self):
                assert str(current_policy()) == "prefer,RMSNorm=disable"

        def test_module_only():
            assert str(current_policy()) == "prefer,GELU=require,SiLU=require"
        """
    )
    result.assert_outcomes(passed=4)


def test_inherited_class_markers_nest_base_outermost(run: Run) -> None:
    result = run(
        """
        import pytest
        from kernelpolicy import current_policy

        @pytest.mark.kernel_policy("disable")
        class TestBase:
            expected = "disable"

            def test_policy(self):  # inherited: it runs in every subclass, under the subclass's markers
                assert str(current_policy()) == self.expected

        @pytest.mark.kernel_policy(RMSNorm="require")
        class TestSub(TestBase):  # a subclass's markers nest inside its bases': what it names wins
            expected = "disable,RMSNorm=require"

        @pytest.mark.kernel_policy("verify")
        @pytest.mark.kernel_policy(SiLU="disable")
        class TestSubSub(TestSub):
            expected = "verify,SiLU=disable"

            @pytest.mark.kernel_policy(GELU="require")
            def test_function_innermost(self):
                assert str(current_policy()) == "verify,GELU=require,SiLU=disable"
        """
    )
    result.assert_outcomes(passed=4)


def test_fixtures_and_fixture_setup_teardown_see_the_policy(run: Run) -> None:
    result = run(
        """
        import pytest
        import kernelpolicy as kp

        SEEN = []

        @pytest.fixture
        def recorder():
            SEEN.append(("setup", str(kp.current_policy())))
            yield
            SEEN.append(("teardown", str(kp.current_policy())))

        @pytest.fixture
        def own_scope():
            with kp.kernel_policy(SiLU="require"):  # held across yield: nests inside the marker
                yield

        @pytest.mark.kernel_policy("disable")
        def test_uses_fixtures(kernelpolicy, kernel_policy_in_effect, recorder, own_scope):
            assert kernelpolicy is kp
            assert kernel_policy_in_effect == kp.Policy("disable")
            assert str(kernelpolicy.current_policy()) == "disable,SiLU=require"

        def test_after():
            assert SEEN == [("setup", "disable"), ("teardown", "disable")]

        def test_fixture_without_marker(kernel_policy_in_effect):
            assert kernel_policy_in_effect == kp.Policy("prefer")
        """
    )
    result.assert_outcomes(passed=3)


def test_option_applies_to_the_whole_run_with_markers_inside(run: Run) -> None:
    source = """
        import pytest
        from kernelpolicy import current_policy

        def test_plain():
            assert str(current_policy()) == "disable,RMSNorm=require"

        @pytest.mark.kernel_policy(SiLU="prefer")
        def test_marker_inside():
            assert str(current_policy()) == "disable,RMSNorm=require,SiLU=prefer"

        @pytest.mark.kernel_policy("require")
        def test_marker_mode_wins():
            assert str(current_policy()) == "require"
        """
    run(source, "--kernel-policy=disable,RMSNorm=require").assert_outcomes(passed=3)
    # Without the option the same tests see the default.
    run(source).assert_outcomes(passed=1, failed=2)


def test_option_without_a_mode_names_only_its_layers(run: Run) -> None:
    result = run(
        """
        from kernelpolicy import current_policy, set_default_policy

        def test_rest_is_the_process_default():
            # entered before the test, the run-wide scope captured the default then: prefer
            assert str(current_policy()) == "prefer,RMSNorm=disable"
        """,
        "--kernel-policy", "RMSNorm=disable",
    )  # fmt: skip
    result.assert_outcomes(passed=1)


def test_ini_option_and_option_overrides_it(run: Run, pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nkernel_policy = disable,RMSNorm=require\n")
    source = """
        import pytest
        from kernelpolicy import current_policy

        def test_plain(request):
            expected = "disable,RMSNorm=require" if request.config.getoption("kernel_policy") is None else "require"
            assert str(current_policy()) == expected

        @pytest.mark.kernel_policy(SiLU="verify")
        def test_marker_inside(request):
            if request.config.getoption("kernel_policy") is None:
                assert str(current_policy()) == "disable,RMSNorm=require,SiLU=verify"
        """
    run(source).assert_outcomes(passed=2)
    run(source, "--kernel-policy=require").assert_outcomes(passed=2)


def test_malformed_option_is_a_usage_error(run: Run) -> None:
    result = run("def test_never_runs():\n    pass\n", "--kernel-policy=prefer,RMSNorm=fast")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--kernel-policy='prefer,RMSNorm=fast': unknown kernel policy mode 'fast' for layer 'RMSNorm'*"]
    )
    result.stdout.no_fnmatch_line("*test_never_runs*")


def test_malformed_ini_option_is_a_usage_error(run: Run, pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nkernel_policy = disable,,\n")
    result = run("def test_never_runs():\n    pass\n")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option kernel_policy='disable,,': empty entry at position 2*"])


def test_malformed_marker_errors_that_test_only(run: Run) -> None:
    result = run(
        """
        import pytest
        from kernelpolicy import current_policy

        @pytest.mark.kernel_policy("fast")
        def test_bad_mode():
            pass

        @pytest.mark.kernel_policy(RMSNorm=None)
        def test_bad_layer_mode():
            pass

        @pytest.mark.kernel_policy("disable", "require")
        def test_two_modes():
            pass

        def test_good():
            assert str(current_policy()) == "prefer"

        @pytest.mark.kernel_policy("disable")
        def test_good_marked():
            assert str(current_policy()) == "disable"
        """
    )
    result.assert_outcomes(passed=2, errors=3)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_bad_mode*",
            "bad marker @pytest.mark.kernel_policy('fast'): unknown kernel policy mode 'fast'*",
            "*ERROR at setup of test_bad_layer_mode*",
            "bad marker @pytest.mark.kernel_policy(RMSNorm=None): a mode is required for layer 'RMSNorm'*",
            "*ERROR at setup of test_two_modes*",
            "bad marker @pytest.mark.kernel_policy('disable', 'require'): *positional argument*",
        ]
    )


def test_no_policy_leaks_between_tests(run: Run) -> None:
    result = run(
        """
        import pytest
        import kernelpolicy

        def no_scope_active():
            # with no scope active the process default shows through
            previous = kernelpolicy.set_default_policy("require")
            try:
                return kernelpolicy.current_policy() == kernelpolicy.Policy("require")
            finally:
                kernelpolicy.set_default_policy(previous)

        @pytest.fixture
        def broken_teardown():
            yield
            raise RuntimeError("teardown fails")

        @pytest.mark.kernel_policy("disable")
        def test_marked_passes():
            assert not no_scope_active()

        def test_after_passing():
            assert no_scope_active()

        @pytest.mark.kernel_policy("disable")
        def test_marked_fails():
            assert False

        def test_after_failing():
            assert no_scope_active()

        @pytest.mark.kernel_policy("disable")
        def test_marked_teardown_error(broken_teardown):
            pass

        def test_after_teardown_error():
            assert no_scope_active()

        @pytest.mark.kernel_policy("disable")
        @pytest.mark.skip(reason="skipped")
        def test_marked_skipped():
            pass

        def test_after_skipped():
            assert no_scope_active() and str(kernelpolicy.current_policy()) == "prefer"
        """,
    )
    result.assert_outcomes(passed=6, failed=1, errors=1, skipped=1)


def test_end_to_end_require_without_kernel_raises(run: Run) -> None:
    result = run(
        """
        import pytest
        import torch
        import kernelpolicy

        @kernelpolicy.use_kernel_forward_from_hub("Double")
        class Double(torch.nn.Module):
            def forward(self, x):
                return 2 * x

        @pytest.mark.kernel_policy(Double="require")
        def test_require_without_kernel():
            with pytest.raises(kernelpolicy.KernelUnavailableError, match="Double"):
                Double()(torch.ones(1))

        def test_prefer_runs_the_original():
            assert Double()(torch.ones(1)).tolist() == [2.0]
        """,
        in_subprocess=True,
    )
    result.assert_outcomes(passed=2)


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.kernel_policy(mode=None, /, **layers):*"])


def test_importing_the_plugin_imports_neither_kernels_nor_torch() -> None:
    # The plugin loads in every pytest run of an environment where kernelpolicy is installed.
    code = (
        "import sys, kernelpolicy.pytest_plugin\n"
        "loaded = {m.split('.')[0] for m in sys.modules} & {'torch', 'kernels'}\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


VARIANT_FIXTURE = """
import pytest
import torch
import kernelpolicy
from kernelpolicy.testing import DemoModel, local_mapping, rms_norm_kernel_source, write_kernel_repo

@pytest.fixture
def model(tmp_path):
    model = DemoModel(16).eval()
    for name, offset in (("default", 1.0), ("mfix", 50.0)):
        repo = write_kernel_repo(tmp_path / name, rms_norm_kernel_source(offset=offset), name=f"n-{name}")
        with local_mapping({"RMSNorm": repo}, inherit=False):
            kernelpolicy.kernelize(model, mode="inference", device="cpu", variant=None if name == "default" else name)
    return model
"""


def test_a_marker_names_a_variant_its_own_fixture_binds(run: Run) -> None:
    """The marker's scope is entered before the fixtures run: its variant names are checked once they have."""
    result = run(
        VARIANT_FIXTURE
        + """
@pytest.mark.kernel_policy(RMSNorm="kernel:mfix")
def test_bound_by_the_fixture(model):
    assert model(torch.ones(2, 16)).mean().item() > 40

@pytest.mark.kernel_policy(RMSNorm="kernel:mnever")
def test_never_bound(model):
    pass
""",
        in_subprocess=True,  # it binds kernels: pytester's in-process runs would import kernelpolicy's op twice
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.kernel_policy: no kernel variant 'mnever' is bound*"])


VARIANT_TESTS = (
    VARIANT_FIXTURE
    + """

def test_bound_by_the_fixture(model):
    assert str(kernelpolicy.current_policy()) == "prefer,RMSNorm=kernel:mfix"
    assert model(torch.ones(2, 16)).mean().item() > 40

@pytest.mark.kernel_policy(SiLU="disable")
def test_marked_too(model):
    assert model(torch.ones(2, 16)).mean().item() > 40
"""
)


def test_the_run_wide_option_names_a_variant_the_fixtures_bind(run: Run, pytester: pytest.Pytester) -> None:
    """As a marker's, the run-wide scope's variants are checked once the test's fixtures have run (issue 41)."""
    # was: every test errored at setup ("kernel_policy: no kernel variant 'mfix' is bound ... none yet")
    result = run(VARIANT_TESTS, "--kernel-policy=RMSNorm=kernel:mfix", in_subprocess=True)
    result.assert_outcomes(passed=2)
    pytester.makeini("[pytest]\nkernel_policy = RMSNorm=kernel:mnever\n")  # the ini option: the same check
    result = run(VARIANT_TESTS, in_subprocess=True)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "ini option kernel_policy 'RMSNorm=kernel:mnever': "
            "no kernel variant 'mnever' is bound for kernel layer 'RMSNorm'*bound: 'mfix', and 'default'*",
            "ini option kernel_policy 'RMSNorm=kernel:mnever' with "
            "@pytest.mark.kernel_policy: no kernel variant 'mnever'*",
        ]
    )

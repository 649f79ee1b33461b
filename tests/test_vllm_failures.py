"""A kernel that raises in a vLLM step fails the requests of its rows only (docs/vllm.md, "Failures"); so does a
policy that requires a kernel an op lacks here.

A real eager engine (tests/_vllm_engines.py) with a provider of ``rms_norm`` that always raises (tests/_vllm_raise.py),
which only a variant entry names: its requests finish with vLLM's ``finish_reason="error"`` and an error naming the
op, the provider and their policy; the other requests of the same steps get their solo tokens; ``fallback_on``
gives the original to the rows of a policy that names the exception; and the engine serves on.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from _vllm_engines import PROMPTS, completions, engine, environment, generate, save_tiny_llama
from _vllm_raise import MESSAGE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NONE, DISABLE, PREFER = None, "disable", "prefer"
RAISE = "rms_norm=kernel:kp_raise"
#: The same kernel, falling back on its error (and a policy whose fallback_on names another exception).
FALLBACK, OTHER_FALLBACK = f"{RAISE},fallback_on=RuntimeError", f"{RAISE},fallback_on=ValueError"
SOLO = [NONE, DISABLE, PREFER]
#: ``require``: rms_norm has the test kernel on this engine, fused_add_rms_norm has none (no ``_vllm_fused``).
REQUIRE, REQUIRE_NORM, REQUIRE_FUSED = "require", "rms_norm=require", {"fused_add_rms_norm": "require"}
#: ``verify``: rms_norm's test kernel differs from its original (its requests fail), silu_and_mul's CPU kernel not.
VERIFY_NORM, VERIFY_SILU = "rms_norm=verify", {"silu_and_mul": "verify"}
BATCHES: list[list[Any]] = [
    [RAISE, DISABLE, NONE, PREFER],  # one policy's rows fail in a step of four paths
    [RAISE, RAISE],  # every row of the step fails
    [FALLBACK, PREFER, OTHER_FALLBACK, NONE],
    [REQUIRE, REQUIRE_NORM, REQUIRE_FUSED, DISABLE],
    [VERIFY_NORM, VERIFY_SILU, DISABLE, NONE],
    [VERIFY_NORM, VERIFY_NORM],  # every row of the step verified
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True, imports="_vllm_provider,_vllm_raise").items():
            patch.setenv(name, value)
        with engine(model, eager=True, kernel_first=False) as llm:
            solo = {repr(policy): [generate(llm, [policy], [prompt])[0] for prompt in PROMPTS] for policy in SOLO}
            batches = [completions(llm, batch) for batch in BATCHES]
            after = generate(llm, [DISABLE, PREFER])
    return {"solo": solo, "batches": batches, "after": after}


def _failed(output: Any) -> bool:
    return bool(output.finish_reason == "error")


def test_the_failing_policy_s_requests_fail_with_an_error_naming_the_op_the_provider_and_the_policy(
    runs: dict[str, Any],
) -> None:
    for batch, outputs in zip(BATCHES, runs["batches"], strict=True):
        for policy, output in zip(batch, outputs, strict=True):
            if policy in (RAISE, OTHER_FALLBACK):
                assert _failed(output), (policy, output)
                reason = str(output.stop_reason)
                assert "rms_norm" in reason and "'kp_raise'" in reason and MESSAGE in reason, reason
                assert repr(policy) in reason, reason


def test_a_policy_requiring_a_kernel_an_op_lacks_fails_naming_the_op_and_the_policy(runs: dict[str, Any]) -> None:
    outputs = runs["batches"][3]
    for policy, output in zip(BATCHES[3], outputs, strict=True):
        if policy in (REQUIRE, REQUIRE_FUSED):
            reason = str(output.stop_reason)
            assert _failed(output) and not output.token_ids, (policy, output)
            assert "requires kernels that these ops lack here: " in reason, reason
            assert "fused_add_rms_norm (no provider but 'native' is supported here)" in reason, reason
    # rms_norm's kernel (the test provider), every other op as vLLM chose: prefer's tokens on this engine
    assert not _failed(outputs[1]) and list(outputs[1].token_ids) == runs["solo"][repr(PREFER)][1]
    assert not _failed(outputs[3]) and list(outputs[3].token_ids) == runs["solo"][repr(DISABLE)][3]


def test_verify_fails_the_requests_whose_kernel_differs_from_the_original_and_serves_the_others(
    runs: dict[str, Any],
) -> None:
    for batch, outputs in zip(BATCHES[4:], runs["batches"][4:], strict=True):
        for row, (policy, output) in enumerate(zip(batch, outputs, strict=True)):
            if policy == VERIFY_NORM:
                reason = str(output.stop_reason)
                assert _failed(output) and not output.token_ids, (policy, output)
                assert "rms_norm's kernel (provider 'kp_test') under verify raised KernelMismatchError" in reason, (
                    reason
                )
                assert "rtol=" in reason and repr(policy) in reason, reason
            elif policy == VERIFY_SILU:  # the kernel computes what the original does: the kernel's tokens
                assert not _failed(output) and list(output.token_ids) == runs["solo"][repr(NONE)][row]


def test_the_other_requests_of_the_step_get_their_solo_tokens(runs: dict[str, Any]) -> None:
    solo = runs["solo"]
    for batch, outputs in zip(BATCHES, runs["batches"], strict=True):
        for row, (policy, output) in enumerate(zip(batch, outputs, strict=True)):
            if policy in SOLO:
                assert not _failed(output) and list(output.token_ids) == solo[repr(policy)][row], (batch, row)


def test_fallback_on_runs_the_original_for_the_rows_of_its_policy_only(runs: dict[str, Any]) -> None:
    fallback = runs["batches"][2][0]
    assert not _failed(fallback)
    # rms_norm's original; every other op as vLLM chose: on this engine, the process default
    assert list(fallback.token_ids) == runs["solo"][repr(NONE)][0]


def test_the_engine_serves_on(runs: dict[str, Any]) -> None:
    solo = runs["solo"]
    assert runs["after"] == [solo[repr(DISABLE)][0], solo[repr(PREFER)][1]]

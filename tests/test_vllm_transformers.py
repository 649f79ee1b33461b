"""vLLM's Transformers backend (``model_impl="transformers"``): what a request's policy governs there (docs/vllm.md).

The backend runs transformers' modeling code with vLLM's layers swapped in (its RMSNorm for ``LlamaRMSNorm``, its
``SiluAndMul`` and linear layers for the MLP, its attention), on tensors with a batch axis of one in front of the
tokens. Real engines (the tiny Llama of tests/_vllm_engines.py, ``rms_norm``'s test kernel first in vLLM's priority),
eager and compiled: transformers' hub-kernel layers are gone or never kernelized, and each request of a mixed batch
gets the tokens it gets alone under its policy, where ``prefer`` and ``disable`` give other tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from _vllm_engines import PROMPTS, engine, environment, generate, save_tiny_llama, transformers_layers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

NONE, DISABLE, PREFER, NORM_OFF = None, "disable", "prefer", "rms_norm=disable"
VARIANT, ROTARY = {"rms_norm": "kernel:kp_other"}, {"rotary_embedding": "disable"}
POLICIES: list[Any] = [NONE, DISABLE, PREFER, NORM_OFF, VARIANT, ROTARY]
MIXES: list[list[Any]] = [[PREFER, DISABLE, NORM_OFF, NONE], [NONE, VARIANT, DISABLE, PREFER]]


@pytest.fixture(scope="module", params=["eager", "compiled"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True).items():
            patch.setenv(name, value)
        patch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends a function
        eager = request.param == "eager"
        with engine(model, eager=eager, kernel_first=True, model_impl="transformers") as llm:
            [layers] = llm.collective_rpc(transformers_layers)
            solo = {repr(policy): [generate(llm, [policy], [prompt])[0] for prompt in PROMPTS] for policy in POLICIES}
            mixes = [generate(llm, mix) for mix in MIXES]
    return {"layers": layers, "solo": solo, "mixes": mixes}


def test_vllm_swaps_transformers_hub_kernel_layers_out_and_never_kernelizes(runs: dict[str, Any]) -> None:
    layers = runs["layers"]
    classes = layers["classes"]
    assert classes[""].endswith(".TransformersForCausalLM")
    # LlamaRMSNorm (use_kernel_forward_from_hub("RMSNorm")) is vLLM's RMSNorm CustomOp; the MLP's act is SiluAndMul
    assert classes["model.layers.0.input_layernorm"].endswith("rms_norm.TPAwareRMSNorm")
    assert classes["model.norm"].endswith("rms_norm.TPAwareRMSNorm")
    assert classes["model.layers.0.mlp.act_fn"] == "vllm.model_executor.layers.activation.SiluAndMul"
    assert layers["hub"] == {}  # no module of a class that transformers marked for hub kernels is left
    # transformers' rotary function (use_kernelized_func) stays, its forward never bound by kernels.kernelize
    assert layers["functions"] == {f"model.layers.{i}.self_attn.rotary_pos_emb": False for i in (0, 1)}
    assert layers["use_kernels"] is False


def test_a_policy_governs_the_norms_vllm_swapped_in(runs: dict[str, Any]) -> None:
    solo = runs["solo"]
    kernel, native = solo[repr(PREFER)], solo[repr(DISABLE)]
    assert all(k != n for k, n in zip(kernel, native, strict=True)), (kernel, native)
    assert solo[repr(NONE)] == kernel  # vLLM's priority runs the test kernel
    assert solo[repr(NORM_OFF)] == native
    assert all(v not in (k, n) for v, k, n in zip(solo[repr(VARIANT)], kernel, native, strict=True))
    # transformers' rotary embedding runs here, not vLLM's rotary_embedding op: the entry changes nothing
    assert solo[repr(ROTARY)] == kernel


@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_each_request_of_a_mixed_batch_gets_its_solo_tokens(runs: dict[str, Any], mix: int) -> None:
    expected = [runs["solo"][repr(policy)][row] for row, policy in enumerate(MIXES[mix])]
    assert runs["mixes"][mix] == expected, MIXES[mix]

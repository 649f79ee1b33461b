"""IR ops choose per row also where vLLM would call them through their torch custom op (docs/vllm.md).

vLLM wraps each IR op in a torch custom op where it compiles with Inductor (its default on a GPU), and a config may
ask for it anywhere (``compilation_config={"ir_enable_torch_wrap": True}``). Through that op, a call reaches the
implementation bound when the op registered, and a compiled program gets one provider lowered in: the per-row choice
would be lost without a word. With the switch on, workers call IR ops plainly. Checked on an eager CPU engine that
asks for the wrap: ``prefer`` and ``disable`` differ on ``rms_norm`` (the test kernel against the native norm), and a
mixed batch gives each request its solo tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from _vllm_engines import PROMPTS, engine, environment, generate, save_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

POLICIES = ["prefer", "disable", None, "rms_norm=kernel:kp_test"]


def test_ir_ops_choose_per_row_with_vllm_s_torch_wrap_asked_for(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True).items():
            patch.setenv(name, value)
        wrap = {"ir_enable_torch_wrap": True}
        with engine(model, eager=True, kernel_first=False, compilation_config=wrap) as llm:
            solo = [generate(llm, [policy], [prompt])[0] for policy, prompt in zip(POLICIES, PROMPTS, strict=True)]
            kernel = generate(llm, ["prefer"], [PROMPTS[1]])[0]
            mixed = generate(llm, POLICIES)
    assert kernel != solo[1]  # the test kernel and the native norm differ: the choice is not lost
    assert mixed == solo

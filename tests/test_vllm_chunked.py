"""Chunked prefill: steps that pack one request's prefill chunk beside other requests' decode rows, each request's
rows on its own policy's path (docs/vllm.md, "One step for every policy").

A real eager engine (tests/_vllm_engines.py) that schedules at most 64 tokens a step, so a 200-token prompt
prefills over four steps while shorter requests decode beside it: every request of a mixed batch gets the tokens it
gets alone under its policy.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from _vllm_engines import LONG_PROMPT, PROMPTS, engine, environment, generate, save_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: Long prompts (chunked) and short ones (decoding beside the chunks), under four policies.
PROMPTS_MIXED = [LONG_PROMPT, PROMPTS[0], LONG_PROMPT[::-1], PROMPTS[1]]
POLICIES: list[Any] = ["prefer", "disable", None, {"rms_norm": "kernel:kp_other"}]


def test_chunked_prefill_beside_decode_rows_keeps_each_request_s_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True).items():
            patch.setenv(name, value)
        chunked = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True, "enable_prefix_caching": False}
        with engine(model, eager=True, kernel_first=False, **chunked) as llm:
            found = {}
            for policies in (POLICIES, POLICIES[1:] + POLICIES[:1]):
                solo = [generate(llm, [p], [prompt])[0] for p, prompt in zip(policies, PROMPTS_MIXED, strict=True)]
                found[repr(policies)] = solo, generate(llm, policies, PROMPTS_MIXED)
    for solo, mixed in found.values():
        assert mixed == solo
    first, second = (solo for solo, _ in found.values())
    # a prompt gets other tokens under another path (disable and no policy: both the native norm on this engine)
    assert [a != b for a, b in zip(first, second, strict=True)] == [True, False, True, True], (first, second)

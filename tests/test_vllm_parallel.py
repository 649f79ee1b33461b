"""kernelpolicy inside vLLM with tensor parallel: two workers, one per rank, take the same choice for the same row
(docs/vllm.md). ``tensor_parallel_size=2`` on this CPU, each worker bound to one core."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("vllm")

from _vllm_engines import PROMPTS, engine, environment, generate, last_codes, save_tiny_llama

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

POLICIES: list[Any] = [
    None,
    "disable",
    {"rms_norm": "disable"},
    {"rotary_embedding": "prefer"},
    {"rotary_embedding": "disable"},
]
MIX: list[Any] = [None, "disable", "prefer", {"rotary_embedding": "disable"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model: Path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True).items():
            patch.setenv(name, value)
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends a function
        with engine(model, eager=True, kernel_first=True, tensor_parallel_size=2) as llm:
            solo = {repr(p): [generate(llm, [p], [prompt])[0] for prompt in PROMPTS] for p in [*POLICIES, "prefer"]}
            mixed = generate(llm, MIX)
            codes = llm.collective_rpc(last_codes)
    return {"solo": solo, "mixed": mixed, "codes": codes}


def test_two_ranks_give_each_request_its_solo_tokens(runs: dict[str, Any]) -> None:
    solo = runs["solo"]
    kernel, original = solo[repr(None)], solo[repr("disable")]
    assert all(k != o for k, o in zip(kernel, original, strict=True))
    assert solo[repr({"rms_norm": "disable"})] == original and solo[repr("prefer")] == kernel
    assert solo[repr({"rotary_embedding": "prefer"})] == kernel == solo[repr({"rotary_embedding": "disable"})]
    assert runs["mixed"] == [solo[repr(policy)][row] for row, policy in enumerate(MIX)]


def test_every_rank_holds_the_same_codes(runs: dict[str, Any]) -> None:
    first, second = runs["codes"]
    assert first == second
    # the last step decoded one token of each request still running, in the batch's order: of none (vLLM's own),
    # disable, prefer and rotary_embedding disabled, those that finish last (the engine core may take a request a
    # step after the others when they reach it apart: under load it does); rows past the step's tokens are 0
    mix = [[0, 0], [2, 2], [1, 1], [0, 2]]
    running = [row for row in first if row != [0, 0]]
    assert running and all(row in mix for row in running), first
    assert first[len(running) + 1 :] == [[0, 0]] * (len(first) - len(running) - 1), first

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
#: Prompts no earlier request shares a block with (their rows are all scheduled: none cached).
FRESH = [[11, 12, 13], [12, 13, 14, 15], [13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model: Path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment(switch=True).items():
            patch.setenv(name, value)
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends a function
        with engine(model, eager=True, kernel_first=True, tensor_parallel_size=2, disable_log_stats=False) as llm:
            solo = {repr(p): [generate(llm, [p], [prompt])[0] for prompt in PROMPTS] for p in [*POLICIES, "prefer"]}
            mixed = generate(llm, MIX)
            codes = llm.collective_rpc(last_codes)
            before = op_rows()
            counted = generate(llm, ["disable", None, "rms_norm=kernel:kp_other"], FRESH)
            rows = op_rows()
    added = {key: value - before.get(key, 0.0) for key, value in rows.items() if value != before.get(key, 0.0)}
    return {"solo": solo, "mixed": mixed, "codes": codes, "rows": added, "counted": counted}


def op_rows() -> dict[tuple[str, str], float]:
    """``kernelpolicy_vllm_op_rows_total`` by (op, path), in this process (an offline ``LLM``'s stat loggers)."""
    from prometheus_client import REGISTRY

    found = (metric for metric in REGISTRY.collect() if metric.name == "kernelpolicy_vllm_op_rows")
    return {(s.labels["op"], s.labels["path"]): s.value for m in found for s in m.samples if s.name.endswith("_total")}


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


def test_the_rows_per_op_and_path_count_once_over_two_ranks(runs: dict[str, Any]) -> None:
    disable, none, variant = (len(p) + len(tokens) - 1 for p, tokens in zip(FRESH, runs["counted"], strict=True))
    ops = ("apply_rotary_emb", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul")
    expected = {(op, "original"): float(disable) for op in ops}
    expected |= {(op, "vllm"): float(none + (0 if op == "rms_norm" else variant)) for op in ops}
    expected["rms_norm", "kernel:kp_other"] = variant  # a variant: its provider
    assert runs["rows"] == expected

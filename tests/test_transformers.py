"""A real transformers Llama (tiny, built from a config) with a local RMSNorm kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import kernels
import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._binding import binding_of
from kernelpolicy.testing import kernel_calls, tiny_llama

pytest.importorskip("transformers")

IDS = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def llama(mapping: Callable[[str], Any]) -> Iterator[Any]:
    model = tiny_llama()
    with mapping("exact"):
        kp.kernelize(model, mode="inference", device="cpu")
        yield model


def calls_during(model: Any, fn: Callable[[], Any]) -> tuple[int, Any]:
    before = kernel_calls(model)
    out = fn()
    return kernel_calls(model) - before, out


def test_forward_counts_and_logits_per_policy(llama: Any) -> None:
    reference = tiny_llama()(IDS).logits  # never kernelized
    calls, out = calls_during(llama, lambda: llama(IDS).logits)
    assert calls == 5  # 2 layers x 2 norms + final norm
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    with kp.kernels_disabled():
        calls, out = calls_during(llama, lambda: llama(IDS).logits)
    assert calls == 0
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    with kp.kernel_policy("disable", RMSNorm="require"):
        assert calls_during(llama, lambda: llama(IDS))[0] == 5
    with kp.kernel_policy(SiLU="disable"):
        assert calls_during(llama, lambda: llama(IDS))[0] == 5


def test_generate_counts_per_policy(llama: Any) -> None:
    def gen() -> torch.Tensor:
        return llama.generate(IDS, max_new_tokens=4, do_sample=False)  # type: ignore[no-any-return]

    calls, tokens = calls_during(llama, gen)
    assert calls == 5 * 4  # one forward per new token (prefill + 3 decode steps)
    with kp.kernels_disabled():
        calls, tokens_off = calls_during(llama, gen)
    assert calls == 0
    assert torch.equal(tokens, tokens_off)


def test_explain_lists_rmsnorm_layers(llama: Any) -> None:
    rows = [r for r in kp.explain(llama) if r.layer_name == "RMSNorm"]
    assert [r.name for r in rows] == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
    assert {r.path for r in rows} == {"kernel"}
    assert {r.module_class.rsplit(".", 1)[-1] for r in rows} == {"LlamaRMSNorm"}
    others = {r.layer_name for r in kp.explain(llama)} - {"RMSNorm"}
    assert "SiLU" in others  # marked by transformers, no kernel mapped: listed with no kernel


def test_transformers_use_kernels_then_attach_survives_train_eval(mapping: Callable[[str], Any]) -> None:
    model = tiny_llama()
    norm = model.model.norm
    with mapping("exact"):
        model.use_kernels = True  # transformers' own kernelize
        kp.attach(model)
        model.train()  # transformers re-kernelizes on mode changes
        model.eval()
        binding = binding_of(norm)
        assert binding is not None and binding.kernel is not None
        assert calls_during(model, lambda: model(IDS))[0] == 5
        with kp.kernels_disabled():
            assert calls_during(model, lambda: model(IDS))[0] == 0
    # outside the mapping, transformers' re-kernelize drops the kernel: kernelpolicy reports it
    model.train()
    model.eval()
    binding = binding_of(norm)
    assert binding is not None and binding.kernel is None
    with (
        kp.kernel_policy(RMSNorm="require"),
        pytest.raises(kp.KernelUnavailableError, match=r"model\.layers\.0\.input_layernorm"),
    ):
        model(IDS)


def test_compiled_llama_follows_policy(llama: Any) -> None:
    compiled = torch.compile(llama, backend="eager", fullgraph=True)
    expected = llama(IDS).logits
    torch.testing.assert_close(compiled(IDS).logits, expected)
    with kp.kernels_disabled():
        torch.testing.assert_close(compiled(IDS).logits, expected)


def test_kernels_mode_flag_accepted(mapping: Callable[[str], Any]) -> None:
    model = tiny_llama()
    with mapping("exact"):
        kp.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    assert calls_during(model, lambda: model(IDS))[0] == 5


def test_record_calls_on_generate(llama: Any) -> None:
    with kp.record_calls() as calls:
        llama.generate(IDS, max_new_tokens=3, do_sample=False)
    counts = calls.by_layer()
    assert counts["RMSNorm"] == {"kernel": 15}  # 5 norms x 3 forwards
    assert counts["SiLU"] == {"original": 6}  # 2 activations x 3 forwards, no kernel mapped
    assert counts["rotary_pos_emb"] == {"original": 6}  # one shared function module, 2 calls per forward
    with kp.record_calls() as calls, kp.kernel_policy(RMSNorm="disable"):
        llama(IDS)
    assert calls.by_layer()["RMSNorm"] == {"original": 5}
    reasons = {reason for (_, layer, _, reason), _ in calls.items() if layer == "SiLU"}
    assert reasons == {"no kernel bound"}

"""peft LoRA adapters on a kernelized model, with real peft (issue 33, "What to build" item 2).

A tiny Llama whose RMSNorm kernel adds 0.5 (``kernelpolicy.kernelize``, mode ``training``) gets LoRA adapters
(``q_proj``/``v_proj``, ``all-linear``, and ``modules_to_save`` with the RMSNorm layers, which peft deep-copies
into a ``ModulesToSaveWrapper``). Under ``prefer`` its outputs and gradients equal those of the same model
kernelized by plain ``kernels`` with the same adapter weights; under ``disable`` those of the model without
kernels, and no kernel runs. The LoRA gradients are non-zero and finite on both paths. ``disable_adapter`` (TRL's
reference model for a peft model) and ``merge_and_unload`` keep the kernel where plain kernels keeps it, and
the policy. A deep copy as TRL's reference model is in tests/test_copies.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kernels
import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._attach._aware import binding_of
from kernelpolicy.testing import (
    kernel_calls,
    kernelize_locally,
    local_mapping,
    tiny_llama,
)

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.utils import ModulesToSaveWrapper  # noqa: E402

pytestmark = [
    # The plain-kernels twin is not policy-aware on purpose: kernelpolicy's once-per-process warning says so.
    pytest.mark.filterwarnings("ignore:the kernel policy .* does not reach:UserWarning"),
    # peft reads transformers' is_gradient_checkpointing, deprecated in recent transformers releases.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

IDS = torch.arange(8).reshape(1, 8) % 256
NORMS = 5  # the tiny Llama's RMSNorm layers: two per decoder layer and the final one
ADAPTERS: dict[str, dict[str, Any]] = {
    "q_proj and v_proj": {"target_modules": ["q_proj", "v_proj"]},
    "all-linear": {"target_modules": "all-linear"},
    "modules_to_save with the norms": {
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": ["input_layernorm", "post_attention_layernorm", "norm"],
    },
}


@pytest.fixture(scope="module")
def repo(kernel_repos: dict[str, Path]) -> Path:
    logging.getLogger("kernels").setLevel(logging.ERROR)
    return kernel_repos["half"]


def _ours(repo: Path) -> Any:
    return kernelize_locally(tiny_llama().train(), {"RMSNorm": repo}, mode="training")


def _plain_kernels(repo: Path) -> Any:
    model = tiny_llama().train()
    with local_mapping({"RMSNorm": repo}):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")  # kernels alone, not kernelpolicy
    return model


def _without_kernels(repo: Path) -> Any:
    return tiny_llama().train()


def _lora(base: Any, adapter: str, weights: dict[str, torch.Tensor] | None = None) -> Any:
    """``base`` with LoRA adapters whose B is not zero (``init_lora_weights=False``), so they change outputs."""
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **ADAPTERS[adapter])
    model = get_peft_model(base, config)
    if weights is not None:
        model.load_state_dict(weights)  # the same adapter weights (and the same saved modules) as the other model
    return model


def _step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step's loss and the gradients of the trainable parameters (LoRA, saved modules)."""
    model.zero_grad()
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_lora_on_a_kernelized_llama_follows_the_policy(repo: Path, adapter: str) -> None:
    ours = _lora(_ours(repo), adapter)
    weights = ours.state_dict()
    twins: dict[str, Callable[[Path], Any]] = {"prefer": _plain_kernels, "disable": _without_kernels}
    for policy, make in twins.items():
        twin = _lora(make(repo), adapter, weights)
        with torch.no_grad():
            expected_logits = twin(IDS).logits
        expected_loss, expected_grads = _step(twin)
        assert any("lora_" in name for name in expected_grads)
        before = kernel_calls(ours)
        with kp.kernel_policy(policy):
            with torch.no_grad():
                logits = ours(IDS).logits
            loss, grads = _step(ours)
        assert kernel_calls(ours) - before == (2 * NORMS if policy == "prefer" else 0), policy  # disable: none ran
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
        torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
        _same(grads, expected_grads)
        for name, grad in grads.items():
            assert grad.isfinite().all() and grad.abs().sum() > 0, (policy, name)
    with torch.no_grad():
        with ours.disable_adapter():  # TRL's reference model for a peft model: the base model, kernel and all
            base = ours(IDS).logits
            with kp.kernels_disabled():
                base_original = ours(IDS).logits
        assert not torch.equal(base, ours(IDS).logits)  # the adapters change the outputs
        plain = _lora(_plain_kernels(repo), adapter, weights)
        with plain.disable_adapter():
            torch.testing.assert_close(base, plain(IDS).logits, rtol=0, atol=0)
        without = _lora(_without_kernels(repo), adapter, weights)
        with without.disable_adapter():
            torch.testing.assert_close(base_original, without(IDS).logits, rtol=0, atol=0)


def test_the_copies_modules_to_save_makes_are_policy_aware_with_their_own_weights(repo: Path) -> None:
    model = _lora(_ours(repo), "modules_to_save with the norms")
    wrapper = model.base_model.model.model.norm
    assert isinstance(wrapper, ModulesToSaveWrapper)
    copy, original = wrapper.modules_to_save["default"], wrapper.original_module
    assert copy is not original and type(copy) is type(original)
    assert binding_of(copy) is not None and binding_of(copy).kernel is not None  # type: ignore[union-attr]
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with kp.kernels_disabled():
            disabled = wrapper(x)
        kernel = wrapper(x)
        assert (kernel - disabled).abs().max().item() == pytest.approx(0.5, abs=1e-4)
        copy.weight.mul_(2.0)  # the copy is what peft trains and runs; the original stays as it was
        torch.testing.assert_close(wrapper(x), 2 * (kernel - 0.5) + 0.5)
        with kp.kernels_disabled():
            torch.testing.assert_close(wrapper(x), 2 * disabled)
            torch.testing.assert_close(original(x), disabled)
        torch.testing.assert_close(original(x), kernel)
    assert not original.weight.requires_grad and copy.weight.requires_grad


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_merge_and_unload_keeps_the_kernel_and_the_policy(repo: Path, adapter: str) -> None:
    ours = _lora(_ours(repo), adapter)
    weights = ours.state_dict()
    plain = _lora(_plain_kernels(repo), adapter, weights).merge_and_unload()
    without = _lora(_without_kernels(repo), adapter, weights).merge_and_unload()
    merged = ours.merge_and_unload()
    assert all(binding_of(module) is not None for module in merged.modules() if type(module).__name__ == "LlamaRMSNorm")
    with torch.no_grad():
        # The kernels stay bound, as plain kernels keeps them, and the policy still decides.
        torch.testing.assert_close(merged(IDS).logits, plain(IDS).logits, rtol=0, atol=0)
        with kp.kernels_disabled():
            torch.testing.assert_close(merged(IDS).logits, without(IDS).logits, rtol=0, atol=0)

"""A real transformers Llama (tiny, built from a config) with a local RMSNorm kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import kernels
import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._attach._aware import binding_of
from kernelpolicy.testing import kernel_calls, kernelize_locally, tiny_llama

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
    reasons = {reason for (_, layer, _, reason, _), _ in calls.items() if layer == "SiLU"}
    assert reasons == {"no kernel bound"}


CAUSAL_CONV1D_KERNEL = """
import torch
import torch.nn.functional as F
from torch import nn

CALLS = [0]


class causal_conv1d_fn(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        CALLS[0] += 1
        _, hidden_size, seq_len = hidden_states.shape
        padding = weight.shape[-1] - 1
        out = F.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias, padding=padding, groups=hidden_size)
        out = out[:, :, :seq_len]
        if activation in ("silu", "swish"):
            out = F.silu(out)
        return out.to(hidden_states.dtype)
"""


def test_mamba2_function_kernel_with_package_fallback_obeys_the_policy(tmp_path: Any) -> None:
    """``use_kernel_func_from_hub_with_fallback``: a hub kernel, else the package (causal_conv1d), else torch.

    Neither package is installed here, so ``disable`` means transformers' torch implementation: what the
    model runs without hub kernels.
    """
    import transformers

    from kernelpolicy.testing import write_kernel_repo

    repo = write_kernel_repo(tmp_path / "repo", CAUSAL_CONV1D_KERNEL, name="causal-conv1d")
    config = transformers.Mamba2Config(
        hidden_size=64, num_hidden_layers=2, vocab_size=256, num_heads=4, head_dim=32, state_size=16, n_groups=1
    )
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(config).eval()
    torch.manual_seed(0)
    reference = transformers.Mamba2ForCausalLM(config).eval()  # never kernelized
    kernelize_locally(model, {"causal_conv1d_fn": repo})
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = reference(ids).logits
    with kp.record_calls() as calls:
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
        with kp.kernel_policy(causal_conv1d_fn="disable"):
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    # one function module, shared by both mixers: a call per layer per forward, kernel then torch
    assert calls.by_layer()["causal_conv1d_fn"] == {"kernel": 2, "original": 2}
    assert calls.by_layer()["mamba_chunk_scan_combined"] == {"original": 4}  # no hub kernel mapped
    rows = {row.layer_name: row for row in kp.explain(model)}
    assert rows["causal_conv1d_fn"].path == "kernel" and rows["causal_conv1d_fn"].name.endswith(
        "mixer.causal_conv1d_fn"
    )
    with kp.kernels_disabled():
        tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, model.generate(ids, max_new_tokens=3, do_sample=False))


SHIFT_KERNEL = """
import torch
from torch import nn


class kp_shift(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        return x + 100
"""


def test_a_function_with_a_package_fallback_takes_the_torch_path_under_disable(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``use_kernel_func_from_hub_with_fallback``: the hub kernel (+100), else the package (+10), else torch.

    The package is real (a folder on ``sys.path``, which transformers imports): without hub kernels
    transformers runs it, and so does ``prefer``; ``disable`` turns every optimized implementation off and
    runs the torch function; ``require`` runs the hub kernel or raises.
    """
    from torch import nn
    from transformers.integrations import hub_kernels

    from kernelpolicy.testing import write_kernel_repo

    package = tmp_path / "kp_fake_package"
    package.mkdir()
    (package / "__init__.py").write_text("def kp_shift(x):\n    return x + 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    @hub_kernels.use_kernel_func_from_hub_with_fallback("kp_shift", "kp_fake_package")
    def kp_shift(x: torch.Tensor) -> torch.Tensor:
        return x

    @hub_kernels.use_kernelized_func(kp_shift)
    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return kp_shift(x)  # type: ignore[no-any-return]

    x = torch.zeros(2)
    assert Block()(x).tolist() == [10.0, 10.0]  # plain transformers: the package
    unkernelized = kp.attach(Block())
    assert unkernelized(x).tolist() == [10.0, 10.0]
    with kp.kernels_disabled():
        assert unkernelized(x).tolist() == [0.0, 0.0]
    with pytest.raises(kp.KernelUnavailableError, match="no kernel bound"), kp.kernel_policy(kp_shift="require"):
        unkernelized(x)

    # (kernels < 0.19 binds a function's one module for every model: from here on all of them have the kernel)
    repo = write_kernel_repo(tmp_path / "repo", SHIFT_KERNEL, name="kp-shift")
    model = kernelize_locally(Block(), {"kp_shift": repo})
    assert model(x).tolist() == [100.0, 100.0]
    with kp.kernel_policy(kp_shift="require"):
        assert model(x).tolist() == [100.0, 100.0]
    with kp.kernels_disabled():
        assert model(x).tolist() == [0.0, 0.0]
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert compiled(x).tolist() == [100.0, 100.0]
    with kp.kernels_disabled():
        assert compiled(x).tolist() == [0.0, 0.0]
    plain = Block()
    with kp._compat._versions.kernels().use_kernel_mapping(
        {"kp_shift": {"cpu": kernels.LocalLayerRepository(repo_path=repo, layer_name="kp_shift")}}
    ):
        kernels.kernelize(plain, mode=kernels.Mode.INFERENCE, device="cpu")
    assert plain(x).tolist() == [100.0, 100.0]  # kernels' own kernelize: the hub kernel
    rows = {row.layer_name: row for row in kp.explain(model)}
    assert rows["kp_shift"].path == "kernel" and rows["kp_shift"].kernel is not None


FUSED_UP_KERNEL = """
import torch
from torch import nn

CALLS = [0]


class FusedUp(nn.Module):
    def forward(self, x):
        CALLS[0] += 1
        return self.up_proj(x)


class FusedUpLayout(nn.Module):
    def __init__(self, up_proj):
        super().__init__()
        self.up_proj = up_proj
"""


def test_a_fused_layout_has_no_original_and_says_so(tmp_path: Any) -> None:
    """transformers' kernel fusion (``KernelConfig`` with a tuple key): the layout's forward is a no-op stub."""
    import transformers
    from transformers.integrations.hub_kernels import register_kernel_replacements_and_fusions
    from transformers.monkey_patching import apply_patches, unregister_patch_mapping

    from kernelpolicy.testing import write_kernel_repo

    repo = write_kernel_repo(tmp_path / "repo", FUSED_UP_KERNEL, name="fused-up")
    config = tiny_llama().config
    kernel_config = transformers.KernelConfig(
        {(("up", "model.layers.*.mlp.up_proj"),): f"{repo}:FusedUp"}, use_local_kernel=True
    )
    register_kernel_replacements_and_fusions(transformers.LlamaForCausalLM, config, kernel_config)
    try:
        with apply_patches():
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config).eval()
    except ModuleNotFoundError as error:  # transformers 5.17's apply_patches imports every model, aria's needs it
        pytest.skip(f"transformers {transformers.__version__} cannot apply its patches here: {error}")
    finally:
        unregister_patch_mapping(["LlamaMLP"])
    kernelize_locally(model, {"FusedUp": repo})
    expected = tiny_llama()(IDS).logits  # the same weights, unfused
    with kp.record_calls() as calls:
        torch.testing.assert_close(model(IDS).logits, expected)  # prefer keeps the fused kernel
    assert calls.by_layer()["FusedUp"] == {"kernel": 2}
    for scope in (kp.kernels_disabled(), kp.kernel_policy(FusedUp="disable")):
        with scope, pytest.raises(kp.errors.OriginalUnavailableError) as info:
            model(IDS)
        assert str(info.value).startswith("no original forward for module 'model.layers.0.mlp.up_proj' (")
        assert "FusedUpLayout, kernel layer 'FusedUp'): a layout of transformers' kernel fusion" in str(info.value)
        assert "load the model without that KernelConfig entry" in str(info.value)
    with kp.kernels_disabled():
        rows = [row for row in kp.explain(model) if row.layer_name == "FusedUp"]
    assert len(rows) == 2 and {row.path for row in rows} == {"error"}


def test_lazily_loaded_kernels_are_listed_as_not_governed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import ModuleType

    from transformers.integrations import hub_kernels

    from kernelpolicy.testing import write_kernel_repo

    repo = write_kernel_repo(tmp_path / "fp8", "import torch\n", name="finegrained-fp8")
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/finegrained-fp8={repo}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, "finegrained-fp8", None)  # removed again after
    assert kp.explain(tiny_llama()).ungoverned == ()
    assert isinstance(hub_kernels.lazy_load_kernel("finegrained-fp8"), ModuleType)  # as an fp8 layer loads it
    explained = kp.explain(tiny_llama())
    assert explained.ungoverned == ("finegrained-fp8 (kernels-community/finegrained-fp8)",)
    assert "hub kernels no policy reaches (loaded by transformers' lazy_load_kernel" in str(explained)

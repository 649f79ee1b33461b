"""Hub attention kernels of transformers under the policy name ``attention``: tiny Llama and Qwen2 from configs.

The kernel is a local repository loaded the way transformers loads one
(``set_attn_implementation("kernels-community/cpu-attention")`` through
``get_kernel`` with ``LOCAL_KERNELS`` and ``HF_HUB_OFFLINE=1``): a CPU stand-in
of flash-attention's interface (``kernelpolicy.testing.flash_attention_kernel_source``),
so transformers runs its real flash path (unpadding, varlen calls, the flash
mask builder) and, on the fallback, its real sdpa path and mask.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _helpers import graph_breaks
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from transformers.integrations.hub_kernels import load_and_register_attn_kernel

import kernelpolicy as kp
from kernelpolicy.testing import FLASH_ATTENTION_EXPORTS, flash_attention_kernel_source, write_kernel_repo

transformers = pytest.importorskip("transformers")

KERNEL = "kernels-community/cpu-attention"
WRONG = "kernels-community/cpu-attention-scaled"  # the same kernel, its output times 1.5
EAGER_FALLBACK = "kernels-community/cpu-attention-eager"  # the same kernel, attached with the eager fallback
AUTO = "kernels-community/cpu-attention-auto"  # the same kernel, for the auto_attach tests
AUTO_EAGER = "kernels-community/cpu-attention-auto-eager"
#: Flash-named (transformers' continuous batching takes only flash kernels), each with one fallback.
FLASH = {"sdpa": "kernels-community/cpu-flash-attention", "eager": "kernels-community/cpu-flash-attention-eager"}
LAYERS = 2
IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
PADDED = torch.ones(2, 7, dtype=torch.long)
PADDED[1, :3] = 0  # left padding in the second sequence


@pytest.fixture(scope="module", autouse=True)
def local_kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    root = tmp_path_factory.mktemp("attention")
    exact = write_kernel_repo(
        root / "exact", flash_attention_kernel_source(), name="cpu-attention", exports=FLASH_ATTENTION_EXPORTS
    )
    scaled = write_kernel_repo(
        root / "scaled",
        flash_attention_kernel_source(scale=1.5),
        name="cpu-attention-scaled",
        exports=FLASH_ATTENTION_EXPORTS,
    )
    eager = write_kernel_repo(
        root / "eager", flash_attention_kernel_source(), name="cpu-attention-eager", exports=FLASH_ATTENTION_EXPORTS
    )
    auto = {
        name: write_kernel_repo(
            root / name, flash_attention_kernel_source(), name=name.split("/")[1], exports=FLASH_ATTENTION_EXPORTS
        )
        for name in (AUTO, AUTO_EAGER, *FLASH.values())
    }
    with pytest.MonkeyPatch.context() as patch:
        repos = {KERNEL: exact, WRONG: scaled, EAGER_FALLBACK: eager, **auto}
        patch.setenv("LOCAL_KERNELS", ":".join(f"{name}={path}" for name, path in repos.items()))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


def _config(family: str) -> Any:
    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS, "vocab_size": 256}
    if family == "llama":
        return transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    if family == "mistral":  # a window shorter than the prompts: the fallback's mask must keep it
        return transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=5, **common)
    return transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)


def build(family: str, attention: str) -> Any:
    """The same weights (seeded) for every ``attention``; policy-aware (attached) when it is a hub kernel."""
    torch.manual_seed(0)
    model_class = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[family]
    model = model_class(_config(family)).eval()
    model.set_attn_implementation(attention)
    return kp.attach(model, attention_fallback="eager" if attention == FLASH["eager"] else None)


def kernel_module(name: str = "cpu_attention") -> ModuleType:
    """The loaded stand-in kernel (its ``CALLS``): the package ``kernels`` imported from the local repository."""
    found = [m for key, m in sys.modules.items() if re.fullmatch(f"_{name}_[0-9a-f]{{12}}", key)]
    assert len(found) == 1, found
    return found[0]


def calls_during(fn: Callable[[], Any]) -> tuple[int, Any]:
    before = kernel_module().CALLS[0]
    out = fn()
    return kernel_module().CALLS[0] - before, out


@pytest.fixture(params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def models(family: str) -> tuple[Any, Any]:
    """(the model on the hub kernel, the same model on sdpa)."""
    return build(family, KERNEL), build(family, "sdpa")


def logits(model: Any, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, attention_mask=mask).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("mask", [None, PADDED], ids=["no padding", "left padding"])
def test_disabled_attention_is_the_sdpa_model_and_prefer_runs_the_kernel_per_layer(
    models: tuple[Any, Any], mask: torch.Tensor | None
) -> None:
    model, sdpa = models
    expected = logits(sdpa, mask)
    with kp.kernel_policy(attention="disable"):
        calls, out = calls_during(lambda: logits(model, mask))
    assert calls == 0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # sdpa's function and sdpa's mask
    calls, out = calls_during(lambda: logits(model, mask))
    assert calls == LAYERS  # once per attention layer per forward
    real = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(out[real], expected[real], rtol=1e-4, atol=1e-5)
    with kp.kernels_disabled():
        assert calls_during(lambda: logits(model, mask))[0] == 0


def test_record_calls_and_explain_show_the_attention_row(models: tuple[Any, Any]) -> None:
    model, _ = models
    with kp.record_calls() as calls:
        logits(model, PADDED)
        with kp.kernel_policy(attention="disable"):
            logits(model, PADDED)
    assert calls.by_layer()["attention"] == {"kernel": LAYERS, "original": LAYERS}
    assert calls.by_module()["(attention)"] == {"kernel": LAYERS, "original": LAYERS}
    rows = {row.name: row for row in kp.explain(model)}
    row = rows["(attention)"]
    assert (row.layer_name, row.kernel, row.path, row.reason) == ("attention", KERNEL, "kernel", "kernel usable")
    with kp.kernel_policy("prefer", attention="disable"):
        row = {r.name: r for r in kp.explain(model)}["(attention)"]
    assert (row.mode, row.path, row.reason) == ("disable", "original", "disabled by policy")
    assert re.search(rf"\(attention\)\s+attention\s+HubAttention\s+{KERNEL}\s+yes", str(kp.explain(model)))


def test_registering_the_kernel_again_shows_and_attach_restores(family: str) -> None:
    model = build(family, KERNEL)
    load_and_register_attn_kernel(KERNEL)  # e.g. another model loaded with it: transformers' function again
    row = {r.name: r for r in kp.explain(model)}["(attention)"]
    assert not row.policy_aware and "call kernelpolicy.attach(model)" in row.reason
    with kp.kernel_policy(attention="disable"):
        assert calls_during(lambda: logits(model, None))[0] == LAYERS  # not under the policy: said in explain
    kp.attach(model)
    with kp.kernel_policy(attention="disable"):
        assert calls_during(lambda: logits(model, None))[0] == 0


@pytest.mark.parametrize(
    "policy", ["prefer", "disable", "attention=require", "attention=verify", "disable,attention=require"]
)
def test_generate_under_each_policy_gives_the_sdpa_tokens(models: tuple[Any, Any], policy: str) -> None:
    model, sdpa = models
    expected = sdpa.generate(IDS, attention_mask=PADDED, max_new_tokens=3, do_sample=False)
    with kp.kernel_policy(kp.Policy.parse(policy)):
        calls, tokens = calls_during(
            lambda: model.generate(IDS, attention_mask=PADDED, max_new_tokens=3, do_sample=False)
        )
    assert torch.equal(tokens, expected)
    uses_kernel = kp.Policy.parse(policy).mode_for("attention") != "disable"
    assert calls == (LAYERS * 3 if uses_kernel else 0)  # one forward per new token


def test_verify_compares_the_kernel_with_the_fallback_on_its_own_mask(family: str) -> None:
    model = build(family, KERNEL)
    with kp.kernel_policy(attention="verify"), kp.record_calls() as calls:
        logits(model, PADDED)  # the fallback gets sdpa's 4-D mask, the kernel the 2-D padding mask
    assert calls.by_layer()["attention"] == {"kernel": LAYERS}
    wrong = build(family, WRONG)
    with kp.kernel_policy(attention="verify"), pytest.raises(kp.KernelMismatchError) as info:
        logits(wrong, PADDED)
    assert info.value.layer_name == "attention" and info.value.module_name == "(attention)"
    assert "elements differ" in str(info.value)
    with kp.kernel_policy(attention="disable"):
        torch.testing.assert_close(logits(wrong, None), logits(build(family, "sdpa"), None), rtol=0, atol=0)


def test_threads_each_see_their_own_attention_policy(family: str) -> None:
    model = build(family, KERNEL)
    seen: dict[str, dict[str, int]] = {}
    barrier = threading.Barrier(2, timeout=60)

    def run(policy: str) -> None:
        with kp.kernel_policy(kp.Policy.parse(policy)), kp.record_calls() as calls:
            barrier.wait()
            for _ in range(3):
                logits(model, PADDED)
        seen[policy] = calls.by_layer()["attention"]

    threads = [threading.Thread(target=run, args=(p,)) for p in ("prefer", "attention=disable")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert seen == {"prefer": {"kernel": 3 * LAYERS}, "attention=disable": {"original": 3 * LAYERS}}


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_fullgraph_guards_on_the_policy_without_graph_breaks() -> None:
    # No padding mask: transformers' own flash mask builder branches on a padded mask's data
    # (``attention_mask.all()``), so fullgraph=True fails on a padded batch without kernelpolicy too.
    # bfloat16: on float32 inputs transformers' flash path logs a cast warning, which breaks the graph.
    model = build("llama", WRONG).to(torch.bfloat16)  # the scaled kernel: its logits show the path in the graph
    eager = {}
    for mode in ("prefer", "disable"):
        with kp.kernel_policy(attention=mode):
            eager[mode] = logits(model, None)
    assert not torch.allclose(eager["prefer"], eager["disable"])
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    counters.clear()
    for mode in ("prefer", "disable", "prefer", "disable"):
        with kp.kernel_policy(attention=mode):
            torch.testing.assert_close(logits(compiled, None), eager[mode])
    assert backend.frame_count == 2 and graph_breaks() == 0  # one program per path, reused
    with kp.kernel_policy("disable", attention="require"):
        torch.testing.assert_close(logits(compiled, None), eager["prefer"])  # the same program as prefer
    assert backend.frame_count == 2


def test_fallback_is_named_checked_and_one_per_kernel_name() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config("llama")).eval()
    model.set_attn_implementation(KERNEL)
    with pytest.raises(kp.PolicyError, match=r"unknown attention fallback 'flash'; valid ones are .*'sdpa'"):
        kp.attach(model, attention_fallback="flash")
    kp.attach(model)
    with pytest.raises(kp.PolicyError, match=r"already falls back to 'sdpa', not 'eager'"):
        kp.attach(model, attention_fallback="eager")


def test_an_eager_fallback_is_the_eager_model() -> None:
    model = build("qwen2", "eager")
    model.set_attn_implementation(EAGER_FALLBACK)
    kp.attach(model, attention_fallback="eager")
    expected = logits(build("qwen2", "eager"), PADDED)
    with kp.kernel_policy(attention="disable"):
        torch.testing.assert_close(logits(model, PADDED), expected, rtol=0, atol=0)


def test_the_kernelpolicy_variable_reaches_attention(tmp_path: Any) -> None:
    import os
    import subprocess
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from test_attention import build, calls_during, logits, IDS
        model = build("llama", {KERNEL!r})
        print(calls_during(lambda: logits(model, None))[0])
        """
    )
    env = {**os.environ, "KERNELPOLICY": "prefer,attention=disable"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0"


def test_auto_attach_governs_the_hub_attention_of_a_use_kernels_model(mapping: Callable[[str], Any]) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config("llama")).eval()
    model.set_attn_implementation(AUTO)
    kp.auto_attach()
    with mapping("exact"):
        model.use_kernels = True  # transformers' kernelize: kernels binds the RMSNorm layers, auto_attach attaches
    row = next(row for row in kp.explain(model) if row.layer_name == "attention")
    assert row.policy_aware and row.kernel == AUTO
    expected = logits(build("llama", "sdpa"), None)
    with kp.kernel_policy(attention="disable"):
        torch.testing.assert_close(logits(model, None), expected)


def test_auto_attach_keeps_the_fallback_kernelpolicy_kernelize_names(mapping: Callable[[str], Any]) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config("llama")).eval()
    model.set_attn_implementation(AUTO_EAGER)
    kp.auto_attach()
    with mapping("exact"):
        kp.kernelize(model, mode="inference", device="cpu", attention_fallback="eager")  # not sdpa, the default
    with pytest.raises(kp.PolicyError, match=r"already falls back to 'eager', not 'sdpa'"):
        kp.attach(model, attention_fallback="sdpa")


@pytest.mark.parametrize(
    ("family", "fallback"), [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa")], ids=lambda v: str(v)
)
def test_disabled_attention_in_continuous_batching_gets_the_solo_tokens(family: str, fallback: str) -> None:
    """transformers packs a step's requests into one sequence and, for a flash-named kernel, builds no mask for it:
    the fallback gets each request's causal block (Mistral: its sliding window of 5 too), alone and mixed with
    ``prefer`` in one manager (was: sdpa attended across requests, or failed on the step's shapes). The eager
    fallback alone: mixed, its attention weights meet the kernel's None in the join (``_mixing``'s outputs)."""
    from kernelpolicy._compat import _compat

    if not all(_compat.first_present(seam) for seam in _compat.BATCHING):
        pytest.skip(f"transformers {transformers.__version__} has not the batching seams of 5.22-5.25")
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build(family, FLASH[fallback])
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (7, 9, 4, 11)]
    off, on = kp.Policy.parse("attention=disable"), kp.Policy.parse("prefer")

    def solo(policy: kp.Policy, prompt: list[int]) -> list[int]:
        with kp.kernel_policy(policy):
            return list(model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist())

    for policies in ([off] * 4, [off, on] * 2) if fallback == "sdpa" else ([off] * 4,):
        manager = model.init_continuous_batching(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=64),
        )
        manager.start()
        try:
            ids = []
            for policy, prompt in zip(policies, prompts, strict=True):
                with kp.kernel_policy(policy):
                    ids.append(manager.add_request(prompt))
            results: dict[str, Any] = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                assert result is not None, f"no result; have {sorted(results)}"
                if result.is_finished():
                    results[result.request_id] = result
        finally:
            manager.stop(block=True, timeout=30)
        outputs = [results[i] for i in ids]
        assert [o.error for o in outputs] == [None] * 4
        expected = [solo(p, prompt) for p, prompt in zip(policies, prompts, strict=True)]
        assert [o.generated_tokens for o in outputs] == expected

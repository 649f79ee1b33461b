"""Other libraries' forward wrappers around a policy-aware module (issue 33, finding 1), with real accelerate.

Only kernels' binding is a kernel: accelerate's hooks (``cpu_offload``, ``dispatch_model`` with layers on disk,
``add_hook_to_module``), a ``functools.partial`` or a plain function assigned as ``module.forward`` wrap the
policy's dispatch, as they wrap a plain module's forward, and removing them restores it. A tiny Llama whose
RMSNorm kernel adds 0.5 generates other tokens than its original forward; offloaded, it must generate the
tokens of the same model without offload, on the path the policy chose, eager and compiled.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy.testing import kernelize_locally, tiny_llama

accelerate = pytest.importorskip("accelerate")
from accelerate import cpu_offload, dispatch_model  # noqa: E402
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module  # noqa: E402

IDS = torch.arange(8).reshape(1, 8) % 256
POLICIES = ["prefer", "disable"]


@pytest.fixture(scope="module")
def repo(kernel_repos: dict[str, Path]) -> Path:
    logging.getLogger("kernels").setLevel(logging.ERROR)
    return kernel_repos["half"]


def _llama(repo: Path) -> Any:
    torch.manual_seed(0)
    return kernelize_locally(tiny_llama().eval(), {"RMSNorm": repo}, mode="inference")


def _tokens(model: Any) -> list[int]:
    with torch.no_grad():
        return list(model.generate(IDS, max_new_tokens=8, do_sample=False)[0].tolist())


def _offloaded(repo: Path, how: str, tmp_path: Path) -> Any:
    model = _llama(repo)
    if how == "cpu_offload":
        return cpu_offload(model, execution_device="cpu")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    return dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path / "offload"))


@pytest.fixture(scope="module")
def expected(repo: Path) -> dict[str, list[int]]:
    model = _llama(repo)
    tokens = {}
    for policy in POLICIES:
        with kp.kernel_policy(policy):
            tokens[policy] = _tokens(model)
    assert tokens["prefer"] != tokens["disable"], "the kernel must change the tokens"
    return tokens


@pytest.mark.parametrize("how", ["cpu_offload", "dispatch_model with a layer on disk"])
def test_offloaded_models_generate_the_policys_tokens(
    repo: Path, expected: dict[str, list[int]], how: str, tmp_path: Path
) -> None:
    model = _offloaded(repo, how, tmp_path)
    norm = model.model.layers[0].input_layernorm
    rows = [row for row in kp.explain(model).rows if row.layer_name == "RMSNorm"]
    assert {row.path for row in rows} == {"kernel"}  # the offload hooks did not become the kernels
    assert isinstance(norm.forward, functools.partial)  # accelerate's hook is the forward, around the dispatch
    for policy in POLICIES:
        with kp.kernel_policy(policy):
            assert _tokens(model) == expected[policy], policy


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cpu_offload", "dispatch_model with a layer on disk"])
def test_offloaded_models_compiled_follow_the_policy(repo: Path, how: str, tmp_path: Path) -> None:
    import torch._dynamo

    reference = _llama(repo)
    with torch.no_grad():
        logits = {}
        for policy in POLICIES:
            with kp.kernel_policy(policy):
                logits[policy] = reference(IDS).logits
        torch._dynamo.reset()
        compiled = torch.compile(_offloaded(repo, how, tmp_path), backend="eager")
        for policy in POLICIES:
            with kp.kernel_policy(policy):
                torch.testing.assert_close(compiled(IDS).logits, logits[policy], rtol=0, atol=0)
    torch._dynamo.reset()


class _Counting(ModelHook):  # type: ignore[misc]
    def __init__(self) -> None:
        self.calls = 0

    def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.calls += 1
        return args, kwargs


def test_a_hook_wraps_the_dispatch_and_its_removal_restores_it(repo: Path) -> None:
    import torch._dynamo

    norm = _llama(repo).model.norm
    x = torch.randn(1, 4, 64)
    with kp.kernels_disabled():
        original = norm(x)
    kernel = norm(x)
    assert (kernel - original).abs().max().item() == pytest.approx(0.5, abs=1e-4)
    hook = _Counting()
    add_hook_to_module(norm, hook)
    with kp.kernels_disabled():
        torch.testing.assert_close(norm(x), original)  # the hook ran, then the policy's path
    torch.testing.assert_close(norm(x), kernel)
    assert hook.calls == 2
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(norm, backend="eager")(x), kernel)  # compiled: hook and kernel
    assert hook.calls == 3
    remove_hook_from_module(norm)
    assert norm.forward.__qualname__ == "kernelpolicy.always_usable.forward"
    forward = norm.forward
    norm.forward = forward  # the same forward assigned again stays the dispatch (was: taken for a kernel)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(norm, backend="eager", fullgraph=True)(x), kernel)
    with kp.kernels_disabled():
        torch.testing.assert_close(norm(x), original)
    torch._dynamo.reset()


def test_a_users_wrapper_wraps_the_dispatch_and_del_removes_it(repo: Path) -> None:
    norm = _llama(repo).model.norm
    x = torch.randn(1, 4, 64)
    dispatch = norm.forward
    seen: list[str] = []

    def logged(*args: Any, **kwargs: Any) -> Any:
        seen.append(kp.current_policy().default)
        return dispatch(*args, **kwargs)

    norm.forward = logged
    with kp.kernels_disabled():
        original = norm(x)
    kernel = norm(x)
    assert seen == ["disable", "prefer"] and (kernel - original).abs().max().item() == pytest.approx(0.5, abs=1e-4)
    assert kp.explain(norm).rows[0].kernel is not None  # still the kernel kernels bound
    del norm.forward
    assert norm.forward is dispatch
    norm(x)
    assert seen == ["disable", "prefer"]


def test_class_patches_reach_every_instance_on_the_original_path(repo: Path) -> None:
    """Issue 33, finding 3 (was: attached and decorated instances kept the class's old forward)."""
    from unittest import mock

    @kp.use_kernel_forward_from_hub("KpTwice")
    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    decorated, plain = Twice(), torch.nn.Linear(1, 1)
    norm_model = _llama(repo)
    norm = norm_model.model.norm
    x = torch.ones(1, 64)
    with kp.kernels_disabled():
        before = norm(x)
    kernel = norm(x)
    with (
        mock.patch.object(Twice, "forward", lambda self, x: 3 * x),
        mock.patch.object(type(norm).__mro__[1], "forward", lambda self, x: x - 7),
        mock.patch.object(torch.nn.Linear, "forward", lambda self, x: x * 0),
    ):
        assert plain(torch.ones(1)).item() == 0  # the plain torch behaviour
        assert decorated(torch.ones(1)).item() == 3 == Twice()(torch.ones(1)).item()
        with kp.kernels_disabled():
            torch.testing.assert_close(norm(x), x - 7)  # the patched class forward is the original now
        torch.testing.assert_close(norm(x), kernel)  # the kernel is still the kernel
        with kp.kernel_policy("verify", atol=1.0), pytest.raises(kp.KernelMismatchError):
            norm(x)  # verify compares with the patched original (x - 7, against the kernel's output)
    assert decorated(torch.ones(1)).item() == 2  # the patch undone: the class's own forward again
    with kp.kernels_disabled():
        torch.testing.assert_close(norm(x), before)

"""Training: forwards that PyTorch runs again (checkpoint recomputation, torch.func) take the path of the first run.

Real parts throughout: local kernel repositories bound by ``kernelpolicy.kernelize(mode="training")``, real
``backward()`` through ``torch.utils.checkpoint`` (both modes), ``checkpoint_sequential``, torch.distributed's
``checkpoint_wrapper`` and transformers' gradient checkpointing on a tiny Llama. A path is observed through the
gradients (the test kernel adds 100, which changes every activation after it) and through the kernel's own call
counter during ``backward()``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import in_another_thread
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential

import kernelpolicy as kp
from kernelpolicy._forward._dispatch import NO_BACKWARD, UNVERIFIED_IN_TRANSFORM
from kernelpolicy._forward._failures import _logged
from kernelpolicy.testing import DemoModel, kernel_calls, kernelize_locally, tiny_llama, write_kernel_repo
from kernelpolicy.training import checkpoint

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
#: The loss is the output weighted by this (an RMSNorm output's sum of squares would not depend on the blocks).
PROBE = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))

Step = Callable[[DemoModel, torch.Tensor], torch.Tensor]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _plain(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = x + block(x)
    out: torch.Tensor = model.norm(x)
    return out


def _checkpointed(checkpointing: Callable[..., torch.Tensor], /, **kwargs: Any) -> Step:
    def step(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            x = x + checkpointing(block, x, **kwargs)
        out: torch.Tensor = model.norm(x)
        return out

    return step


def _train_step(
    model: nn.Module, step: Callable[[Any, torch.Tensor], torch.Tensor], forward_scope: Any, backward: str
) -> tuple[list[torch.Tensor], int]:
    """One step: the forward inside ``forward_scope``, ``backward()`` called as ``backward`` says.

    Returns the gradients and the kernel calls made during ``backward()`` (the recomputations).
    """
    model.zero_grad()
    x = X.clone().requires_grad_()
    with forward_scope:
        out = step(model, x)
        loss = (out * PROBE).sum() if out.dim() else out
    before = kernel_calls(model)
    if backward == "after the scope":
        loss.backward()
    elif backward == "under another scope":
        with kp.kernel_policy("require") if forward_scope is not _PREFER else kp.kernels_disabled():
            loss.backward()
    else:  # from another thread, which starts from the process default
        in_another_thread(loss.backward)
    return _grads(model), kernel_calls(model) - before


_PREFER = kp.kernel_policy("prefer")
BACKWARDS = ["after the scope", "under another scope", "from another thread"]


@pytest.fixture
def training_model(kernelized: Callable[..., DemoModel]) -> DemoModel:
    """A DemoModel in train mode with the traceable kernel (adds 100, has a backward) bound for training."""
    return kernelized("traceable", mode="training").train()


def _assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("scope", ["kernels_disabled", "prefer"])
def test_checkpoint_recomputes_on_the_path_of_the_forward(
    training_model: DemoModel, backward: str, reentrant: bool, scope: str
) -> None:
    forward_scope = kp.kernels_disabled() if scope == "kernels_disabled" else _PREFER
    expected, _ = _train_step(training_model, _plain, forward_scope, "after the scope")
    grads, recomputed = _train_step(
        training_model, _checkpointed(checkpoint, use_reentrant=reentrant), forward_scope, backward
    )
    _assert_same(grads, expected)
    # The checkpointed blocks hold one RMSNorm each: recomputed on the kernel only where the forward took it.
    assert recomputed == (2 if scope == "prefer" else 0)


def test_checkpoint_with_context_fn_and_another_checkpoint_function(training_model: DemoModel) -> None:
    entered: list[str] = []

    @contextlib.contextmanager
    def note(what: str) -> Iterator[None]:
        entered.append(what)
        yield

    def contexts() -> tuple[Any, Any]:
        return note("forward"), note("recompute")

    def offloading(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu():  # transformers' offload=True wraps checkpoint like this
            return torch_checkpoint(function, *args, **kwargs)

    expected, _ = _train_step(training_model, _plain, kp.kernels_disabled(), "after the scope")
    for step in (
        _checkpointed(checkpoint, use_reentrant=False, context_fn=contexts),
        _checkpointed(checkpoint, use_reentrant=False, checkpoint_fn=offloading),
    ):
        grads, recomputed = _train_step(training_model, step, kp.kernels_disabled(), "after the scope")
        _assert_same(grads, expected)
        assert recomputed == 0
    assert entered.count("forward") == 2 and entered.count("recompute") == 2


def test_checkpoint_sequential_with_propagated_functions(training_model: DemoModel) -> None:
    layers = [layer for block in training_model.blocks for layer in block]  # 8 layers, 2 RMSNorm

    def sequential(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
        functions = [kp.propagate(layer) for layer in layers]
        out: torch.Tensor = model.norm(checkpoint_sequential(functions, 2, x, use_reentrant=False))
        return out

    def plain(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        out: torch.Tensor = model.norm(x)
        return out

    expected, _ = _train_step(training_model, plain, kp.kernels_disabled(), "after the scope")
    grads, recomputed = _train_step(training_model, sequential, kp.kernels_disabled(), "after the scope")
    _assert_same(grads, expected)
    assert recomputed == 0


@pytest.mark.parametrize("applied", ["before attach", "after attach, checkpoint_fn"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_wrapper(mapping: Callable[[str], Any], applied: str, reentrant: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT

    def wrapped(model: DemoModel) -> DemoModel:
        for index, block in enumerate(model.blocks):
            if applied == "before attach":
                model.blocks[index] = checkpoint_wrapper(block, checkpoint_impl=impl)
            else:
                model.blocks[index] = checkpoint_wrapper(
                    block, checkpoint_fn=kp.training.checkpoint, use_reentrant=reentrant
                )
        return model

    def build(wrap: bool) -> DemoModel:
        torch.manual_seed(0)
        model = DemoModel(16).train()
        if wrap and applied == "before attach":
            wrapped(model)
        with mapping("traceable"):
            kp.kernelize(model, mode="training", device="cpu")
        if wrap and applied != "before attach":
            wrapped(model)
        return model

    expected, _ = _train_step(build(False), _plain, kp.kernels_disabled(), "after the scope")
    grads, recomputed = _train_step(build(True), _plain, kp.kernels_disabled(), "after the scope")
    _assert_same(grads, expected)
    assert recomputed == 0


def _llama_step(model: Any, x: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(16).reshape(2, 8) % 256
    out: torch.Tensor = model(ids, labels=ids).loss + 0 * x.sum()
    return out


@pytest.mark.parametrize("enabled", ["before kernelize", "after kernelize"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("backward", ["after the scope", "from another thread"])
def test_transformers_gradient_checkpointing(
    mapping: Callable[[str], Any], enabled: str, reentrant: bool, backward: str
) -> None:
    def build(checkpointing: bool) -> Any:
        model = tiny_llama().train()
        gc_kwargs = {"use_reentrant": reentrant}
        if checkpointing and enabled == "before kernelize":
            model.gradient_checkpointing_enable(gc_kwargs)
        with mapping("traceable"):
            kp.kernelize(model, mode="training", device="cpu")
        if checkpointing and enabled == "after kernelize":
            model.gradient_checkpointing_enable(gc_kwargs)
        return model

    expected, _ = _train_step(build(False), _llama_step, kp.kernels_disabled(), "after the scope")
    model = build(True)
    grads, recomputed = _train_step(model, _llama_step, kp.kernels_disabled(), backward)
    _assert_same(grads, expected)
    assert recomputed == 0  # 2 decoder layers, 2 RMSNorm each: 4 kernel calls without the replay
    # And the other way round: a forward on the kernels recomputes on them, under any caller's scope.
    expected, _ = _train_step(build(False), _llama_step, _PREFER, "after the scope")
    grads, recomputed = _train_step(model, _llama_step, _PREFER, "under another scope")
    _assert_same(grads, expected)
    assert recomputed == 4


def test_transformers_checkpointing_survives_disable_and_copy(mapping: Callable[[str], Any]) -> None:
    import copy

    from transformers.modeling_layers import GradientCheckpointingLayer

    model = tiny_llama().train()
    with mapping("traceable"):
        kp.kernelize(model, mode="training", device="cpu")
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.gradient_checkpointing_disable()
    assert not any(m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
    model.gradient_checkpointing_enable({"use_reentrant": False})
    other = copy.deepcopy(model)
    assert other._set_gradient_checkpointing.model is other
    other.gradient_checkpointing_enable({"use_reentrant": True})
    layers = [m for m in other.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all(m._gradient_checkpointing_func.func is checkpoint for m in layers)
    assert all(m._gradient_checkpointing_func.keywords["checkpoint_fn"].keywords["use_reentrant"] for m in layers)


def test_recomputations_are_recorded_where_backward_runs(training_model: DemoModel) -> None:
    x = X.clone().requires_grad_()
    with kp.kernels_disabled(), kp.record_calls() as forward_calls:
        loss = _checkpointed(checkpoint, use_reentrant=False)(training_model, x).sum()
    with kp.record_calls() as backward_calls:
        loss.backward()
    assert forward_calls.by_layer() == {"RMSNorm": {"original": 3}}
    assert backward_calls.by_layer() == {"RMSNorm": {"original": 2}}  # the two checkpointed blocks


# --- kernels without backward follow autograd -----------------------------------------------------------------


def test_no_backward_kernel_under_torch_func_grad_and_eval(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("no_backward").eval()
    reference = kernelized("no_backward").eval()

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).sum()

    grad = torch.func.grad(loss)(X)  # the input requires grad inside the transform: the original runs
    with kp.kernels_disabled():
        expected = torch.func.grad(lambda x: reference(x).pow(2).sum())(X)
    torch.testing.assert_close(grad, expected)
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match=NO_BACKWARD.split(" (")[0]):
        torch.func.grad(loss)(X)


# --- torch.func transforms under every mode --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefer", "disable", "require", "verify"])
def test_torch_func_transforms_take_each_modes_path(
    kernelized: Callable[..., DemoModel], mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = kernelized("traceable")  # adds 100
    kernel = mode != "disable"
    batch = X.reshape(2, 2, 16)
    params = {name: p.detach() for name, p in model.named_parameters()}
    _logged.discard(("RMSNorm", "not verified in transform"))
    with kp.kernel_policy(mode):
        eager = torch.stack([model(b) for b in batch]) if mode != "verify" else None
    with kp.kernel_policy(mode), caplog.at_level(logging.WARNING, logger="kernelpolicy"), kp.record_calls() as calls:
        mapped = torch.func.vmap(model)(batch)
        grad = torch.func.grad(lambda x: model(x).sum())(X)
        jacobian = torch.func.jacrev(lambda x: model(x).sum(0))(X[:1])
        functional = torch.func.grad(lambda p: torch.func.functional_call(model, p, (X,)).sum())(params)
    assert (mapped.mean().item() > 50) is kernel
    if eager is not None:
        torch.testing.assert_close(mapped, eager)
    for name, value in (("grad", grad), ("jacrev", jacobian), *functional.items()):
        assert torch.isfinite(value).all(), name
    assert calls.total(path="kernel" if kernel else "original") == calls.total() == 4 * 3
    if mode == "verify":
        assert {key[3] for key, _ in calls.items()} == {UNVERIFIED_IN_TRANSFORM}
        warnings = [r.getMessage() for r in caplog.records if r.name == "kernelpolicy"]
        assert len(warnings) == 1 and "torch.func transform" in warnings[0]


def test_verify_under_vmap_with_an_exact_kernel(kernelized: Callable[..., DemoModel]) -> None:
    model = kernelized("exact")
    batch = X.reshape(2, 2, 16)
    with kp.kernel_policy("verify"):
        out = torch.func.vmap(model)(batch)
        eager = model(batch[0])  # outside the transform verify compares
    torch.testing.assert_close(out[0], eager)


# --- gradcheck through both paths ------------------------------------------------------------------------------

_SOFTSIGN_KERNEL = """
    import torch
    from torch import nn


    class Softsign(nn.Module):
        has_backward = True

        def forward(self, x):
            return self.weight * x / (1 + x.abs()) + 0.5
"""


@kp.use_kernel_forward_from_hub("Softsign")
class Softsign(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / (1 + x.abs())


@pytest.fixture(scope="module")
def softsign_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kernel_repo(tmp_path_factory.mktemp("softsign"), _SOFTSIGN_KERNEL, name="softsign")


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("mode", ["prefer", "disable"])
def test_gradcheck_in_float64_through_both_paths(softsign_repo: Path, mode: str, checkpointed: bool) -> None:
    layer = kernelize_locally(Softsign(), {"Softsign": softsign_repo}, mode="training")
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with kp.kernel_policy(mode):
        shift = (layer(x) - layer.weight * x / (1 + x.abs())).detach()
        assert bool(torch.allclose(shift, torch.full_like(shift, 0.5))) is (mode == "prefer")

        def run(value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return checkpoint(layer, value, use_reentrant=False) if checkpointed else layer(value)

        assert torch.autograd.gradcheck(run, (x, layer.weight))
        assert torch.autograd.gradgradcheck(run, (x, layer.weight))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_kernel_without_backward_gives_way_in_both_passes_of_a_checkpoint(
    kernelized: Callable[..., DemoModel], reentrant: bool
) -> None:
    model = kernelized("no_backward").train()  # kernels binds no such kernel for mode="training"
    expected, _ = _train_step(model, _plain, _PREFER, "after the scope")
    before = kernel_calls(model)
    grads, recomputed = _train_step(
        model, _checkpointed(checkpoint, use_reentrant=reentrant), _PREFER, "after the scope"
    )
    _assert_same(grads, expected)
    assert kernel_calls(model) - before == recomputed == 0  # the original in the forward pass and the recomputation
    # torch's reentrant checkpoint runs the forward pass under no_grad, where the kernel runs, and its
    # recomputation cannot: it raises (tests/test_recomputation.py), where kernelpolicy's gives way in both.
    x = X.clone().requires_grad_()
    with kp.record_calls() as calls, pytest.raises(kp.training.RecomputationError):
        _checkpointed(torch_checkpoint, use_reentrant=True)(model, x).sum().backward()
    assert calls.by_layer() == {"RMSNorm": {"kernel": 2, "original": 1}}
    with torch.no_grad(), kp.record_calls() as calls:  # no grad where the checkpoint is taken: the kernel is fine
        _checkpointed(checkpoint, use_reentrant=reentrant)(model, X)
    assert calls.by_layer() == {"RMSNorm": {"kernel": 3}}

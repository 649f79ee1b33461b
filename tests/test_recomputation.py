"""Every activation checkpoint recomputes on the path of the forward it replays, or raises (issue 31).

torch's own checkpointing, called directly: ``torch.utils.checkpoint.checkpoint`` in both modes,
``checkpoint_sequential``, torch.distributed's ``checkpoint_wrapper`` and ``apply_activation_checkpointing``
(applied before or after ``kernelize``) and FSDP2 (``fully_shard`` on a one-rank gloo group) with activation
checkpointing. Nothing of kernelpolicy's is handed to torch: the replay comes from the forwards themselves
(``kernelpolicy._forward._replay``). Each step's gradients are compared with a step without checkpointing under the
forward's policy; the test kernel adds 100, so a recomputation on the other path changes every gradient
before it. The kernel's call counter during ``backward()`` counts the recomputations on the kernel.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _helpers import in_another_thread
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import kernelpolicy as kp
from kernelpolicy._compat import _compat
from kernelpolicy._forward import _replay
from kernelpolicy.testing import DemoModel, kernel_calls, one_rank_process_group
from kernelpolicy.training import RecomputationError

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
PROBE = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
Step = Callable[[DemoModel, torch.Tensor], torch.Tensor]


def _plain(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = x + block(x)
    out: torch.Tensor = model.norm(x)
    return out


def _direct(reentrant: bool) -> Step:
    def step(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            x = x + checkpoint(block, x, use_reentrant=reentrant)
        out: torch.Tensor = model.norm(x)
        return out

    return step


def _sequential(reentrant: bool) -> Step:
    def step(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
        layers = [layer for block in model.blocks for layer in block]
        out: torch.Tensor = model.norm(checkpoint_sequential(layers, 2, x, use_reentrant=reentrant))
        return out

    return step


def _sequential_plain(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
    for layer in [layer for block in model.blocks for layer in block]:
        x = layer(x)
    out: torch.Tensor = model.norm(x)
    return out


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _step(model: nn.Module, step: Step, forward_scope: Any, backward: str) -> tuple[list[torch.Tensor], int]:
    """The forward inside ``forward_scope``, ``backward()`` as ``backward`` says: (gradients, kernel calls in it)."""
    model.zero_grad()
    x = X.clone().requires_grad_()
    with forward_scope:
        loss = (step(model, x) * PROBE).sum()  # type: ignore[arg-type]
    before = kernel_calls(model)
    if backward == "after the scope":
        loss.backward()
    elif backward == "under the other policy":
        disabled = kp.current_policy().mode_for("RMSNorm") != "disable"
        with kp.kernels_disabled() if disabled else kp.kernel_policy("prefer"):
            loss.backward()
    else:  # from another thread, which starts from the process default
        in_another_thread(loss.backward)
    return _grads(model), kernel_calls(model) - before


def _max_diff(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))


@pytest.fixture
def training_model(kernelized: Callable[..., DemoModel]) -> DemoModel:
    return kernelized("traceable", mode="training").train()


#: kind -> (the checkpointed step, the same step without checkpointing, RMSNorm layers checkpointed)
STEPS: dict[str, tuple[Step, Step, int]] = {
    "checkpoint, non-reentrant": (_direct(False), _plain, 2),
    "checkpoint, reentrant": (_direct(True), _plain, 2),
    # checkpoint_sequential runs its last segment (the second block) without checkpointing
    "checkpoint_sequential, non-reentrant": (_sequential(False), _sequential_plain, 1),
    "checkpoint_sequential, reentrant": (_sequential(True), _sequential_plain, 1),
}


@pytest.mark.parametrize("backward", ["after the scope", "under the other policy", "from another thread"])
@pytest.mark.parametrize("forward", ["kernels_disabled", "prefer"])
@pytest.mark.parametrize("kind", list(STEPS))
def test_torch_checkpointing_called_directly_recomputes_on_the_forwards_path(
    training_model: DemoModel, kind: str, forward: str, backward: str
) -> None:
    checkpointed, plain, layers = STEPS[kind]
    scope = kp.kernels_disabled() if forward == "kernels_disabled" else kp.kernel_policy("prefer")
    expected, _ = _step(training_model, plain, scope, "after the scope")
    grads, recomputed = _step(training_model, checkpointed, scope, backward)
    assert _max_diff(grads, expected) == 0.0
    # The checkpointed RMSNorm layers are recomputed on the kernel only where the forward took it.
    assert recomputed == (0 if forward == "kernels_disabled" else layers)


def _wrapped_model(mapping: Callable[[str], Any], how: str, reentrant: bool, when: str) -> DemoModel:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT

    def wrap(model: DemoModel) -> None:
        if how == "checkpoint_wrapper":
            for index, block in enumerate(model.blocks):
                model.blocks[index] = checkpoint_wrapper(block, checkpoint_impl=impl)
        else:
            wrapper = lambda module: checkpoint_wrapper(module, checkpoint_impl=impl)  # noqa: E731
            apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=wrapper, check_fn=lambda module: isinstance(module, nn.Sequential)
            )

    torch.manual_seed(0)
    model = DemoModel(16).train()
    if when == "before kernelize":
        wrap(model)
    with mapping("traceable"):
        kp.kernelize(model, mode="training", device="cpu")
    if when == "after kernelize":
        wrap(model)
    return model


@pytest.mark.parametrize("when", ["before kernelize", "after kernelize"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("how", ["checkpoint_wrapper", "apply_activation_checkpointing"])
def test_checkpoint_wrappers_with_torchs_checkpoint_function(
    mapping: Callable[[str], Any], kernelized: Callable[..., DemoModel], how: str, reentrant: bool, when: str
) -> None:
    expected, _ = _step(
        kernelized("traceable", mode="training").train(), _plain, kp.kernels_disabled(), "after the scope"
    )
    model = _wrapped_model(mapping, how, reentrant, when)
    assert "CheckpointWrapper" in type(model.blocks[0]).__name__
    grads, recomputed = _step(model, _plain, kp.kernels_disabled(), "after the scope")
    assert _max_diff(grads, expected) == 0.0
    assert recomputed == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_fsdp2_with_activation_checkpointing(
    mapping: Callable[[str], Any], kernelized: Callable[..., DemoModel], reentrant: bool
) -> None:
    from torch.distributed.fsdp import fully_shard

    expected, _ = _step(
        kernelized("traceable", mode="training").train(), _plain, kp.kernels_disabled(), "after the scope"
    )
    with one_rank_process_group():
        model = _wrapped_model(mapping, "apply_activation_checkpointing", reentrant, "after kernelize")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # model(x), not _plain: FSDP2 gathers the root's own parameters (model.norm's) in the root's forward hook
        grads, recomputed = _step(model, lambda model, x: model(x), kp.kernels_disabled(), "after the scope")
        grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    assert _max_diff(grads, expected) == 0.0
    assert recomputed == 0


def test_microbatches_under_two_policies_before_one_backward(training_model: DemoModel) -> None:
    """Each non-reentrant checkpoint's calls replay their own policies: the frames are told apart."""
    step = _direct(False)
    x1, x2 = X.clone().requires_grad_(), (X * 2).requires_grad_()

    def losses(checkpointed: bool) -> list[torch.Tensor]:
        training_model.zero_grad()
        run = step if checkpointed else _plain
        with kp.kernels_disabled():
            first = (run(training_model, x1) * PROBE).sum()
        second = (run(training_model, x2) * PROBE).sum()
        (first + second).backward()
        return _grads(training_model)

    assert _max_diff(losses(True), losses(False)) == 0.0


def test_a_scope_inside_the_checkpointed_function_replays_too(training_model: DemoModel) -> None:
    def inner(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            with kp.kernels_disabled():
                x = block[1](block[0](x))  # the RMSNorm under disable, inside the checkpoint
            out: torch.Tensor = block[3](block[2](x))
            return out

        return run

    def step(checkpointed: bool) -> Step:
        def go(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
            for block in model.blocks:
                x = x + (checkpoint(inner(block), x, use_reentrant=False) if checkpointed else inner(block)(x))
            out: torch.Tensor = model.norm(x)
            return out

        return go

    expected, _ = _step(training_model, step(False), kp.kernel_policy("prefer"), "under the other policy")
    grads, recomputed = _step(training_model, step(True), kp.kernel_policy("prefer"), "under the other policy")
    assert _max_diff(grads, expected) == 0.0
    assert recomputed == 0  # the only kernel layers recomputed run under the inner kernels_disabled()


def test_a_training_forward_after_a_no_grad_call_under_its_policy_replays_it(training_model: DemoModel) -> None:
    """The forward's cache lets such calls through unchecked (one identity test): the no_grad call's policy holds."""
    expected, _ = _step(training_model, _plain, kp.kernels_disabled(), "after the scope")
    with kp.kernels_disabled(), torch.no_grad():
        training_model(X)
    grads, recomputed = _step(training_model, _direct(False), kp.kernels_disabled(), "after the scope")
    assert _max_diff(grads, expected) == 0.0
    assert recomputed == 0


def test_retain_graph_replays_in_every_backward(training_model: DemoModel) -> None:
    expected, _ = _step(training_model, _plain, kp.kernels_disabled(), "after the scope")
    training_model.zero_grad()
    with kp.kernels_disabled():
        loss = (_direct(False)(training_model, X.clone().requires_grad_()) * PROBE).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert _max_diff(_grads(training_model), [2 * e for e in expected]) < 1e-4


def test_records_live_as_long_as_the_graph(training_model: DemoModel) -> None:
    replays = _binding_of(training_model.blocks[0][1]).replays
    with kp.kernels_disabled():
        loss = _direct(False)(training_model, X.clone().requires_grad_()).sum()
    assert len(replays.frames) == 1
    loss.backward()
    del loss
    gc.collect()
    assert replays.frames == {}


def _binding_of(module: nn.Module) -> Any:
    from kernelpolicy._attach._aware import binding_of

    found = binding_of(module)
    assert found is not None
    return found


def test_a_reentrant_checkpoint_of_a_kernel_without_backward_raises(kernelized: Callable[..., DemoModel]) -> None:
    """Its forward pass runs under no_grad and takes the kernel; the recomputation, with grad, cannot."""
    model = kernelized("no_backward").train()
    with kp.kernel_policy("prefer"):
        loss = _direct(True)(model, X.clone().requires_grad_()).sum()
    with pytest.raises(RecomputationError) as raised:
        loss.backward()
    message = str(raised.value)
    assert "module 'blocks.1.1'" in message and "kernel layer 'RMSNorm'" in message
    assert "ran the kernel under prefer with grad disabled" in message and "has no backward" in message
    assert "kernelpolicy.training.checkpoint" in message and "use_reentrant=False" in message


@pytest.fixture
def hidden(monkeypatch: pytest.MonkeyPatch) -> Callable[[_compat.Internal], None]:
    """``hidden(entry)``: the private name ``entry`` missing from the installed torch (as a release that moved it)."""

    def hide(entry: _compat.Internal) -> None:
        [attribute] = [
            name
            for name in ("GRAPH_TASK_ID", "SAVED_TENSOR_HOOKS", "CHECKPOINT_FRAME")
            if getattr(_compat, name) is entry
        ]
        monkeypatch.setattr(
            _compat, attribute, dataclasses.replace(entry, names=("torch.kp_moved_" + entry.names[0][6:],))
        )
        monkeypatch.setattr(_replay, "_READERS", {})
        monkeypatch.setattr(_replay, "_graph_task", _replay._resolve_graph_task)
        monkeypatch.setattr(_replay, "_top_hooks", _replay._resolve_top_hooks)
        monkeypatch.setattr(_compat, "_told", set())

    return hide


def test_without_torchs_graph_task_id_recomputations_are_not_replayed_and_the_user_is_told(
    training_model: DemoModel, hidden: Callable[[_compat.Internal], None]
) -> None:
    """The control: what the replay prevents (so the tests above can fail), and the warning that says so."""
    hidden(_compat.GRAPH_TASK_ID)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        expected, _ = _step(training_model, _plain, kp.kernels_disabled(), "after the scope")
        grads, recomputed = _step(training_model, _direct(False), kp.kernels_disabled(), "after the scope")
    [message] = [w for w in told if "recomputations are not replayed" in str(w.message)]  # once
    assert message.filename == __file__ and "doctor" in str(message.message)  # at the user's line
    assert recomputed == 2
    assert _max_diff(grads, expected) > 1.0


def test_without_the_checkpoint_frame_one_live_policy_still_replays_and_two_raise(
    training_model: DemoModel, hidden: Callable[[_compat.Internal], None]
) -> None:
    hidden(_compat.CHECKPOINT_FRAME)
    expected, _ = _step(training_model, _plain, kp.kernels_disabled(), "after the scope")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads, recomputed = _step(training_model, _direct(False), kp.kernels_disabled(), "after the scope")
    assert _max_diff(grads, expected) == 0.0 and recomputed == 0
    # Two forward passes under policies that take different paths, one backward: which is which cannot be told.
    for block in training_model.blocks:
        with kp.kernels_disabled():
            first = checkpoint(block, X.clone().requires_grad_(), use_reentrant=False).sum()
        second = checkpoint(block, X.clone().requires_grad_(), use_reentrant=False).sum()
        with pytest.raises(RecomputationError, match=r"ran under disable and prefer, .*cannot tell"):
            (first + second).backward()
        break

"""Gradients under activation checkpointing, with and without the policy replay: ``python -m benchmarks.checkpoint_gradients``.

Not a timing: the error a recomputation on the other path puts into the gradients. The forward runs inside
``kernels_disabled()`` and ``backward()`` after the block (the natural training step); the RMSNorm kernel adds
100. Each line compares the parameter gradients with an uncheckpointed run under the same policy and counts
the kernel calls made during ``backward()`` (the recomputations on the kernel). The table covers each way torch
checkpoints, called directly (wrappers applied after ``kernelize``; FSDP2 on a one-rank gloo group), where
only the forwards' own replay (``kernelpolicy._forward._replay``) can keep the path.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential

import kernelpolicy
from kernelpolicy.testing import (
    DemoModel,
    kernel_calls,
    kernelize_locally,
    one_rank_process_group,
    rms_norm_kernel_source,
    tiny_llama,
    write_kernel_repo,
)
from kernelpolicy.training import checkpoint

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
PROBE = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
IDS = torch.arange(16).reshape(2, 8) % 256


def _compare(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> str:
    diff = max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True))
    return f"max |grad diff| {diff:.4g} (largest gradient {max(r.abs().max().item() for r in reference):.4g})"


def _demo(model: DemoModel, checkpointing: Any, reentrant: bool) -> tuple[list[torch.Tensor], int]:
    model.zero_grad()
    x = X.clone().requires_grad_()
    with kernelpolicy.kernels_disabled():
        for block in model.blocks:
            x = x + (checkpointing(block, x, use_reentrant=reentrant) if checkpointing else block(x))
        loss = (model.norm(x) * PROBE).sum()
    before = kernel_calls(model)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], kernel_calls(model) - before


def _llama(repo: Path, reentrant: bool | None, replay: bool) -> tuple[list[torch.Tensor], int]:
    model = kernelize_locally(tiny_llama().train(), {"RMSNorm": repo}, mode="training")
    if reentrant is not None:
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        if not replay:  # what transformers hands its layers, without kernelpolicy's replay
            for module in model.modules():
                if "_gradient_checkpointing_func" in module.__dict__:
                    module._gradient_checkpointing_func = functools.partial(torch_checkpoint, use_reentrant=reentrant)
    with kernelpolicy.kernels_disabled():
        loss = model(IDS, labels=IDS).loss
    before = kernel_calls(model)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], kernel_calls(model) - before


def _kinds() -> dict[str, Any]:
    """Each way torch checkpoints, as ``wrap(model) -> step``: called directly, no kernelpolicy function handed in."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    def direct(reentrant: bool) -> Any:
        def step(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
            for block in model.blocks:
                x = x + torch_checkpoint(block, x, use_reentrant=reentrant)
            out: torch.Tensor = model.norm(x)
            return out

        return lambda model: step

    def sequential(reentrant: bool) -> Any:
        def step(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
            layers = [layer for block in model.blocks for layer in block]  # type: ignore[attr-defined]
            # no residuals here: compared with the same layers run plainly (see _plain_sequential)
            out: torch.Tensor = model.norm(checkpoint_sequential(layers, 2, x, use_reentrant=reentrant))  # type: ignore[no-untyped-call]
            return out

        return lambda model: step

    def wrapped(reentrant: bool, apply: bool, fsdp: bool = False) -> Any:
        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT

        def wrap(model: DemoModel) -> Any:
            if apply:
                apply_activation_checkpointing(
                    model,
                    checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
                    check_fn=lambda m: isinstance(m, torch.nn.Sequential),
                )
            else:
                for index, block in enumerate(model.blocks):
                    model.blocks[index] = checkpoint_wrapper(block, checkpoint_impl=impl)
            if fsdp:
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            return lambda model, x: model(x)

        return wrap

    kinds: dict[str, Any] = {}
    for reentrant in (False, True):
        kinds[f"checkpoint(use_reentrant={reentrant})"] = direct(reentrant)
        kinds[f"checkpoint_sequential(use_reentrant={reentrant})"] = sequential(reentrant)
        impl = "REENTRANT" if reentrant else "NO_REENTRANT"
        kinds[f"checkpoint_wrapper({impl})"] = wrapped(reentrant, apply=False)
        kinds[f"apply_activation_checkpointing({impl})"] = wrapped(reentrant, apply=True)
        kinds[f"FSDP2 + apply_activation_checkpointing({impl})"] = wrapped(reentrant, apply=True, fsdp=True)
    return kinds


def _plain_sequential(model: DemoModel, x: torch.Tensor) -> torch.Tensor:
    for layer in [layer for block in model.blocks for layer in block]:  # type: ignore[attr-defined]
        x = layer(x)
    out: torch.Tensor = model.norm(x)
    return out


def _kind_step(repo: Path, kind: str, wrap: Any) -> tuple[list[torch.Tensor], int] | str:
    torch.manual_seed(0)
    model = kernelize_locally(DemoModel(16).train(), {"RMSNorm": repo}, mode="training")
    step = wrap(model)
    model.zero_grad()
    x = X.clone().requires_grad_()
    with kernelpolicy.kernels_disabled():
        loss = (step(model, x) * PROBE).sum()
    before = kernel_calls(model)
    try:
        loss.backward()
    except RuntimeError as error:  # RecomputationError: the recomputation would take another path
        return f"{type(error).__name__}: {str(error)[:90]}..."
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters() if p.grad is not None]
    return [g.clone() for g in grads], kernel_calls(model) - before


def _reference(repo: Path, sequential: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = kernelize_locally(DemoModel(16).train(), {"RMSNorm": repo}, mode="training")
    with kernelpolicy.kernels_disabled():
        loss = ((_plain_sequential(model, X) if sequential else model(X)) * PROBE).sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def kinds_table(repo: Path) -> None:
    """Markdown: each way torch checkpoints, called directly, forward under kernels_disabled(), backward after."""
    with one_rank_process_group():
        print(
            "| torch's checkpointing, called directly | max abs grad diff | largest grad | kernel calls in backward |"
        )
        print("| --- | ---: | ---: | ---: |")
        for kind, wrap in _kinds().items():
            reference = _reference(repo, kind.startswith("checkpoint_sequential"))
            result = _kind_step(repo, kind, wrap)
            if isinstance(result, str):
                print(f"| {kind} | raises {result} | | |")
                continue
            grads, calls = result
            diff = max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True))
            print(f"| {kind} | {diff:.4g} | {max(r.abs().max().item() for r in reference):.4g} | {calls} |")


def main() -> None:
    logging.getLogger("kernels").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        repo = write_kernel_repo(Path(tmp), rms_norm_kernel_source(can_torch_compile=True, offset=100.0))
        torch.manual_seed(0)
        model = kernelize_locally(DemoModel(16).train(), {"RMSNorm": repo}, mode="training")
        for reentrant in (False, True):
            reference, _ = _demo(model, None, reentrant)
            for name, checkpointing in (
                ("torch.utils.checkpoint.checkpoint", torch_checkpoint),
                ("kernelpolicy.training.checkpoint", checkpoint),
            ):
                grads, calls = _demo(model, checkpointing, reentrant)
                print(f"DemoModel, {name}(use_reentrant={reentrant}): {_compare(grads, reference)}, "
                      f"kernel calls in backward {calls}")  # fmt: skip
        kinds_table(repo)
        for reentrant in (False, True):
            reference, _ = _llama(repo, None, True)
            for replay in (False, True):
                grads, calls = _llama(repo, reentrant, replay)
                print(f"tiny Llama, gradient_checkpointing_enable(use_reentrant={reentrant}), "
                      f"{'with' if replay else 'without'} the replay: {_compare(grads, reference)}, "
                      f"kernel calls in backward {calls}")  # fmt: skip


if __name__ == "__main__":
    main()

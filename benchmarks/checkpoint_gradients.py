"""Gradients under activation checkpointing, with and without the policy replay: ``python -m benchmarks.checkpoint_gradients``.

Not a timing: the error a recomputation on the other path puts into the gradients. The forward runs inside
``kernels_disabled()`` and ``backward()`` after the block (the natural training step); the RMSNorm kernel adds
100. Each line compares the parameter gradients with an uncheckpointed run under the same policy and counts
the kernel calls made during ``backward()`` (the recomputations on the kernel).
"""

from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import kernelpolicy
from kernelpolicy.testing import (
    DemoModel,
    kernel_calls,
    kernelize_locally,
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
        for reentrant in (False, True):
            reference, _ = _llama(repo, None, True)
            for replay in (False, True):
                grads, calls = _llama(repo, reentrant, replay)
                print(f"tiny Llama, gradient_checkpointing_enable(use_reentrant={reentrant}), "
                      f"{'with' if replay else 'without'} the replay: {_compare(grads, reference)}, "
                      f"kernel calls in backward {calls}")  # fmt: skip


if __name__ == "__main__":
    main()

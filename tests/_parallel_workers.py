"""Training ranks for tests/test_parallel_training.py: importable by name in a spawned child.

Each rank trains a kernelized :class:`~kernelpolicy.testing.DemoModel` (one block, hidden 16: two RMSNorm
layers) for a few SGD steps under DDP or FSDP2 on a gloo group on 127.0.0.1, switching the kernel policy per
step, and writes per step the policy, the paths ``record_calls()`` counted and its loss, then the final
parameters, to ``rank<N>.json``. :func:`reference` computes the same training in one process without
kernels, adding the kernel's offset where the kernel is expected.
"""

from __future__ import annotations

import faulthandler
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _workers import end_rank, init_group
from torch import nn

import kernelpolicy as kp
from kernelpolicy.testing import DemoModel, RMSNorm, kernelize_locally

if TYPE_CHECKING:
    from collections.abc import Callable

HIDDEN = 16
WORLD = 2
BATCH = 4  # rows per rank
LR = 0.1
#: The test kernel adds this to its output (``rms_norm_kernel_source(offset=OFFSET)``).
OFFSET = 0.5
#: One policy per step (``Policy.parse`` text): kernel, original, kernel, original for RMSNorm only.
STEPS = ("prefer", "disable", "require", "prefer,RMSNorm=disable")


def kernel_expected(policy: str) -> bool:
    """Whether the RMSNorm kernel runs under ``policy`` (text)."""
    return kp.Policy.parse(policy).mode_for("RMSNorm") != "disable"


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``step`` (inputs, targets); rank ``r`` trains on rows ``r*BATCH:(r+1)*BATCH``."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD * BATCH, HIDDEN, generator=generator)
    return x, torch.randn(WORLD * BATCH, HIDDEN, generator=generator)


def new_model() -> DemoModel:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return DemoModel(HIDDEN, blocks=1).train()


def reference() -> dict[str, Any]:
    """The same training in one process without kernels: each rank's losses, the final parameters.

    Where the kernel is expected, its math: the original forward plus :data:`OFFSET`. ``other_path`` holds
    each step's losses on the other path (same weights), to show that a wrong path could not match.
    """
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[list[float]] = []
    other_path: list[list[float]] = []
    for step, policy in enumerate(STEPS):
        x, target = batch(step)
        with torch.no_grad():
            other_path.append(_rank_means(_errors(model, x, target, kernel=not kernel_expected(policy))))
        optimizer.zero_grad()
        errors = _errors(model, x, target, kernel=kernel_expected(policy))
        errors.mean().backward()  # type: ignore[no-untyped-call]  # the mean of the ranks' means: the gradient DDP and FSDP average
        optimizer.step()
        losses.append(_rank_means(errors))
    params = {name: param.detach().flatten().tolist() for name, param in model.named_parameters()}
    return {"losses": losses, "other_path": other_path, "params": params}


def _errors(model: DemoModel, x: torch.Tensor, target: torch.Tensor, *, kernel: bool) -> torch.Tensor:
    norms = [module for module in model.modules() if isinstance(module, RMSNorm)]
    hooks = [norm.register_forward_hook(_add_offset) for norm in norms] if kernel else []
    try:
        errors: torch.Tensor = (model(x) - target).pow(2)
        return errors
    finally:
        for hook in hooks:
            hook.remove()


def _rank_means(errors: torch.Tensor) -> list[float]:
    return [errors[rank * BATCH : (rank + 1) * BATCH].mean().item() for rank in range(WORLD)]


def _add_offset(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out + OFFSET


class CountingBackend:
    """A ``torch.compile`` backend that runs graphs as traced and counts them and their kernel-offset nodes."""

    def __init__(self) -> None:
        self.offset_nodes: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.offset_nodes.append(
            sum(1 for node in gm.graph.nodes if node.op == "call_function" and OFFSET in node.args)
        )
        return gm.forward


def train_worker(rank: int, world: int, port: int, out_dir: str, case: str, repo: str) -> None:
    """One rank of ``case``: ``ddp`` or ``fsdp-kernelize-first`` / ``-after`` (fully_shard), optionally ``-compiled``."""
    faulthandler.dump_traceback_later(120, exit=True)  # a hung rank prints its stacks before the 150 s deadline
    torch.set_num_threads(1)
    init_group(rank, world, port)
    result = _train_case(rank, case, Path(repo))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    end_rank()  # _train_case's locals are gone; end_rank frees what compiled frames and cycles still hold


def _train_case(rank: int, case: str, repo: Path) -> dict[str, Any]:
    """Build, kernelize, wrap and train this rank's model for ``case``; what it did, for the parent."""
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    compiled = case.endswith("-compiled")

    def kernelize(module: nn.Module) -> None:
        mode = "training|torch_compile" if compiled else "training"
        kernelize_locally(module, {"RMSNorm": repo}, mode=mode, inherit=False)

    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    baseline = CountingBackend()
    baseline_breaks: list[str] = []
    if compiled:  # the graphs and graph breaks of the same wrapper and steps around a model without kernels
        torch._dynamo.reset()
        counters.clear()
        plain = new_model()
        _train(plain, torch.compile(_wrap(plain, case, None), backend=baseline), rows, kernelized=False)
        baseline_breaks = sorted(counters["graph_break"])
        torch._dynamo.reset()
    counters.clear()
    model = new_model()
    wrapped = _wrap(model, case, kernelize)
    backend = CountingBackend()
    steps = _train(model, torch.compile(wrapped, backend=backend) if compiled else wrapped, rows)
    params = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2: a sharded DTensor
        params[name] = full.detach().flatten().tolist()
    return {
        "steps": steps,
        "params": params,
        "norm_is_fsdp_module": isinstance(model.norm, FSDPModule),
        "norm_mro": [f"{cls.__module__}.{cls.__qualname__}" for cls in type(model.norm).__mro__],
        "graphs": backend.offset_nodes,
        "graph_breaks": sorted(counters["graph_break"]),
        "baseline_graphs": len(baseline.offset_nodes),
        "baseline_graph_breaks": baseline_breaks,
    }


def _train(
    model: DemoModel, run: Callable[[torch.Tensor], torch.Tensor], rows: slice, *, kernelized: bool = True
) -> list[dict[str, Any]]:
    """SGD on this rank's ``rows`` of each step's batch under that step's policy; what each step did."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step, policy in enumerate(STEPS):
        x, target = batch(step)
        with kp.kernel_policy(kp.Policy.parse(policy)), kp.record_calls() as calls:
            predicted = kernelized and kp.will_use_kernel(model.norm)
            optimizer.zero_grad()
            loss = (run(x[rows]) - target[rows]).pow(2).mean()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        steps.append({"policy": policy, "calls": calls.by_layer(), "loss": loss.item(), "predicted": predicted})
    return steps


def _wrap(model: DemoModel, case: str, kernelize: Callable[[nn.Module], None] | None) -> nn.Module:
    """``model`` kernelized (when ``kernelize`` is given) and wrapped for ``case``: DDP, or fully_shard per layer."""
    if case.startswith("ddp"):
        if kernelize is not None:
            kernelize(model)
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if kernelize is not None and case.startswith("fsdp-kernelize-first"):
        kernelize(model)
    mesh = init_device_mesh("cpu", (WORLD,))
    for module in (model.blocks[0], model.norm, model):  # the norm layer is an FSDP unit of its own
        fully_shard(module, mesh=mesh)
    if kernelize is not None and case.startswith("fsdp-kernelize-after"):
        kernelize(model)
    return model

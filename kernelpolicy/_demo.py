"""The main job: ``python -m kernelpolicy demo``.

This module owns a tiny model built from kernel-marked layers (shared by the
demo, the tests and the benchmarks) and the demo itself: it writes a real
local kernel repository, kernelizes the model through ``kernels`` and shows
the path taken under several policies, eagerly and inside ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._binding import kernelize
from ._explain import explain
from ._scope import kernel_policy, kernels_disabled
from .testing import kernel_calls, rms_norm_kernel_source, write_kernel_repo

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["DemoModel", "RMSNorm", "demo", "kernelized_demo_model"]


def _mark(layer_name: str) -> Any:
    from ._compat import kernels

    return kernels().use_kernel_forward_from_hub(layer_name)


@_mark("RMSNorm")
class RMSNorm(nn.Module):
    """Llama's RMSNorm, marked for the ``RMSNorm`` hub kernel by ``kernels`` (as transformers does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        out: torch.Tensor = self.weight * hidden_states.to(input_dtype)
        return out


class DemoModel(nn.Module):
    """Linear -> RMSNorm -> SiLU -> Linear -> RMSNorm, twice."""

    def __init__(self, hidden: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), RMSNorm(hidden), nn.SiLU(), nn.Linear(hidden, hidden))
            for _ in range(blocks)
        )
        self.norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.norm(x)
        return out


@contextlib.contextmanager
def kernelized_demo_model(
    root: Path, *, can_torch_compile: bool = True, offset: float = 0.0, hidden: int = 32
) -> Iterator[DemoModel]:
    """A :class:`DemoModel` kernelized with a local RMSNorm kernel written under ``root``."""
    import kernels

    repo = write_kernel_repo(root, rms_norm_kernel_source(can_torch_compile=can_torch_compile, offset=offset))
    mapping = {"RMSNorm": {"cpu": kernels.LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}
    model = DemoModel(hidden).eval()
    with kernels.use_kernel_mapping(mapping):
        kernelize(model, mode="inference", device="cpu")
    yield model


def demo(print_: Any = print) -> None:
    """Run the demo, printing explain() tables and kernel call counts."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, kernelized_demo_model(Path(tmp), offset=0.5) as model:
        x = torch.randn(4, 32)
        print_("kernelpolicy demo: a small model with 3 RMSNorm layers, kernelized with a local CPU kernel")
        print_("(the demo kernel adds 0.5 to its output, so the path is visible in the numbers)\n")
        scenes: list[tuple[str, Any]] = [
            ("prefer (the default)", contextlib.nullcontext()),
            ("with kernels_disabled()", kernels_disabled()),
            ("with kernel_policy(RMSNorm='disable')", kernel_policy(RMSNorm="disable")),
            ("with kernel_policy('require')", kernel_policy("require")),
        ]
        for title, scope in scenes:
            with scope:
                before = kernel_calls(model)
                out = model(x)
                print_(f"== {title}: {kernel_calls(model) - before} kernel calls, output mean {out.mean().item():+.4f}")
                print_(explain(model))
                print_()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with_kernel = compiled(x)
        with kernels_disabled():
            without = compiled(x)
        eager_with = model(x)
        with kernels_disabled():
            eager_without = model(x)
        print_("== inside torch.compile(fullgraph=True), one compiled model, the policy read at every call:")
        print_(
            f"   prefer:            output mean {with_kernel.mean().item():+.4f} (eager {eager_with.mean().item():+.4f})"
        )
        print_(
            f"   kernels_disabled(): output mean {without.mean().item():+.4f} (eager {eager_without.mean().item():+.4f})"
        )
        if not (torch.allclose(with_kernel, eager_with) and torch.allclose(without, eager_without)):
            raise SystemExit("demo: compiled and eager outputs disagree")

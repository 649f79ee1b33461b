"""The main job: ``python -m kernelpolicy demo``.

It writes a real local kernel repository, kernelizes the demo model
(:class:`kernelpolicy.testing.DemoModel`) through ``kernels`` and shows the
path taken under several policies, eagerly and inside ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import torch

from ._explain import explain
from ._scope import kernel_policy, kernels_disabled
from .testing import kernel_calls, kernelized_demo_model

__all__ = ["demo"]


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

"""The main job: ``python -m kernelpolicy demo``.

It writes two real local kernel repositories (an RMSNorm kernel that adds 0.5
to its output, so the path shows in the numbers, and a SiLU kernel identical to
the original that cannot be traced), kernelizes
:class:`kernelpolicy.testing.ShowcaseModel` through ``kernels`` and shows, with
``record_calls`` and ``explain``: the default, everything off, a per-layer
override, ``require`` met and failing, ``verify`` catching the RMSNorm kernel's
offset, and one compiled model following the policy of each call.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ._context._scope import kernel_policy, kernels_disabled
from ._tell._accounting import record_calls
from ._tell._explain import explain
from ._values._errors import KernelMismatchError, KernelUnavailableError
from .testing import ShowcaseModel, kernelize_locally, rms_norm_kernel_source, silu_kernel_source, write_kernel_repo

__all__ = ["demo"]

OFFSET = 0.5


def demo(print_: Any = print) -> None:
    """Run the demo, printing what each policy does to one model."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        repos = {
            "RMSNorm": write_kernel_repo(
                Path(tmp) / "rmsnorm", rms_norm_kernel_source(can_torch_compile=True, offset=OFFSET), name="rmsnorm"
            ),
            "SiLU": write_kernel_repo(Path(tmp) / "silu", silu_kernel_source(can_torch_compile=False), name="silu"),
        }
        model = kernelize_locally(ShowcaseModel(32).eval(), repos)
        _scenes(model, torch.randn(4, 32), print_)


def _scenes(model: ShowcaseModel, x: torch.Tensor, print_: Any) -> None:
    print_("kernelpolicy demo: a small model with two kinds of kernel layers, kernelized from local repositories")
    print_(f"  RMSNorm x3: a traceable kernel that adds {OFFSET} to each output (the path shows in the numbers)")
    print_("  SiLU x2:    a kernel identical to the original that cannot be traced (no can_torch_compile)\n")

    def run(title: str, scope: Any) -> torch.Tensor:
        with scope, record_calls() as calls:
            out: torch.Tensor = model(x)
            table = explain(model, calls=calls)
        print_(f"== {title}: output mean {out.mean().item():+.4f}; calls {calls.by_layer()}")
        print_(table)
        print_()
        return out

    with torch.no_grad():
        kernels_on = run("prefer (the default): every kernel that can run", kernel_policy())
        original = run("kernels_disabled(): every original forward", kernels_disabled())
        run("kernel_policy(SiLU='disable'): a per-layer override", kernel_policy(SiLU="disable"))
        run("kernel_policy('require'): every kernel, or an error", kernel_policy("require"))
        shift = model.norm(x) - _disabled(model.norm, x)  # one RMSNorm, the same input, both paths
        print_(
            f"One RMSNorm on the same input, kernel minus original: {shift.min().item():+.4f} to "
            f"{shift.max().item():+.4f} (the means above move less: each block's output feeds the next)\n"
        )

        print_("== kernel_policy('verify'): the original runs too and the outputs are compared")
        try:
            with kernel_policy("verify"):
                model(x)
        except KernelMismatchError as error:
            print_(f"   KernelMismatchError: {error}\n")
        with kernel_policy("verify", RMSNorm="disable"), record_calls() as calls:
            model(x)
        print_(f"   the SiLU kernel passes: {calls.by_layer()}\n")

        compiled = torch.compile(model, backend="eager")
        print_("== torch.compile(model, backend='eager'), one compiled model, the policy read at every call:")
        for title, scope, eager in (
            ("prefer", kernel_policy(), kernels_on),
            ("kernels_disabled()", kernels_disabled(), original),
        ):
            with scope:
                out = compiled(x)
            agree = "equal to eager" if torch.allclose(out, eager) else "DIFFERENT FROM EAGER"
            print_(f"   {title + ':':20} output mean {out.mean().item():+.4f} ({agree})")
        print_("   (compiled, SiLU takes its original forward under prefer: its kernel cannot be traced)")
        # Compiled, the SiLU kernel cannot be traced: prefer gave way to the original above; require refuses.
        try:
            with kernel_policy("require"):
                compiled(x)
        except KernelUnavailableError as error:
            print_(f"   kernel_policy('require'): KernelUnavailableError: {error}")


def _disabled(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with kernels_disabled():
        out: torch.Tensor = module(x)
    return out

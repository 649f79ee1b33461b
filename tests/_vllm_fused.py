"""A vLLM IR provider for ``fused_add_rms_norm`` with numerics of its own (the native norm plus 0.5, the residual as
the native one), for tests/test_vllm.py: vLLM's RMSNorm layer calls it through the op's in-place overload
(``maybe_inplace``), so a policy's choice shows in the tokens only where that overload is governed too.

vLLM's engine core and workers import it through ``KERNELPOLICY_VLLM_IMPORT``, the test process by importing it;
without it (as in tests/test_vllm_failures.py) the op has no kernel on this CPU.
"""

from __future__ import annotations

import torch  # noqa: TC002  # vLLM compares the provider's signature with the native one, annotations included
from _vllm_provider import NAME

try:
    from vllm import ir
except ImportError:  # pytest's --doctest-modules imports it where vLLM is not installed
    ir = None

if ir is not None and NAME not in ir.ops.fused_add_rms_norm.impls:

    @ir.ops.fused_add_rms_norm.register_impl(NAME, supported=True)
    def _fused_add_rms_norm_plus_half(
        x: torch.Tensor,
        x_residual: torch.Tensor,
        weight: torch.Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, x_residual, weight, epsilon, variance_size)
        return out + 0.5, residual

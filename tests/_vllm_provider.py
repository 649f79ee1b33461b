"""vLLM IR providers for ``rms_norm`` with numerics of their own (the native norm plus 0.5; times 1.5), for tests/vllm.

vLLM's engine core and workers import it through ``KERNELPOLICY_VLLM_IMPORT`` (kernelpolicy's plugin), the test
process by importing it: on this CPU vLLM's own kernels equal the natives, so the tests need a kernel that differs.
"""

from __future__ import annotations

import torch  # noqa: TC002  # vLLM compares the provider's signature with the native one, annotations included

try:
    from vllm import ir
except ImportError:  # pytest's --doctest-modules imports it where vLLM is not installed
    ir = None

#: The provider's name (``kernel_config={"ir_op_priority": {"rms_norm": [NAME, "native"]}}``).
NAME = "kp_test"
#: Another provider, which only a variant entry names (``rms_norm="kernel:kp_other"``).
OTHER = "kp_other"

if ir is not None and NAME not in ir.ops.rms_norm.impls:

    @ir.ops.rms_norm.register_impl(NAME, supported=True)
    def _rms_norm_plus_half(
        x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> torch.Tensor:
        return ir.ops.rms_norm.impls["native"].impl_fn(x, weight, epsilon, variance_size) + 0.5

    @ir.ops.rms_norm.register_impl(OTHER, supported=True)
    def _rms_norm_times_one_and_a_half(
        x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> torch.Tensor:
        return ir.ops.rms_norm.impls["native"].impl_fn(x, weight, epsilon, variance_size) * 1.5

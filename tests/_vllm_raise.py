"""A vLLM IR provider for ``rms_norm`` that raises (tests/test_vllm_failures.py): only a variant entry names it.

Imported by the engines of that test only (``KERNELPOLICY_VLLM_IMPORT``): an engine that compiles traces every
provider the platform supports, this one included.
"""

from __future__ import annotations

import torch  # noqa: TC002  # vLLM compares the provider's signature with the native one, annotations included

try:
    from vllm import ir
except ImportError:  # pytest's --doctest-modules imports it where vLLM is not installed
    ir = None

#: The provider's name, and the text of its error.
NAME, MESSAGE = "kp_raise", "kp_raise: this kernel always fails"

if ir is not None and NAME not in ir.ops.rms_norm.impls:

    @ir.ops.rms_norm.register_impl(NAME, supported=True)
    def _rms_norm_raises(
        x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> torch.Tensor:
        raise RuntimeError(MESSAGE)

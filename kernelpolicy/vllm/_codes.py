"""Each vLLM step's per-token choice, in a worker: which path each token's row takes in each governed op.

This module owns :class:`StepCodes` (one per worker process, :data:`STEP`): a fixed-size ``int8`` tensor of
``max_num_batched_tokens`` rows and one column per governed op (``0``: the path vLLM chose for the process, ``1``:
the op's kernel, ``2``: its original), filled before each step's forward from its requests' policies in batch order
(``np.repeat`` of each request's codes over its scheduled tokens) and handed to the layers through vLLM's forward
context (:data:`CONTEXT_KEY`), the warm-up and dummy runs included. Its address never changes, so a compiled program
(traced once by vLLM) reads each step's codes as data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._admission import KEY, request_policy

if TYPE_CHECKING:
    from ._admission import RequestPolicy

__all__ = ["CONTEXT_KEY", "DEFAULT", "KERNEL", "ORIGINAL", "STEP", "StepCodes"]

#: The key of ``ForwardContext.additional_kwargs`` that holds the codes.
CONTEXT_KEY = "kernelpolicy_codes"
#: A row's code for an op: vLLM's own choice, the kernel, the original.
DEFAULT, KERNEL, ORIGINAL = 0, 1, 2
#: Columns a worker keeps (one per governed op: vLLM 0.32 has under 100 CustomOps and IR ops).
CAPACITY = 256
_CODE = {"prefer": KERNEL, "disable": ORIGINAL}


class StepCodes:
    """The codes of the current step in this worker process, and the columns of the governed ops."""

    def __init__(self) -> None:
        self.columns: dict[str, int] = {}
        self.buffer: torch.Tensor | None = None
        #: Whether a request of the current step carries a policy (eager layers skip everything when not).
        self.mixed = False
        self._filled = 0  # rows of the buffer that may be non-zero
        self._rows: dict[RequestPolicy, np.ndarray[Any, np.dtype[np.int8]]] = {}

    def column(self, op: str) -> int:
        """The column of ``op`` (given on first sight: a layer built, an IR op known)."""
        found = self.columns.get(op)
        if found is None:
            if len(self.columns) >= CAPACITY:
                raise RuntimeError(f"kernelpolicy governs at most {CAPACITY} vLLM ops; {op!r} is one more")
            found = self.columns[op] = len(self.columns)
            self._rows.clear()
        return found

    def allocate(self, tokens: int, device: torch.device) -> None:
        """The buffer for steps of up to ``tokens`` tokens (the runner's ``max_num_batched_tokens``)."""
        if self.buffer is None or self.buffer.shape[0] < tokens or self.buffer.device != device:
            self.buffer = torch.zeros(tokens, CAPACITY, dtype=torch.int8, device=device)
            self._filled = 0

    def codes_of(self, policy: RequestPolicy) -> np.ndarray[Any, np.dtype[np.int8]]:
        """One row of codes for ``policy`` (cached per policy until an op is added)."""
        found = self._rows.get(policy)
        if found is None:
            found = np.zeros(CAPACITY, dtype=np.int8)
            for op, column in self.columns.items():
                entry = policy.entry(op)
                if entry is not None:
                    found[column] = _CODE[entry]
            self._rows[policy] = found
        return found

    def fill(self, policies: list[RequestPolicy | None], tokens: np.ndarray[Any, Any]) -> None:
        """The codes of a step whose rows, in batch order, have ``policies`` and ``tokens`` scheduled tokens."""
        buffer = self.buffer
        if buffer is None:
            return
        if all(policy is None for policy in policies):
            if self._filled:
                buffer[: self._filled].zero_()
                self._filled = 0
            self.mixed = False
            return
        zero = np.zeros(CAPACITY, dtype=np.int8)
        rows = np.stack([zero if policy is None else self.codes_of(policy) for policy in policies])
        per_token = np.repeat(rows, tokens, axis=0)
        count = per_token.shape[0]
        buffer[:count].copy_(torch.from_numpy(per_token))
        if self._filled > count:
            buffer[count : self._filled].zero_()
        self._filled = count
        self.mixed = True


#: This process's codes.
STEP = StepCodes()


def step_policies(runner: Any) -> list[RequestPolicy | None]:
    """The policy of each row of ``runner``'s input batch (a ``GPUModelRunner``), in batch order."""
    found: list[RequestPolicy | None] = []
    requests = runner.requests
    for request_id in runner.input_batch.req_ids:
        params = requests[request_id].sampling_params
        extra = None if params is None else params.extra_args
        found.append(None if not extra or KEY not in extra else request_policy(extra[KEY]))
    return found


def codes_in_context() -> torch.Tensor | None:
    """The current step's codes, from vLLM's forward context (None outside a forward)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    found: torch.Tensor | None = get_forward_context().additional_kwargs.get(CONTEXT_KEY)
    return found

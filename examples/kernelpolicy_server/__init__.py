"""A Starlette service that generates with a kernelized tiny Llama, one kernel policy per request.

``POST /generate`` takes ``{"input_ids": [...], "max_new_tokens": n}`` and an
optional ``X-Kernel-Policy`` header in the syntax of ``KERNELPOLICY``
(``disable``, ``prefer,RMSNorm=disable``, ...). The handler parses the header,
enters ``kernel_policy(policy)`` and ``record_calls()``, and hands the model
work to a thread pool wrapped in :func:`kernelpolicy.propagate`, which carries
the policy and the recorder into the worker thread. The reply holds the new
tokens, the policy the worker saw and the calls per kernel layer and path.

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
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

import kernelpolicy
from kernelpolicy.testing import rms_norm_kernel_source, tiny_llama, write_kernel_repo

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from starlette.requests import Request

__all__ = [
    "HEADER",
    "MAX_INPUT_TOKENS",
    "MAX_NEW_TOKENS",
    "VOCAB_SIZE",
    "build_model",
    "create_app",
]

HEADER = "X-Kernel-Policy"
VOCAB_SIZE = 256  # tiny_llama's vocabulary
MAX_NEW_TOKENS = 32
MAX_INPUT_TOKENS = 256


def build_model(kernel_root: Path, traceable: bool = True) -> Any:
    """A tiny Llama built from a config (no download), kernelized with a local CPU RMSNorm kernel.

    The kernel repository is written under ``kernel_root``; it is bit-exact with
    Llama's RMSNorm, so every policy yields the same tokens.
    """
    import kernels

    repo = write_kernel_repo(kernel_root, rms_norm_kernel_source(can_torch_compile=traceable), name="server-rmsnorm")
    model = tiny_llama(seed=0)
    # Greedy, and exactly max_new_tokens: no end-of-sequence token stops generation early.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    mapping = {"RMSNorm": {"cpu": kernels.LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}
    with kernels.use_kernel_mapping(mapping):
        kernelpolicy.kernelize(model, mode="inference", device="cpu")
    return model


@dataclass
class _State:
    model: Any
    executor: ThreadPoolExecutor


def _generate(model: Any, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Runs in a worker thread: the new tokens and the policy this thread sees."""
    ids = torch.tensor([input_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens)
    return [int(t) for t in out[0, len(input_ids) :]], str(kernelpolicy.current_policy())


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
    try:
        input_ids, max_new_tokens = _parse_body(await request.json())
    except ValueError as exc:  # also json.JSONDecodeError and bad UTF-8
        return _error(f"bad request body: {exc}", 400)

    loop = asyncio.get_running_loop()
    with kernelpolicy.kernel_policy(policy), kernelpolicy.record_calls() as calls:
        work = kernelpolicy.propagate(functools.partial(_generate, state.model, input_ids, max_new_tokens))
        try:
            tokens, seen = await loop.run_in_executor(state.executor, work)
        except kernelpolicy.KernelUnavailableError as exc:  # e.g. "require" where a layer has no kernel
            return _error(str(exc), 422, policy=str(policy), calls=calls.by_layer())
    return JSONResponse({"tokens": tokens, "policy": seen, "calls": calls.by_layer()})


async def healthz(request: Request) -> JSONResponse:
    """``GET /healthz``: 200 once the model is loaded."""
    return JSONResponse({"status": "ok", "default_policy": str(kernelpolicy.current_policy())})


def create_app(*, workers: int = 4) -> Starlette:
    """The ASGI app. Its lifespan builds the model and a pool of ``workers`` threads."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        torch.set_num_threads(1)  # the workers run requests in parallel, one core each
        with tempfile.TemporaryDirectory(prefix="kernelpolicy-server-") as root:
            model = build_model(Path(root) / "rmsnorm")
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate") as executor:
                # Warm up (first generate pays lazy initialisation), off the loop like every request.
                await asyncio.get_running_loop().run_in_executor(executor, _generate, model, [1, 2, 3], 2)
                app.state.kp = _State(model=model, executor=executor)
                yield

    return Starlette(
        routes=[Route("/generate", generate, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])],
        lifespan=lifespan,
    )

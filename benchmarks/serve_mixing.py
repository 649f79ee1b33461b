"""What mixing policies costs the real server: ``python -m kernelpolicy serve`` against plain ``transformers serve``.

``python -m benchmarks.serve_mixing``: for each model (a tiny Llama, hidden 64, 2 layers; a medium one, hidden 512,
4 layers; built from configs and saved to a temp folder, with a word tokenizer), three servers on 127.0.0.1, all
with continuous batching on CPU (256 KV blocks, 512 batch tokens), up at once:

- ``plain transformers serve``: transformers' own command (no kernel bound on CPU: RMSNorm's original forward);
- ``kernelpolicy serve``: ``python -m kernelpolicy serve --kernel RMSNorm=REPO`` (a local kernel: Llama's RMSNorm
  plus 0.5, so each answer shows the path its request took), ``/metrics`` on (the default);
- ``kernelpolicy serve --no-metrics``: the same without ``/metrics`` (no recording of kernel calls).

The same load goes to each arm: ``--streams`` client threads at once, each sending ``--requests`` greedy streaming
chat requests in a row (``--tokens`` new tokens each; the model has no end token, so every answer has all of
them). The arms: plain; kernelpolicy with 1 policy (no header: ``prefer``), 2 policies (every other stream sends
``X-Kernel-Policy: RMSNorm=disable``), 4 policies (``prefer``, ``RMSNorm=disable``, ``disable``, ``SiLU=disable``
by stream); and 1 policy with ``--no-metrics``. Each round runs every arm once, the order rotated round by
round, so a phase of the shared machine hits every arm; tokens/s is the answers' tokens over the wall time from
the first request to the last answer. Printed: per model and arm, the median over rounds of tokens/s, and the
medians of the per-round ratios to plain serve and to kernelpolicy's 1-policy arm.

Every answer is checked: it must equal its prompt generated alone, in this process, by the same saved model with
the same kernel under the request's policy (plain serve's under ``disable``, its path). A mismatch is printed
with its prompt, policy and both answers, and the command exits with status 1 after the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["main"]

#: The model sizes (``LlamaConfig`` fields over :func:`kernelpolicy.testing.tiny_llama`'s), as benchmarks.batching.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "medium": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4},
}
#: The policies a stream's requests take, by stream (the first ``n`` of them for ``n`` policies); None: no header.
POLICIES: tuple[str | None, ...] = (None, "RMSNorm=disable", "disable", "SiLU=disable")
#: (arm, server, number of policies).
ARMS = (
    ("plain transformers serve", "plain", 1),
    ("kernelpolicy, 1 policy", "kernelpolicy", 1),
    ("kernelpolicy, 2 policies", "kernelpolicy", 2),
    ("kernelpolicy, 4 policies", "kernelpolicy", 4),
    ("kernelpolicy, 1 policy, --no-metrics", "no-metrics", 1),
)
HEADER = "X-Kernel-Policy"


def _prompts(count: int) -> list[list[int]]:
    """``count`` prompts of 4 to 12 words (token ids 1-255; 0 is the tokenizer's special word), fixed by a seed."""
    import torch

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 13, (count,), generator=generator).tolist()
    return [torch.randint(1, 256, (int(n),), generator=generator).tolist() for n in lengths]


@contextlib.contextmanager
def process_group(command: list[str], env: dict[str, str], log: Path, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """``command`` in a session of its own writing to ``log``; its process group stopped after (SIGTERM, then
    SIGKILL): a server and what it spawned (vLLM's engine core and workers) too."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


@contextlib.contextmanager
def _server(kind: str, folder: Path, repo: Path, log: Path) -> Iterator[str]:
    """One server of ``kind`` (``plain``, ``kernelpolicy``, ``no-metrics``) until /health answers; its URL. Its
    process group (it and what it spawned) is stopped after."""
    from kernelpolicy.testing import free_port, wait_for_health

    port = free_port()
    if kind == "plain":
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder)]
    else:
        command = [sys.executable, "-m", "kernelpolicy", "serve", str(folder), "--kernel", f"RMSNorm={repo}"]
        command += ["--no-metrics"] if kind == "no-metrics" else []
    command += ["--continuous-batching", "--cb-num-blocks", "256", "--cb-max-batch-tokens", "512"]
    command += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "KERNELPOLICY": ""}
    with process_group(command, env, log) as server:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, server, 300, log=log)
        yield url


def _ask(url: str, model: str, prompt: list[int], policy: str | None, tokens: int) -> list[int]:
    """One greedy streaming chat request; the token ids of its answer (word ``w<i>`` is token ``i``)."""
    import json

    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in prompt)}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    headers = {} if policy is None else {HEADER: policy}
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return [int(word[1:]) for word in text.split()]


def _load(
    url: str, model: str, prompts: list[list[int]], policies: int, streams: int, tokens: int
) -> tuple[float, list[tuple[int, str | None, list[int]]]]:
    """Every stream's requests at once; (tokens/s, each answer as (prompt index, policy, token ids))."""
    answers: list[tuple[int, str | None, list[int]]] = []
    lock = threading.Lock()

    def stream(s: int) -> None:
        policy = POLICIES[s % policies]
        for index in range(s, len(prompts), streams):
            got = _ask(url, model, prompts[index], policy, tokens)
            with lock:
                answers.append((index, policy, got))

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(stream, range(streams)))
    return len(answers) * tokens / (time.perf_counter() - started), answers


class _References:
    """Each prompt generated alone under a policy by the saved model with the kernel bound (kernelpolicy)."""

    def __init__(self, folder: Path, repo: Path, tokens: int) -> None:
        import transformers

        import kernelpolicy as kp
        from kernelpolicy.testing import local_mapping

        auto: Any = transformers.AutoModelForCausalLM  # untyped on some releases
        self.model = auto.from_pretrained(folder).eval()
        with local_mapping({"RMSNorm": repo}):
            kp.kernelize(self.model, mode="inference", device="cpu")
        self.tokens, self.known = tokens, dict[tuple[int, str], list[int]]()

    def of(self, index: int, prompt: list[int], policy: str) -> list[int]:
        import torch

        import kernelpolicy as kp

        if (index, policy) not in self.known:
            with kp.kernel_policy(kp.Policy.parse(policy)), torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=self.tokens, do_sample=False)
            # token 0 is the tokenizer's special word, which the server's text leaves out
            self.known[(index, policy)] = [t for t in out[0, len(prompt) :].tolist() if t != 0]
        return self.known[(index, policy)]


def run_model(
    size: str, root: Path, rounds: int, streams: int, requests: int, tokens: int
) -> tuple[dict[str, Any], list[str]]:
    """One model's servers and rounds: per arm, tokens/s by round and the ratios by round; and the mismatches."""
    from kernelpolicy.testing import rms_norm_kernel_source, save_tiny_llama, write_kernel_repo

    folder = save_tiny_llama(root / size / "model", **MODELS[size])
    repo = write_kernel_repo(root / size / "repo", rms_norm_kernel_source(offset=0.5, can_torch_compile=True))
    prompts = _prompts(streams * requests)
    references = _References(folder, repo, tokens)
    for index, prompt in enumerate(prompts):  # before the servers start: not timed, not competing
        for policy in POLICIES:
            references.of(index, prompt, policy or "prefer")
    rates: dict[str, list[float]] = {arm: [] for arm, _, _ in ARMS}
    mismatches: list[str] = []
    with contextlib.ExitStack() as servers:
        urls = {
            kind: servers.enter_context(_server(kind, folder, repo, root / size / f"{kind}.log"))
            for kind in ("plain", "kernelpolicy", "no-metrics")
        }
        for kind, url in urls.items():  # warm-up: each policy once on each server
            for policy in POLICIES if kind == "kernelpolicy" else POLICIES[:1]:
                _ask(url, str(folder), prompts[0], policy, tokens)
        for round_ in range(rounds):
            for arm, kind, count in ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]:
                rate, answers = _load(urls[kind], str(folder), prompts, count, streams, tokens)
                rates[arm].append(rate)
                for index, policy, got in answers:
                    expected = references.of(
                        index, prompts[index], "disable" if kind == "plain" else policy or "prefer"
                    )
                    if got != expected:
                        mismatches.append(
                            f"{size} Llama, {arm}, round {round_}: prompt {prompts[index]} under {policy or 'prefer'}: "
                            f"answered {got}, alone {expected}"
                        )
            print(
                f"{size} Llama, round {round_}: " + ", ".join(f"{a}: {r[-1]:.1f}" for a, r in rates.items()), flush=True
            )
    return rates, mismatches


def _median_ratio(rates: dict[str, list[float]], arm: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(rates[arm], rates[base], strict=True))


def table(results: dict[str, dict[str, list[float]]]) -> str:
    """The Markdown table: per model and arm, median tokens/s and the medians of the per-round ratios."""
    lines = [
        "| model | arm | tokens/s (median) | / plain serve | / kernelpolicy 1 policy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size, rates in results.items():
        for arm, values in rates.items():
            plain = _median_ratio(rates, arm, ARMS[0][0])
            one = _median_ratio(rates, arm, ARMS[1][0])
            lines.append(f"| {size} | {arm} | {statistics.median(values):.1f} | {plain:.3f} | {one:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,medium", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16, help="concurrent client streams")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream per arm, one after the other")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.models.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in MODELS]
    if unknown or not sizes:
        parser.error(f"--models: unknown {unknown or args.models!r}; valid: {', '.join(MODELS)}")
    for name in ("rounds", "streams", "requests", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} takes a whole number above 0, got {getattr(args, name)}")
    import torch
    import transformers

    import kernelpolicy

    print(
        f"# serve_mixing, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: python -m benchmarks.serve_mixing "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, kernelpolicy {kernelpolicy.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    torch.set_num_threads(1)  # the references; the servers use their own threads
    results: dict[str, dict[str, list[float]]] = {}
    mismatches: list[str] = []
    with tempfile.TemporaryDirectory(prefix="serve-mixing-") as temp:
        for size in sizes:
            rates, wrong = run_model(size, Path(temp), args.rounds, args.streams, args.requests, args.tokens)
            results[size] = rates
            mismatches += wrong
    print(table(results))
    answers = len(sizes) * args.rounds * len(ARMS) * args.streams * args.requests
    print(f"answers checked against their solo run: {answers}, mismatches: {len(mismatches)}")
    for line in mismatches[:20]:
        print("  " + line)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

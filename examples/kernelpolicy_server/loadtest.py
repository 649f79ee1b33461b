"""Load test of the example server: per-request policies under concurrency, and what they cost.

``python -m examples.kernelpolicy_server.loadtest [--requests 200] [--concurrency 32] [--json PATH]``

It starts the real server (``python -m examples.kernelpolicy_server``) in a
subprocess on a free 127.0.0.1 port, waits for ``/healthz`` and sends, from
one async httpx client:

- **mixed** (the leak test): every request carries its own policy (no
  header, ``disable``, ``prefer,RMSNorm=disable``, ``RMSNorm=require``,
  ``disable,RMSNorm=require``, ``require``, malformed headers, one of them
  8 KB, and malformed bodies: JSON nested 5,000 deep, a field of the wrong
  type). Each
  response is checked against its own policy: the policy string the worker
  thread saw, the tokens (``max_new_tokens`` of them, identical across
  policies for one prompt: the kernel is bit-exact), and the calls per
  kernel layer and path (5 RMSNorm calls per forward on the kernel or the
  original path as the policy says, SiLU and rotary embeddings original
  only, one forward per new token). ``require`` must fail with 422 (SiLU and
  the rotary embedding have no kernel), malformed headers with 400 and the
  parser's message (at most 1,000 characters: long input is cut), malformed
  bodies with 400 and the body parser's message. Any response that does not match is a *leak*.
- **policies** and **prefer** (the cost): the same number of requests again,
  all of them generating: *policies* with the five valid headers above
  shuffled, *prefer* with no header (policies not used). Like for like, so
  the ratio of their throughputs is the cost of per-request policies. Each
  is sent in two halves, in the order policies, prefer, prefer, policies, so
  that warm-up and drift of a shared machine fall on both. Every response is
  checked as in the mixed phase.
- **ab** (eager server only): an A/B of the server's two RMSNorm kernels, every
  other request with ``RMSNorm=kernel:alt`` (the variant ``alt``) and the
  others without a header (the default kernel). Each response must report
  the calls its arm's kernel made (``variants``: none, or ``alt`` for every
  RMSNorm call), one token sequence per prompt and arm; the report gives the
  calls per variant and on how many prompts the two arms' tokens agree.

With ``--compile`` [``--compile-backend eager``] the server is the compiled
one (``--compile`` and one ``--policy`` per valid header above: five allowed
policies, warmed up at start). There ``require`` and a valid but unlisted
policy must be 400s naming the allowed policies; ``calls`` must be empty (a
compiled graph runs no Python); the path shows in the tokens instead (the
compiled server's kernel adds an offset): for one prompt, every request whose
RMSNorm takes one path must get the same tokens, and the two paths must
differ. ``/healthz`` at the end must report no graph compiled after warm-up.

It prints a Markdown summary (throughput of the phases, the cost ratio,
latency percentiles, the checks), optionally writes JSON, stops the server
and exits 1 if a check failed. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import httpx

from kernelpolicy import Policy, PolicyError

from . import ALT_VARIANT, not_served_message

__all__ = ["ALLOWED", "CASES", "COMPILED_CASES", "Case", "Setup", "main", "run_loadtest"]

ROOT = Path(__file__).resolve().parents[2]
HEADER = "X-Kernel-Policy"
HOST = "127.0.0.1"
RMSNORMS_PER_FORWARD = 5  # 2 decoder layers x 2 norms + the final norm
ORIGINAL_ONLY = {"SiLU": 2, "rotary_pos_emb": 2}  # no kernel mapped; calls per forward
MALFORMED_MESSAGE = "valid modes are 'prefer', 'disable', 'require', 'verify'"


@dataclass(frozen=True)
class Case:
    """One kind of request and what its response must be."""

    header: str | None
    status: int
    policy: str | None = None  # str(policy) the worker must report (200 only)
    rmsnorm: str | None = None  # the path every RMSNorm call must take (200 only)
    body: bytes | None = None  # a raw (malformed) request body instead of the prompt's JSON
    label: str | None = None  # the name in reports, where the header or body is too long to show

    @property
    def name(self) -> str:
        if self.label is not None:
            return self.label
        return "(no header)" if self.header is None else self.header


PREFER = Case(None, 200, "prefer", "kernel")
DISABLE = Case("disable", 200, "disable", "original")
CASES: tuple[Case, ...] = (
    PREFER,
    DISABLE,
    Case("prefer,RMSNorm=disable", 200, "prefer,RMSNorm=disable", "original"),
    Case("RMSNorm=require", 200, "prefer,RMSNorm=require", "kernel"),
    Case("disable,RMSNorm=require", 200, "disable,RMSNorm=require", "kernel"),
    Case("require", 422),  # SiLU and rotary_pos_emb have no kernel: KernelUnavailableError
    Case("RMSNorm=fast", 400),
    Case("disable,SiLU=fast", 400),
    # 12 KB: under h11's 16 KiB limit on a request head that arrives in pieces (uvicorn's HTTP layer answers
    # "Invalid HTTP request received." over it, whenever TCP splits the head), far over the 1,000 characters
    # a 400 message may echo.
    Case("RMSNorm=fast" + "x" * 12_000, 400, label="(12 KB malformed header)"),
    Case(None, 400, body=b"[" * 5000 + b"]" * 5000, label="(JSON body nested 5,000 deep)"),
    Case(None, 400, body=b'{"input_ids": [1, 2], "max_new_tokens": "3"}', label="(max_new_tokens a string)"),
)
#: The A/B arm of the variant kernel (the other arm is PREFER: the default kernel).
ALT = Case(f"RMSNorm=kernel:{ALT_VARIANT}", 200, f"prefer,RMSNorm=kernel:{ALT_VARIANT}", "kernel")
#: The compiled server's allowlist: the policies of the generating cases (the default is always served).
ALLOWED: tuple[Policy, ...] = tuple(Policy.parse(c.header or "prefer") for c in CASES if c.status == 200)
COMPILED_CASES: tuple[Case, ...] = (
    *(c for c in CASES if c.status in (200, 400)),
    Case("require", 400),  # valid, not in the allowlist
    Case("prefer,SiLU=disable", 400),  # the same program as prefer, but not in the allowlist
)


@dataclass(frozen=True)
class Setup:
    """Which server runs: eager (every policy) or compiled (an allowlist, warmed up)."""

    compiled: bool = False
    backend: str = "inductor"

    @property
    def cases(self) -> tuple[Case, ...]:
        return COMPILED_CASES if self.compiled else CASES

    def server_args(self) -> list[str]:
        if not self.compiled:
            return []
        return ["--compile", "--compile-backend", self.backend, *(f"--policy={p}" for p in ALLOWED)]


EAGER = Setup()


@dataclass
class Result:
    case: Case
    prompt: int
    status: int | None  # None: transport error or timeout
    body: Any
    latency_s: float
    done_at: float


def _prompts(count: int = 4, length: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(count)]


def _plan(requests: int, cases: tuple[Case, ...], prompts: int) -> list[tuple[Case, int]]:
    """``requests`` (case, prompt index) pairs: every case meets every prompt, in a fixed shuffled order."""
    plan = [(cases[i % len(cases)], (i // len(cases)) % prompts) for i in range(requests)]
    random.Random(1).shuffle(plan)
    return plan


def expected_calls(case: Case, steps: int) -> dict[str, dict[str, int]]:
    """The ``calls`` of a 200 response to ``case`` generating ``steps`` tokens (one forward each)."""
    assert case.rmsnorm is not None
    calls = {"RMSNorm": {case.rmsnorm: RMSNORMS_PER_FORWARD * steps}}
    calls.update({layer: {"original": per * steps} for layer, per in ORIGINAL_ONLY.items()})
    return calls


def parser_message(header: str) -> str:
    """What the server must answer for a malformed header: the parser's own message."""
    try:
        Policy.parse(header, source=f"header {HEADER}")
    except PolicyError as exc:
        return str(exc)
    raise AssertionError(f"{header!r} is not malformed")


def message_400(header: str) -> str:
    """The parser's message for a malformed header, else (compiled server) the allowlist's."""
    try:
        return not_served_message(Policy.parse(header), ALLOWED)
    except PolicyError:
        return parser_message(header)


def check(result: Result, steps: int, setup: Setup = EAGER) -> str | None:
    """Why ``result`` does not match its case's policy, or None (tokens are compared across responses)."""
    case, body = result.case, result.body
    if result.status != case.status:
        return f"status {result.status}, expected {case.status}: {str(body)[:200]}"
    if not isinstance(body, dict):
        return f"body is not a JSON object: {str(body)[:200]}"
    if case.status == 400 and case.body is not None:
        if not str(body.get("error", "")).startswith("bad request body: "):
            return f"400 without the body parser's message: {str(body)[:200]}"
        return None
    if case.status == 400:
        assert case.header is not None
        if len(str(body.get("error", ""))) > 1000:
            return f"400 message of {len(str(body.get('error')))} characters: input echoed untruncated"
        if body.get("error") != message_400(case.header):
            return f"400 without the expected message: {body!r}"
        return None
    if case.status == 422:
        error, calls = str(body.get("error", "")), body.get("calls")
        if "kernel required but unavailable" not in error or "no kernel bound" not in error:
            return f"422 without the KernelUnavailableError message: {body!r}"
        if body.get("policy") != "require" or not isinstance(calls, dict):
            return f"422 with wrong policy or calls: {body!r}"
        paths = {path for per_layer in calls.values() for path in per_layer}
        if "original" in paths or sum(p.get("error", 0) for p in calls.values()) != 1:
            return f"require ran an original forward or failed more than once: {calls!r}"
        return None
    if body.get("policy") != case.policy:
        return f"worker saw policy {body.get('policy')!r}, expected {case.policy!r}"
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != steps:
        return f"expected {steps} tokens, got {tokens!r}"
    expected = {} if setup.compiled else expected_calls(case, steps)  # a compiled graph runs no Python
    if body.get("calls") != expected:
        return f"calls {body.get('calls')!r}, expected {expected!r}"
    return None


def tokens_follow_the_path(results: list[Result], setup: Setup) -> tuple[bool, int]:
    """(check, prompts): per prompt, one token sequence per RMSNorm path; eager: one for both (bit-exact
    kernel), compiled: two distinct ones (the kernel adds an offset), so a request on the wrong path shows."""
    seen: dict[int, dict[str, set[tuple[int, ...]]]] = {}
    for r in results:
        if r.status == 200 and r.case.rmsnorm and isinstance(r.body, dict) and isinstance(r.body.get("tokens"), list):
            seen.setdefault(r.prompt, {}).setdefault(r.case.rmsnorm, set()).add(tuple(r.body["tokens"]))
    ok = bool(seen)
    for paths in seen.values():
        sequences = [next(iter(found)) for found in paths.values()]
        ok = ok and all(len(found) == 1 for found in paths.values())
        if setup.compiled:
            ok = ok and len(paths) == 2 and sequences[0] != sequences[1]
        else:
            ok = ok and len(set(sequences)) == 1
    return ok, len(seen)


def ab_report(results: list[Result], steps: int) -> dict[str, Any]:
    """The A/B phase: each arm's calls per variant, wrong responses, and on how many prompts the arms agree."""
    arms = {"default": PREFER, ALT_VARIANT: ALT}
    report: dict[str, Any] = {"requests": len(results), "arms": {}, "wrong": [], "consistent_within_arm": True}
    sequences: dict[str, dict[int, set[tuple[int, ...]]]] = {name: {} for name in arms}
    for name, case in arms.items():
        rows = [r for r in results if r.case is case]
        expected = {} if case is PREFER else {ALT_VARIANT: 5 * steps}  # 5 RMSNorm calls per forward
        calls: dict[str, int] = {}
        for r in rows:
            body = r.body if isinstance(r.body, dict) else {}
            if r.status != 200 or body.get("policy") != case.policy or body.get("variants") != expected:
                report["wrong"].append(f"{name}: {r.status} {str(r.body)[:300]}")
                continue
            for variant, n in body["variants"].items():
                calls[variant] = calls.get(variant, 0) + n
            sequences[name].setdefault(r.prompt, set()).add(tuple(body["tokens"]))
        report["arms"][name] = {"header": case.header, "sent": len(rows), "variant_calls": calls}
    prompts = sorted(set(sequences["default"]) & set(sequences[ALT_VARIANT]))
    report["consistent_within_arm"] = all(len(seen) == 1 for arm in sequences.values() for seen in arm.values())
    report["prompts"] = len(prompts)
    report["prompts_agreeing"] = sum(1 for p in prompts if sequences["default"][p] == sequences[ALT_VARIANT][p])
    return report


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: IO[bytes]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-chars:]


async def _wait_healthy(server: Server, deadline: float) -> bool:
    """True once /healthz answers 200; False if the process exits first."""
    async with httpx.AsyncClient(base_url=server.url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200:
                    return True
            await asyncio.sleep(0.2)
    raise RuntimeError(f"server not healthy within the start-up timeout:\n{server.log_tail()}")


async def start_server(
    workers: int, log: IO[bytes], deadline: float, started: list[Server], setup: Setup = EAGER
) -> Server:
    """The example server in a subprocess on a free loopback port (a few tries if a port is taken).

    Every process started is appended to ``started``: the caller stops them, whatever happens here.
    """
    env = {k: v for k, v in os.environ.items() if k != "KERNELPOLICY"}  # the default policy is prefer
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for _ in range(3):
        port = _free_port()
        command = [sys.executable, "-m", "examples.kernelpolicy_server", "--port", str(port)]
        command += ["--workers", str(workers), "--no-access-log", "--log-level", "info", *setup.server_args()]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        started.append(Server(process, port, log))
        if await _wait_healthy(started[-1], deadline):
            return started[-1]
    raise RuntimeError(f"the server exited during start-up:\n{started[-1].log_tail()}")


def stop_server(server: Server) -> int:
    """SIGTERM (uvicorn shuts down gracefully, then re-raises it), SIGKILL after 15 s; the exit code."""
    if server.process.poll() is not None:
        return server.process.returncode
    server.process.terminate()
    try:
        return server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        return server.process.wait()


async def _send(
    client: httpx.AsyncClient, case: Case, prompt: int, ids: list[int], steps: int, gate: asyncio.Semaphore
) -> Result:
    headers = {} if case.header is None else {HEADER: case.header}
    async with gate:
        start = time.perf_counter()
        try:
            if case.body is None:
                request = {"input_ids": ids, "max_new_tokens": steps}
                response = await client.post("/generate", json=request, headers=headers)
            else:
                headers["content-type"] = "application/json"
                response = await client.post("/generate", content=case.body, headers=headers)
            status: int | None = response.status_code
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
        except httpx.HTTPError as exc:
            status, body = None, f"{type(exc).__name__}: {exc}"
        end = time.perf_counter()
    return Result(case, prompt, status, body, end - start, end)


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


async def _send_all(
    client: httpx.AsyncClient, plan: list[tuple[Case, int]], prompts: list[list[int]], steps: int, concurrency: int
) -> tuple[list[Result], float]:
    """Send ``plan`` with at most ``concurrency`` requests in flight; the results and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    results = await asyncio.gather(*(_send(client, c, p, prompts[p], steps, gate) for c, p in plan))
    return list(results), time.perf_counter() - start


def _stats(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r.latency_s for r in results if r.status == 200]
    statuses: dict[str, int] = {}
    for r in results:
        key = "error" if r.status is None else str(r.status)
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "requests": len(results),
        "status_counts": dict(sorted(statuses.items())),
        "wall_s": round(wall, 4),
        "requests_per_s": round(len(results) / wall, 2),
        "generations_per_s": round(len(ok) / wall, 2),
        "latency_ms_200": {
            "p50": _ms(_percentile(ok, 0.5)),
            "p99": _ms(_percentile(ok, 0.99)),
            "max": _ms(max(ok, default=None)),
        },
    }


async def _probe_after_malformed(client: httpx.AsyncClient, prompt: list[int], steps: int, setup: Setup) -> bool:
    """One malformed request, then a valid one and /healthz, in sequence: the server must still serve."""
    bad = await client.post("/generate", json={"input_ids": prompt, "max_new_tokens": steps}, headers={HEADER: "fast"})
    good = await client.post(
        "/generate", json={"input_ids": prompt, "max_new_tokens": steps}, headers={HEADER: "disable"}
    )
    health = await client.get("/healthz")
    good_ok = good.status_code == 200 and check(Result(DISABLE, 0, 200, good.json(), 0, 0), steps, setup) is None
    return bad.status_code == 400 and good_ok and health.status_code == 200


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "kernels", "starlette", "uvicorn", "httpx"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "?"
    return versions


async def _run(
    requests: int, concurrency: int, steps: int, workers: int, timeout: float, log: IO[bytes], setup: Setup
) -> dict[str, Any]:
    prompts = _prompts()
    cases = setup.cases
    mixed_plan = _plan(requests, cases, len(prompts))
    policies_plan = _plan(requests, tuple(c for c in cases if c.status == 200), len(prompts))
    prefer_plan = [(PREFER, prompt) for _, prompt in policies_plan]
    half = len(policies_plan) // 2
    halves = [
        ("policies", policies_plan[:half]),
        ("prefer", prefer_plan[:half]),
        ("prefer", prefer_plan[half:]),
        ("policies", policies_plan[half:]),
    ]
    sent: dict[str, list[Result]] = {"policies": [], "prefer": []}
    walls = dict.fromkeys(sent, 0.0)
    started: list[Server] = []
    try:
        server = await start_server(workers, log, time.monotonic() + min(timeout, 300.0), started, setup)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits) as client:
            # Warm-up, not measured: every case once, and the connection pool.
            await _send_all(
                client, _plan(max(len(cases), concurrency), cases, len(prompts)), prompts, steps, concurrency
            )
            mixed, mixed_wall = await _send_all(client, mixed_plan, prompts, steps, concurrency)
            served_after = await _probe_after_malformed(client, prompts[0], steps, setup)
            for name, plan in halves:
                results, wall = await _send_all(client, plan, prompts, steps, concurrency)
                sent[name] += results
                walls[name] += wall
            ab_results: list[Result] = []
            if not setup.compiled:  # the A/B: every other request on the variant kernel
                ab_plan = [(ALT if i % 2 else PREFER, i // 2 % len(prompts)) for i in range(requests)]
                ab_results, _ = await _send_all(client, ab_plan, prompts, steps, concurrency)
            compiled = (await client.get("/healthz")).json().get("compiled")
    finally:
        exit_code = [stop_server(s) for s in started][-1] if started else None
        log_text = started[-1].log_tail(1_000_000) if started else ""
    mixed_stats = _stats(mixed, mixed_wall)
    policies, prefer = sent["policies"], sent["prefer"]
    policies_stats, prefer_stats = _stats(policies, walls["policies"]), _stats(prefer, walls["prefer"])

    everything = mixed + policies + prefer
    leaks = [(r, why) for r in everything if r.status is not None and (why := check(r, steps, setup)) is not None]
    transport = [r for r in everything if r.status is None]
    malformed = [r for r in mixed if r.case.status == 400]
    required = [r for r in mixed if r.case.status == 422]
    tokens_ok, prompts_seen = tokens_follow_the_path(everything, setup)
    per_case = []
    for case in cases:
        rows = [r for r in mixed if r.case == case]
        latencies = [r.latency_s for r in rows]
        per_case.append(
            {
                "case": case.name,
                "header": case.header if case.label is None else None,
                "expected_status": case.status,
                "sent": len(rows),
                "matched": sum(1 for r in rows if r.status is not None and check(r, steps, setup) is None),
                "p50_ms": _ms(_percentile(latencies, 0.5)),
            }
        )
    first_400 = min((r.done_at for r in malformed if r.status == 400), default=None)
    ok_after_400 = sum(1 for r in mixed if r.status == 200 and first_400 is not None and r.done_at > first_400)

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return round(numerator / denominator, 3) if numerator and denominator else None

    return {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpus": os.cpu_count(),
            "requests": requests,
            "concurrency": concurrency,
            "max_new_tokens": steps,
            "workers": 1 if setup.compiled else workers,
            "compiled": f"torch.compile, backend {setup.backend}" if setup.compiled else None,
            "versions": _versions(),
        },
        "phases": {"mixed": mixed_stats, "policies": policies_stats, "prefer": prefer_stats},
        "ratio_policies_to_prefer": {
            "generations_per_s": ratio(policies_stats["generations_per_s"], prefer_stats["generations_per_s"]),
            "p50_latency": ratio(policies_stats["latency_ms_200"]["p50"], prefer_stats["latency_ms_200"]["p50"]),
            "p99_latency": ratio(policies_stats["latency_ms_200"]["p99"], prefer_stats["latency_ms_200"]["p99"]),
        },
        "checks": {
            "leaks": len(leaks),
            "leak_examples": [f"{r.case.name}: {why}" for r, why in leaks[:10]],
            "transport_errors": len(transport),
            "transport_error_examples": [str(r.body) for r in transport[:5]],
            "responses_checked": len(everything) - len(transport),
            "malformed_sent": len(malformed),
            "malformed_400_with_parser_message": sum(1 for r in malformed if check(r, steps, setup) is None),
            "require_sent": len(required),
            "require_422": sum(1 for r in required if check(r, steps, setup) is None),
            "generated_200_after_first_400": ok_after_400,
            "served_after_malformed": served_after and ok_after_400 > 0,
            "tokens_follow_the_path": tokens_ok,
            "prompts": prompts_seen,
            "compiled_graphs": compiled,
            "compiles_after_warmup": None if compiled is None else compiled["graphs"] - compiled["graphs_at_warmup"],
            "server_exit_code": exit_code,
            # uvicorn ends on the SIGTERM it re-raises after a graceful shutdown (exit code -15)
            "server_shutdown_clean": exit_code in (0, -signal.SIGTERM)
            and "Application shutdown complete" in log_text
            and "Traceback" not in log_text,
        },
        "cases": per_case,
        "ab": ab_report(ab_results, steps) if not setup.compiled else None,
    }


def passed(results: dict[str, Any]) -> bool:
    """Whether every check of a run passed (timings are never checked)."""
    c = results["checks"]
    return bool(
        c["leaks"] == 0
        and c["transport_errors"] == 0
        and c["malformed_400_with_parser_message"] == c["malformed_sent"]
        and c["require_422"] == c["require_sent"]
        and c["served_after_malformed"]
        and c["tokens_follow_the_path"]
        and c["compiles_after_warmup"] in (None, 0)
        and c["server_shutdown_clean"]
        and (results["ab"] is None or (not results["ab"]["wrong"] and results["ab"]["consistent_within_arm"]))
    )


def run_loadtest(
    requests: int = 200,
    concurrency: int = 32,
    *,
    max_new_tokens: int = 4,
    workers: int = 4,
    timeout: float = 600.0,
    command: str | None = None,
    setup: Setup = EAGER,
) -> dict[str, Any]:
    """Run the phases against a fresh server subprocess; the results (see :func:`markdown`)."""
    if requests < len(setup.cases) or concurrency < 1 or not 1 <= max_new_tokens <= 32:
        raise ValueError(f"need requests >= {len(setup.cases)}, concurrency >= 1 and 1 <= max_new_tokens <= 32")
    with tempfile.NamedTemporaryFile(prefix="kernelpolicy-server-", suffix=".log") as log:
        try:
            results = asyncio.run(
                asyncio.wait_for(_run(requests, concurrency, max_new_tokens, workers, timeout, log, setup), timeout)
            )
        except (TimeoutError, asyncio.TimeoutError) as exc:  # distinct classes on Python 3.10
            raise TimeoutError(f"load test exceeded {timeout} s") from exc
    results["meta"]["command"] = command or f"run_loadtest(requests={requests}, concurrency={concurrency})"
    results["passed"] = passed(results)
    return results


def markdown(results: dict[str, Any]) -> str:
    """A Markdown summary of :func:`run_loadtest`'s results."""
    meta, checks, phases = results["meta"], results["checks"], results["phases"]
    v = meta["versions"]
    lines = [
        f"### kernelpolicy server load test, {meta['date']}",
        "",
        f"`{meta['command']}`: {meta['requests']} requests per phase, concurrency {meta['concurrency']}, "
        f"{meta['max_new_tokens']} new tokens each, {meta['workers']} worker threads (torch 1 thread each), "
        + (f"compiled ({meta['compiled']}, warmed up), " if meta.get("compiled") else "")
        + f"{meta['cpus']} CPUs. Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
        f"kernels {v['kernels']}, starlette {v['starlette']}, uvicorn {v['uvicorn']}, httpx {v['httpx']}.",
        "",
        "| phase | requests | statuses | wall s | requests/s | generations/s | p50 ms (200) | p99 ms (200) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, p in phases.items():
        statuses = ", ".join(f"{k}: {n}" for k, n in p["status_counts"].items())
        lat = p["latency_ms_200"]
        lines.append(
            f"| {name} | {p['requests']} | {statuses} | {p['wall_s']:.2f} | {p['requests_per_s']:.1f} | "
            f"{p['generations_per_s']:.1f} | {lat['p50']} | {lat['p99']} |"
        )
    ratio = results["ratio_policies_to_prefer"]
    lines += [
        "",
        f"Per-request policies / no policies (*policies* / *prefer*, {phases['prefer']['requests']} generating "
        f"requests each, sent in halves A B B A): throughput **{ratio['generations_per_s']}**, p50 latency "
        f"{ratio['p50_latency']}, p99 latency {ratio['p99_latency']}. The *mixed* phase is the leak test: it also "
        "answers cheap 400s and early 422s, so its throughput is not comparable.",
        "",
        "| check | result |",
        "| --- | --- |",
        f"| leaks (responses not matching their own policy) | **{checks['leaks']}** of {checks['responses_checked']} |",
        f"| transport errors | {checks['transport_errors']} |",
        f"| malformed headers and bodies (compiled: or unlisted policies) answered 400 with the parser's (allowlist's) message | "
        f"{checks['malformed_400_with_parser_message']} / {checks['malformed_sent']} |",
        f"| `require` answered 422 (SiLU, rotary embedding: no kernel) | {checks['require_422']} / {checks['require_sent']} |",
        f"| served after malformed headers | {'yes' if checks['served_after_malformed'] else 'NO'} "
        f"({checks['generated_200_after_first_400']} generations after the first 400) |",
        f"| tokens follow the RMSNorm path (eager: identical, bit-exact kernel; compiled: one sequence per path, "
        f"paths distinct) | {'yes' if checks['tokens_follow_the_path'] else 'NO'} ({checks['prompts']} prompts) |",
        *(
            [
                f"| graphs compiled at warm-up / after it | {checks['compiled_graphs']['graphs_at_warmup']} / "
                f"**{checks['compiles_after_warmup']}** ({len(checks['compiled_graphs']['policies'])} policies) |"
            ]
            if checks["compiled_graphs"]
            else []
        ),
        f"| server shut down cleanly | {'yes' if checks['server_shutdown_clean'] else 'NO'} "
        f"(exit code {checks['server_exit_code']}) |",
        "",
        "| mixed phase: case | expected | sent | matched | p50 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in results["cases"]:
        header = case["case"] if case["header"] is None else f"`{case['header']}`"
        lines.append(
            f"| {header} | {case['expected_status']} | {case['sent']} | {case['matched']} | {case['p50_ms']} |"
        )
    ab = results.get("ab")
    if ab:
        arms = "; ".join(
            f"{name} (`{arm['header'] or 'no header'}`): {arm['sent']} requests, calls per variant "
            f"{arm['variant_calls'] or '{} (the default kernel)'}"
            for name, arm in ab["arms"].items()
        )
        lines += [
            "",
            f"A/B of two RMSNorm kernels, {ab['requests']} requests: {arms}. Wrong responses: **{len(ab['wrong'])}**; "
            f"one token sequence per prompt and arm: {'yes' if ab['consistent_within_arm'] else 'NO'}; the arms' "
            f"tokens agree on {ab['prompts_agreeing']} of {ab['prompts']} prompts.",
        ]
    for example in checks["leak_examples"]:
        lines.append(f"\nleak: {example}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.kernelpolicy_server.loadtest", description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="requests per phase (default 200)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="tokens per request (default 4)")
    parser.add_argument("--workers", type=int, default=4, help="server worker threads (default 4)")
    parser.add_argument("--timeout", type=float, default=600.0, help="overall limit in seconds (default 600)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--compile", action="store_true", help="load-test the compiled server (five allowed policies)")
    parser.add_argument("--compile-backend", default="inductor", help="its torch.compile backend (default inductor)")
    args = parser.parse_args(argv)
    command = shlex.join(
        ["python", "-m", "examples.kernelpolicy_server.loadtest", *(sys.argv[1:] if argv is None else argv)]
    )
    results = run_loadtest(
        args.requests,
        args.concurrency,
        max_new_tokens=args.max_new_tokens,
        workers=args.workers,
        timeout=args.timeout,
        command=command,
        setup=Setup(compiled=args.compile, backend=args.compile_backend),
    )
    print(markdown(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

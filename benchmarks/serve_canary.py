"""What ``--verify-sample`` costs: tokens/s of ``python -m kernelpolicy serve`` at 0, 1% and 10%.

``python -m benchmarks.serve_canary``: for each fraction, the real server on 127.0.0.1 (a saved tiny Llama, its
RMSNorm kernel from a local repository, continuous batching, CPU), then ``--requests`` chat requests,
``--concurrency`` at a time, each ``--tokens`` new tokens; prints tokens/s and the canary requests /metrics counted.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run(folder: Path, repo: Path, fraction: float, requests: int, concurrency: int, tokens: int) -> tuple[float, str]:
    """(tokens/s, the canary lines of /metrics) of one server at ``fraction``."""
    import httpx

    from kernelpolicy.testing import free_port, wait_for_health

    port = free_port()
    command = [sys.executable, "-m", "kernelpolicy", "serve", str(folder), "--continuous-batching", "--device", "cpu"]
    command += ["--cb-num-blocks", "256", "--cb-max-batch-tokens", "512", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--kernel", f"RMSNorm={repo}", "--verify-sample", str(fraction)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, server)

        def one(i: int) -> None:
            body = {
                "model": str(folder),
                "messages": [{"role": "user", "content": f"w{5 + i % 50} w{9 + i % 31} w7"}],
                "max_tokens": tokens,
                "temperature": 0,
            }
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
            response.raise_for_status()

        one(0)  # warm
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
        rate = requests * tokens / (time.perf_counter() - started)
        text = httpx.get(f"{url}/metrics", timeout=30).text
        lines = [
            line for line in text.splitlines() if line.startswith(("kernelpolicy_canary", "kernelpolicy_verify_m"))
        ]
        return rate, "; ".join(lines)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--fractions", default="0,0.01,0.1")
    args = parser.parse_args()
    from kernelpolicy.testing import rms_norm_kernel_source, save_tiny_llama, write_kernel_repo

    root = Path(tempfile.mkdtemp(prefix="serve-canary-"))
    folder = save_tiny_llama(root / "model")
    repo = write_kernel_repo(root / "repo", rms_norm_kernel_source(offset=0.5, can_torch_compile=True))
    baseline = None
    for fraction in (float(f) for f in args.fractions.split(",")):
        rate, lines = run(folder, repo, fraction, args.requests, args.concurrency, args.tokens)
        baseline = baseline or rate
        print(
            f"--verify-sample {fraction}: {rate:.1f} tokens/s ({rate / baseline:.3f} of the first) {lines}", flush=True
        )


if __name__ == "__main__":
    main()

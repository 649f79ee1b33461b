"""``python -m kernelpolicy serve``: transformers' own server with a policy per request (the X-Kernel-Policy header).

The server runs as a user starts it (its documented command, in a subprocess, on 127.0.0.1, offline), on a saved
tiny Llama whose RMSNorm layers get a local kernel that adds 0.5 (``--kernel RMSNorm=PATH``): every greedy
answer shows the path its request took, and is compared with the same prompt generated alone under its policy.
Only the process it started is stopped. The header's parsing is tested in-process in the default tier.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy import _compat
from kernelpolicy.serving import HEADER, MAX_HEADER, PolicyHeader, parse_header

PROMPTS = [[5, 6, 7], [9, 8], [40, 41, 42, 43], [100], [7, 7, 7], [200, 3], [11, 12, 13], [60, 61]]
TOKENS = 6


def test_a_header_parses_to_its_policy() -> None:
    assert parse_header(b"disable") == kp.Policy.parse("disable")
    assert parse_header(b"prefer,RMSNorm=disable") == kp.Policy.parse("prefer,RMSNorm=disable")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"bogus", "unknown kernel policy mode 'bogus'"),
        (b"RMSNorm=", "header X-Kernel-Policy"),
        ("disable\u00b3".encode("latin-1"), "must be ASCII text"),
        (b"x" * (MAX_HEADER + 1), f"at most {MAX_HEADER} are taken"),
    ],
)
def test_a_bad_header_is_a_policy_error_naming_it(value: bytes, message: str) -> None:
    with pytest.raises(kp.PolicyError, match=re.escape(message)):
        parse_header(value)


def test_the_middleware_answers_400_in_openais_shape_and_runs_the_rest_in_the_policy() -> None:
    import asyncio

    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(str(kp.current_policy()))

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    def request(*values: bytes) -> dict[str, Any]:
        return {"type": "http", "headers": [(HEADER.lower().encode(), v) for v in values]}

    middleware = PolicyHeader(app)
    asyncio.run(middleware(request(b"RMSNorm=disable"), None, send))
    asyncio.run(middleware(request(), None, send))
    assert seen == ["prefer,RMSNorm=disable", "prefer"] and sent == []
    asyncio.run(middleware(request(b"disable", b"prefer"), None, send))
    asyncio.run(middleware(request(b"nope"), None, send))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400, 400]
    errors = [json.loads(m["body"])["error"] for m in sent if m["type"] == "http.response.body"]
    assert "given 2 times" in errors[0]["message"] and "'nope'" in errors[1]["message"]
    assert all(e["type"] == "invalid_request_error" and e["param"] == HEADER for e in errors)
    assert len(seen) == 2  # a refused request never reaches the app


@pytest.mark.parametrize("given", [["--api-server-count", "2"], ["--api-server-count=3"]])
def test_several_api_servers_are_refused_rather_than_serving_one_policy(
    given: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelpolicy import serving

    assert serving.main(["some-model", *given]) == 2
    assert "is not supported yet" in capsys.readouterr().err


# --- the real server ----------------------------------------------------------------------------------

needs_serve = pytest.mark.skipif(
    not all(
        _compat.first_present(seam) for seam in (_compat.SERVING_BUILD, _compat.SERVING_SEND, *_compat.SERVING_RUNNERS)
    ),
    reason="this transformers has not the serve seams of 5.25 (or not its serving extra)",
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    """The server (continuous batching), its base URL, the model folder, and the solo reference model."""
    pytest.importorskip("fastapi")
    import transformers

    from kernelpolicy.testing import local_mapping, rms_norm_kernel_source, save_tiny_llama, write_kernel_repo

    root = tmp_path_factory.mktemp("serve")
    folder = save_tiny_llama(root / "model")
    repo = write_kernel_repo(root / "repo", rms_norm_kernel_source(offset=0.5, can_torch_compile=True))
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    command = [sys.executable, "-m", "kernelpolicy", "serve", str(folder), "--continuous-batching"]
    command += ["--cb-num-blocks", "64", "--cb-max-batch-tokens", "512", "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--kernel", f"RMSNorm={repo}"]
    log = (root / "server.log").open("w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with local_mapping({"RMSNorm": repo}):
        kp.kernelize(reference, mode="inference", device="cpu")
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the server did not start:\n" + (root / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url, str(folder), reference
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the engine it spawned, nothing else
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()


def solo(reference: Any, policy: str, prompt: list[int]) -> list[int]:
    """The tokens of ``prompt`` generated alone under ``policy``, as the server's text shows them (token 0 is the
    tokenizer's special token, which decoding leaves out)."""
    with kp.kernel_policy(kp.Policy.parse(policy)):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False)
    return [token for token in out[0, len(prompt) :].tolist() if token != 0]


def ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


def words(prompt: list[int]) -> str:
    return " ".join(f"w{i}" for i in prompt)


def chat(url: str, model: str, prompt: list[int], policy: str | None, *, stream: bool = False) -> tuple[int, Any]:
    import httpx

    headers = {} if policy is None else {HEADER: policy}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": words(prompt)}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        return response.status_code, response.json()
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                text += delta or ""
        return response.status_code, text


@pytest.mark.slow
@needs_serve
def test_each_route_answers_by_the_header(served: tuple[str, str, Any]) -> None:
    import httpx

    url, model, reference = served
    prompt = PROMPTS[0]
    expected = {policy: solo(reference, policy, prompt) for policy in ("prefer", "disable", "RMSNorm=disable")}
    assert expected["prefer"] != expected["disable"] == expected["RMSNorm=disable"]
    for policy in (None, "prefer", "disable", "RMSNorm=disable"):
        status, body = chat(url, model, prompt, policy)
        assert status == 200 and ids(body["choices"][0]["message"]["content"]) == expected[policy or "prefer"]
        status, text = chat(url, model, prompt, policy, stream=True)
        assert status == 200 and ids(text) == expected[policy or "prefer"]
    completion = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": words(prompt), "max_tokens": TOKENS, "temperature": 0},
        headers={HEADER: "disable"},
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    assert ids(completion.json()["choices"][0]["text"]) == solo(reference, "disable", prompt)
    response = httpx.post(
        f"{url}/v1/responses",
        json={"model": model, "input": words(prompt), "max_output_tokens": TOKENS, "temperature": 0},
        headers={HEADER: "disable"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert ids(response.json()["output"][0]["content"][0]["text"]) == expected["disable"]


@pytest.mark.slow
@needs_serve
def test_a_bad_header_is_400_json_and_the_server_keeps_serving(served: tuple[str, str, Any]) -> None:
    url, model, reference = served
    for bad in ("bogus", "RMSNorm=sometimes", "prefer,,", "x" * 2000):
        status, body = chat(url, model, PROMPTS[1], bad)
        assert status == 400 and body["error"]["param"] == HEADER, body
    status, body = chat(url, model, PROMPTS[1], "disable")
    assert status == 200 and ids(body["choices"][0]["message"]["content"]) == solo(reference, "disable", PROMPTS[1])


@pytest.mark.slow
@needs_serve
def test_load_concurrent_streams_in_two_policies_get_their_solo_tokens(
    served: tuple[str, str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """16 streaming requests at once (8 prompts x 2 policies): each equals its prompt alone under its policy."""
    url, model, reference = served
    jobs = [(prompt, policy) for prompt in PROMPTS for policy in ("prefer", "RMSNorm=disable")]
    expected = [solo(reference, policy, prompt) for prompt, policy in jobs]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        timed = list(pool.map(lambda job: (chat(url, model, job[0], job[1], stream=True), time.perf_counter()), jobs))
    wall = time.perf_counter() - started
    assert [status for (status, _), _ in timed] == [200] * len(jobs)
    assert [ids(text) for (_, text), _ in timed] == expected
    for policy in ("prefer", "RMSNorm=disable"):
        ends = [end - started for ((_, _), end), (_, p) in zip(timed, jobs, strict=True) if p == policy]
        tokens = TOKENS * len(ends)  # every request runs to max_tokens (the model has no end token)
        with capsys.disabled():
            print(
                f"\n  {policy}: {tokens} tokens in {max(ends):.2f} s ({tokens / max(ends):.1f} tokens/s; wall {wall:.2f} s)"
            )

"""``python -m kernelpolicy serve``: transformers' own server with a policy per request (the X-Kernel-Policy header).

The server runs as a user starts it (its documented command, in a subprocess, on 127.0.0.1, offline), on a saved
tiny Llama whose RMSNorm layers get a local kernel that adds 0.5 (``--kernel RMSNorm=PATH``): every greedy
answer shows the path its request took, and is compared with the same prompt generated alone under its policy.
Only the process it started is stopped. The header's parsing is tested in-process in the default tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernelpolicy as kp
from kernelpolicy._compat import _compat
from kernelpolicy.serving import HEADER, MAX_HEADER, PolicyHeader, parse_header
from kernelpolicy.serving._access import MAX_ENTRIES, MAX_VARIANTS, OTHER, Access
from kernelpolicy.testing import free_port, wait_for_health

PROMPTS = [[5, 6, 7], [9, 8], [40, 41, 42, 43], [100], [7, 7, 7], [200, 3], [11, 12, 13], [60, 61]]
TOKENS = 6
#: The token a marker kernel raises on (:func:`marker_kernel_source`), and prompts that carry it.
MARKER = 77
MARKED = [[MARKER, 5], [3, MARKER, 9, 10]]


def marker_kernel_source(marker_row: list[float]) -> str:
    """``layers.py``: Llama's RMSNorm plus 0.5, raising where a row of its input starts as ``marker_row`` (the
    marker token's embedding: the first layer's input norm, in the step that reads the prompt)."""
    return textwrap.dedent(f"""
        import torch
        from torch import nn

        MARKER = torch.tensor({marker_row!r})


        class RMSNorm(nn.Module):
            can_torch_compile = True
            has_backward = True

            def forward(self, hidden_states):
                head = hidden_states[..., : MARKER.numel()]
                if (head == MARKER.to(hidden_states.dtype)).all(-1).any():
                    raise RuntimeError("the marker token")
                input_dtype = hidden_states.dtype
                hidden_states = hidden_states.to(torch.float32)
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
                return self.weight * hidden_states.to(input_dtype) + 0.5
    """)


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


def _run(access: Access, *values: bytes) -> tuple[int | None, dict[str, Any] | None, str | None]:
    """One request through the middleware under ``access``: (its error status or None, the error body or None, the policy the app
    ran under or None)."""
    import asyncio

    ran: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        ran.append(str(kp.current_policy()))

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": [(HEADER.lower().encode(), v) for v in values]}
    asyncio.run(PolicyHeader(app, access)(scope, None, send))
    if not sent:
        return None, None, ran[0]
    assert not ran  # a refused request never reaches the app
    return sent[0]["status"], json.loads(sent[1]["body"])["error"], None


def test_by_default_clients_may_turn_kernels_off_and_nothing_more() -> None:
    access = Access()
    for allowed in ("prefer", "disable", "RMSNorm=disable", "disable,RMSNorm=prefer"):
        assert _run(access, allowed.encode())[2] == str(kp.Policy.parse(allowed))
    for refused in ("verify", "RMSNorm=verify", "require", "SiLU=require", "RMSNorm=kernel:fast", "max_failures=1"):
        status, error, _ = _run(access, refused.encode())
        assert status == 403 and error is not None and error["code"] == "policy_not_allowed", refused
        assert "modes 'prefer', 'disable' for the default and any layer" in error["message"]
        assert "the policies 'prefer' (the default)" in error["message"] and error["param"] == HEADER
    status, error, _ = _run(access, b"bogus")
    assert status == 400 and error is not None and error["code"] == "invalid_policy"


def test_the_operator_lists_whole_policies_and_modes() -> None:
    """An A/B test: exactly two arms, nothing else (``--allow-modes none``); the default is always allowed."""
    access = Access.from_options("none", ["RMSNorm=kernel:fast|default", "verify,atol=1e-3"])
    assert _run(access, b"prefer")[2] == "prefer"  # the server's default
    for refused in (b"disable", b"RMSNorm=disable", b"verify", b"RMSNorm=kernel:fast"):
        status, error, _ = _run(access, refused)
        assert status == 403 and error is not None
        assert error["message"].endswith(
            "allowed: no mode by itself; the policies 'prefer' (the default), 'prefer,RMSNorm=kernel:fast|default', "
            "'verify,atol=0.001'"
        )
    assert _run(access, b" verify , atol=0.001")[2] == "verify,atol=0.001"  # compared as values
    with_verify = Access.from_options("prefer,disable,verify", [])
    assert with_verify.refusal(kp.Policy.parse("RMSNorm=verify"), kp.Policy()) is None
    assert with_verify.refusal(kp.Policy.parse("verify,on_mismatch=warn"), kp.Policy()) is not None  # an option


#: The 403's message under the default rules, word for word: each allowed mode and policy named once.
REFUSED_VERIFY = (
    "policy 'verify' (header X-Kernel-Policy) is not allowed on this server; allowed: modes 'prefer', 'disable' for "
    "the default and any layer (no variants, no options); the policies 'prefer' (the default)"
)


def test_the_refusal_names_each_allowed_mode_and_policy_once() -> None:
    """The server's default listed again (``--allow-policy prefer``, or a text equal to it), a mode given twice: the
    403 names each once (was: ``'prefer' (the default), 'prefer'``)."""
    for policies in (["prefer"], ["prefer", " prefer ", "prefer,RMSNorm=prefer"]):
        access = Access.from_options("prefer,disable,prefer", policies)
        status, error, _ = _run(access, b"verify")
        assert status == 403 and error is not None and error["message"] == REFUSED_VERIFY, policies
    status, error, _ = _run(Access.from_options(None, ["disable,RMSNorm=verify", "prefer"]), b"verify")
    assert status == 403 and error is not None
    assert error["message"].endswith("the policies 'prefer' (the default), 'disable,RMSNorm=verify'")


def test_the_header_can_be_ignored() -> None:
    access = Access.from_options(None, [], ignore_header=True)
    assert _run(access, b"verify")[2] == "prefer"
    assert _run(access, b"\xff" * 5000)[2] == "prefer"


def test_header_values_are_bounded() -> None:
    access = Access.from_options("prefer,disable", ["RMSNorm=kernel:a|b|c|d"])
    many = ",".join(f"L{i}=disable" for i in range(MAX_ENTRIES + 1)).encode()
    status, error, _ = _run(access, many)
    assert status == 400 and error is not None and f"at most {MAX_ENTRIES} are taken" in error["message"]
    assert _run(access, b"RMSNorm=kernel:a|b|c|d")[2] == "prefer,RMSNorm=kernel:a|b|c|d"
    status, error, _ = _run(access, b"RMSNorm=kernel:a|b|c|d|e")
    assert status == 400 and error is not None
    assert f"names 5 variants for layer 'RMSNorm'; at most {MAX_VARIANTS} are taken" in error["message"]


def test_metrics_labels_come_from_the_operators_set_only() -> None:
    access = Access.from_options(None, ["RMSNorm=kernel:fast"])
    default = kp.Policy()
    labels = {access.label(kp.Policy.parse(text), default) for text in ("prefer", "disable", "A=disable", "B=disable")}
    assert labels == {"prefer", "disable", OTHER}
    assert access.label(kp.Policy.parse("RMSNorm=kernel:fast"), default) == "prefer,RMSNorm=kernel:fast"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--allow-modes", "prefer,sometimes"], "--allow-modes 'prefer,sometimes': unknown mode 'sometimes'"),
        (["--allow-policy", "RMSNorm=often"], "--allow-policy='RMSNorm=often': unknown kernel policy mode 'often'"),
        (["--allow-modes=prefer", "--allow-modes=disable"], "--allow-modes given 2 times"),
    ],
)
def test_bad_access_options_are_refused_naming_them(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelpolicy import serving

    assert serving.main(["some-model", *options]) == 2
    assert message in capsys.readouterr().err


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=2 * MAX_HEADER),
        st.text(max_size=300).map(lambda text: text.encode("utf-8", "surrogatepass")),
        st.lists(st.sampled_from(["prefer", "disable", "verify", "RMSNorm=", "kernel:", "a|b", ",", "=", " "]))
        .map("".join)
        .map(str.encode),
    )
)
def test_fuzzed_header_values_get_an_answer_never_an_exception(value: bytes) -> None:
    """Arbitrary bytes and Unicode: the request runs under a policy the operator allows, or gets a 400 or 403."""
    access = Access()
    status, error, ran = _run(access, value)
    if status is None:
        assert ran is not None and access.refusal(kp.Policy.parse(ran), kp.Policy()) is None
    else:
        assert status in (400, 403) and error is not None and error["param"] == HEADER


def test_every_reference_to_the_spawned_processes_entry_point_leads_to_kernelpolicys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--api-server-count N``: a spawned process's target is pickled by name, so transformers' references to
    ``run_until_parent_exits`` (its module's, the engine client's module's) all become kernelpolicy's."""
    pytest.importorskip("fastapi")
    import pickle

    from kernelpolicy import serving

    utils = _compat.lookup(_compat.SERVING_API.names[0].rpartition(".")[0])
    manager = _compat.lookup(_compat.SERVING_SEND.names[0].rsplit(".", 2)[0])
    for module in (utils, manager):
        monkeypatch.setattr(module, "run_until_parent_exits", module.run_until_parent_exits)
    serving._install_api_servers()
    for module in (utils, manager):
        assert module.run_until_parent_exits is serving.run_spawned
        assert pickle.loads(pickle.dumps(module.run_until_parent_exits)) is serving.run_spawned


# --- the real server ----------------------------------------------------------------------------------


def test_wait_for_health_returns_on_a_200_and_says_why_it_stopped_waiting(tmp_path: Any) -> None:
    """``kernelpolicy.testing.wait_for_health`` on real processes: a static HTTP server whose folder has a ``health``
    file (200: it returns), the same without it (404s until the timeout), a process that exits (its status and
    the log's tail), and a timeout that is not a number of seconds above 0."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "health").write_text("ok")
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", "site"]
    server = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, server, 60)
        (tmp_path / "site" / "health").unlink()
        with pytest.raises(
            RuntimeError, match=re.escape(f"the server at {url} (GET /health) did not answer within 1 s")
        ):
            wait_for_health(url, server, 1)
        assert server.poll() is None  # left running: the caller stops it
        with pytest.raises(ValueError, match="timeout_s takes a number of seconds above 0, got 0"):
            wait_for_health(url, server, 0)
    finally:
        server.terminate()
        server.wait(30)
    log = tmp_path / "server.log"
    log.write_text("x" * 5000 + "the model did not load")
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"exited with status 3:\nx{2978}the model did not load$"):
        wait_for_health(url, failed, 60, log=log)


needs_serve = pytest.mark.skipif(
    not all(
        _compat.first_present(seam) for seam in (_compat.SERVING_BUILD, _compat.SERVING_SEND, *_compat.SERVING_RUNNERS)
    ),
    reason="this transformers has not the serve seams of 5.25 (or not its serving extra)",
)


@contextlib.contextmanager
def _server(root: Any, folder: Any, repo: Any, *options: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``python -m kernelpolicy serve`` on 127.0.0.1 (continuous batching, ``--kernel RMSNorm=repo``); its URL."""
    with _started(root, folder, repo, *options, env=env) as (_, url):
        yield url


def _hangup_by_default() -> None:
    """SIGHUP's default action in the server's process, as a terminal session starts it: a test run under ``nohup``
    ignores SIGHUP, which the server would inherit (and rightly keep: the command handles only a default SIGHUP)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@contextlib.contextmanager
def _started(
    root: Any, folder: Any, repo: Any, *options: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """:func:`_server`'s command, its process and URL; what is left of its process group is stopped after."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", **(env or {})}
    command = [sys.executable, "-m", "kernelpolicy", "serve", str(folder), "--continuous-batching"]
    command += ["--cb-num-blocks", "64", "--cb-max-batch-tokens", "512", "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--kernel", f"RMSNorm={repo}", *options]
    log_path = root / f"server-{port}.log"
    log = log_path.open("w")
    server = subprocess.Popen(
        command,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_hangup_by_default,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for_health(url, server, log=log_path)
        except RuntimeError as error:
            pytest.fail(str(error))
        yield server, url
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already: it failed to start
            os.killpg(server.pid, signal.SIGTERM)  # the server and the processes it spawned, nothing else
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()


@pytest.fixture(scope="module")
def model_and_kernel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any, Any]:
    """A saved tiny Llama, its RMSNorm kernel (adds 0.5), the folder, and the solo reference model."""
    pytest.importorskip("fastapi")
    import transformers

    from kernelpolicy.testing import local_mapping, rms_norm_kernel_source, save_tiny_llama, write_kernel_repo

    root = tmp_path_factory.mktemp("serve")
    folder = save_tiny_llama(root / "model")
    repo = write_kernel_repo(root / "repo", rms_norm_kernel_source(offset=0.5, can_torch_compile=True))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with local_mapping({"RMSNorm": repo}):
        kp.kernelize(reference, mode="inference", device="cpu")
    return root, folder, repo, reference


@pytest.fixture(scope="module")
def served(model_and_kernel: tuple[Any, Any, Any, Any]) -> Iterator[tuple[str, str, Any]]:
    """The server (continuous batching, the default options), its base URL, the model folder, the solo reference."""
    root, folder, repo, reference = model_and_kernel
    with _server(root, folder, repo) as url:
        yield url, str(folder), reference


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


@pytest.mark.slow
@needs_serve
def test_allowing_the_default_again_names_it_once_in_the_403_and_the_start_up_line(
    model_and_kernel: tuple[Any, Any, Any, Any], tmp_path: Any
) -> None:
    """``--allow-policy prefer`` on a server whose default is ``prefer``: the 403 and the line the server prints when
    it starts name ``'prefer'`` once (was: twice). Then SIGTERM stops it (:func:`_stop`: exit status -SIGTERM)."""
    root, folder, repo, reference = model_and_kernel
    temp, env = _stopping_env(tmp_path)
    with _started(root, folder, repo, "--allow-policy", "prefer", env=env) as (server, url):
        status, body = chat(url, str(folder), PROMPTS[1], "verify")
        assert status == 403 and body["error"]["message"] == REFUSED_VERIFY, body
        status, body = chat(url, str(folder), PROMPTS[1], "prefer")
        assert status == 200 and ids(body["choices"][0]["message"]["content"]) == solo(reference, "prefer", PROMPTS[1])
        log = (root / f"server-{url.rpartition(':')[2]}.log").read_text()
        _stop(server, temp, signal.SIGTERM, -signal.SIGTERM)
    assert f"kernelpolicy serve: {REFUSED_VERIFY.partition('; ')[2]}\n" in log, log[:2000]


@pytest.mark.slow
@needs_serve
def test_a_refused_policy_is_403_naming_the_allowed_set_and_the_server_keeps_serving(
    served: tuple[str, str, Any],
) -> None:
    url, model, reference = served
    for refused in ("verify", "RMSNorm=require", "RMSNorm=kernel:fast", "prefer,max_failures=1"):
        status, body = chat(url, model, PROMPTS[1], refused)
        assert status == 403 and body["error"]["code"] == "policy_not_allowed", body
        assert "allowed: modes 'prefer', 'disable' for the default and any layer" in body["error"]["message"]
    status, body = chat(url, model, PROMPTS[1], "RMSNorm=disable")
    assert status == 200 and ids(body["choices"][0]["message"]["content"]) == solo(reference, "disable", PROMPTS[1])


def _raw_status(url: str, model: str, value: bytes) -> int:
    """The status of one chat request whose header value is ``value`` byte for byte (a raw HTTP/1.1 socket)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 1}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        + HEADER.encode()
        + b": "
        + value
        + b"\r\n\r\n"
        + body
    )
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(request)
        answer = b""
        while b"\r\n" not in answer:
            chunk = connection.recv(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 400  # closed: refused by uvicorn


@pytest.mark.slow
@needs_serve
def test_fuzzed_headers_on_the_real_server_never_get_a_500(served: tuple[str, str, Any]) -> None:
    url, model, _ = served
    statuses: list[int] = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        st.one_of(
            st.binary(min_size=1, max_size=1500).filter(lambda v: b"\r" not in v and b"\n" not in v),
            st.text(min_size=1, max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
            st.sampled_from([b"disable", b"verify", b"RMSNorm=disable", b"prefer,,", b"kernel:a|b"]),
        ).filter(lambda v: b"\r" not in v and b"\n" not in v)
    )
    def one(value: bytes) -> None:
        status = _raw_status(url, model, value)
        statuses.append(status)
        assert status < 500, value

    one()
    assert 200 in statuses and (400 in statuses or 403 in statuses)
    assert chat(url, model, PROMPTS[0], "disable")[0] == 200


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_models_process_counts_calls_fallbacks_trips_and_kernel_errors(tmp_path: Any) -> None:
    """The recorder the model's process runs every request under, on a real local kernel that raises on a batch
    of 3 (this process's own registry: the server's processes share theirs through files)."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY, generate_latest
    from torch import nn

    from kernelpolicy._context._scope import _recording_scope
    from kernelpolicy.serving import _metrics
    from kernelpolicy.testing import RMSNorm, kernelize_locally, write_kernel_repo

    source = "import torch\nfrom torch import nn\n\n\nclass RMSNorm(nn.Module):\n    def forward(self, x):\n"
    source += "        if x.shape[0] == 3:\n            raise RuntimeError('a batch of 3')\n        return x + 100.0\n"
    repo = write_kernel_repo(tmp_path / "failing", source, name="failing-rmsnorm")
    model = kernelize_locally(nn.Sequential(RMSNorm(8)).eval(), {"RMSNorm": repo})
    from kernelpolicy._forward._failures import ON_STOPPED
    from kernelpolicy._forward._verify import COMPARED

    hooks = (list(ON_STOPPED), list(COMPARED))
    _metrics.install_engine()
    before = _samples(generate_latest(REGISTRY).decode())
    with contextlib.ExitStack() as restore, _recording_scope(None, recording=True, recorders=(_metrics.CALLS,)):
        restore.callback(
            lambda: (ON_STOPPED.__setitem__(slice(None), hooks[0]), COMPARED.__setitem__(slice(None), hooks[1]))
        )
        model(torch.ones(2, 8))
        with kp.kernel_policy("prefer", fallback_on=RuntimeError, max_failures=2):
            model(torch.ones(3, 8))  # falls back
            model(torch.ones(3, 8))  # falls back, and trips
            model(torch.ones(2, 8))  # stopped: the original
        with kp.kernel_policy("require"), pytest.raises(RuntimeError):
            model(torch.ones(3, 8))  # stopped, and require wants the kernel
        kp.reset_failures(model)
        with pytest.raises(RuntimeError, match="a batch of 3"):
            model(torch.ones(3, 8))  # a kernel failure, not caught
    after = _samples(generate_latest(REGISTRY).decode())

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kernelpolicy_kernel_calls_total", layer="RMSNorm", path="kernel") == 2  # the last raised
    assert delta("kernelpolicy_kernel_calls_total", layer="RMSNorm", path="original") == 3
    assert delta("kernelpolicy_kernel_calls_total", layer="RMSNorm", path="error") == 1
    assert delta("kernelpolicy_kernel_fallbacks_total", layer="RMSNorm") == 2
    assert delta("kernelpolicy_kernel_trips_total", layer="RMSNorm") == 1
    assert delta("kernelpolicy_serve_errors_total", kind="kernel_unavailable") == 1
    assert delta("kernelpolicy_serve_errors_total", kind="kernel_failure") == 1


@pytest.mark.slow
@needs_serve
def test_metrics_count_requests_tokens_errors_and_kernel_calls_by_policy(served: tuple[str, str, Any]) -> None:
    import httpx

    url, model, _ = served

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        response = httpx.get(f"{url}/metrics", timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return _samples(response.text)

    before = scrape()
    assert chat(url, model, PROMPTS[2], None)[0] == 200  # the default: prefer
    assert chat(url, model, PROMPTS[2], "disable", stream=True)[0] == 200
    assert chat(url, model, PROMPTS[2], "RMSNorm=disable")[0] == 200  # allowed, not named by the operator: other
    assert chat(url, model, PROMPTS[2], "bogus")[0] == 400
    assert chat(url, model, PROMPTS[2], "verify")[0] == 403
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for policy in ("prefer", "disable", "other"):
        assert delta("kernelpolicy_serve_requests_total", policy=policy) == 1, policy
        assert delta("kernelpolicy_serve_generated_tokens_total", policy=policy) == TOKENS, policy
        assert delta("kernelpolicy_serve_tokens_per_second_count", policy=policy) == 1, policy
    assert delta("kernelpolicy_serve_time_to_first_token_seconds_count", policy="disable") == 1  # streamed
    assert delta("kernelpolicy_serve_errors_total", kind="bad_header") == 1
    assert delta("kernelpolicy_serve_errors_total", kind="refused_policy") == 1
    # the model's process: the prefer request ran its RMSNorm kernels, the two others the original forward
    assert delta("kernelpolicy_kernel_calls_total", layer="RMSNorm", path="kernel") > 0
    assert delta("kernelpolicy_kernel_calls_total", layer="RMSNorm", path="original") > 0
    assert not any(name.startswith("kernelpolicy") and "verify" in str(labels) for name, labels in after)


@pytest.mark.slow
@needs_serve
def test_no_metrics_serves_without_counting(model_and_kernel: tuple[Any, Any, Any, Any], tmp_path: Any) -> None:
    """``--no-metrics``: no ``GET /metrics`` (404), no metrics folder made, no recording of kernel calls; requests
    still get their policy's tokens and a bad header its 400 (was: the option went to transformers serve, which
    refused it)."""
    import httpx

    root, folder, repo, reference = model_and_kernel
    temp, env = _stopping_env(tmp_path)
    with _server(root, folder, repo, "--no-metrics", env=env) as url:
        for policy in (None, "RMSNorm=disable"):
            status, body = chat(url, str(folder), PROMPTS[1], policy)
            assert status == 200 and ids(body["choices"][0]["message"]["content"]) == solo(
                reference, policy or "prefer", PROMPTS[1]
            )
        assert chat(url, str(folder), PROMPTS[1], "bogus")[0] == 400
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 404
        assert not [path.name for path in temp.iterdir() if path.name.startswith("kernelpolicy-metrics-")]


@pytest.mark.slow
@needs_serve
def test_metrics_count_the_fallbacks_and_the_trip_of_a_kernel_that_raises_on_the_real_server(
    model_and_kernel: tuple[Any, Any, Any, Any],
) -> None:
    """A kernel that raises on the marker token, served with ``--allow-policy
    prefer,fallback_on=RuntimeError,max_failures=2``: each marker request under that policy falls back (the original
    runs, the client gets its tokens), the second trips the kernel of the first layer's input norm, which then runs
    the original for every policy, the default's too; a third is not tried. ``/metrics`` counts 2 fallbacks and 1
    trip, labelled by layer, the 3 requests under the operator's policy, and no kernel failure (all were caught)."""
    import httpx
    import transformers

    from kernelpolicy.testing import local_mapping, write_kernel_repo

    root, folder, _, _ = model_and_kernel
    tripping = "prefer,fallback_on=RuntimeError,max_failures=2"
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    row = reference.model.embed_tokens.weight[MARKER, :4].tolist()
    repo = write_kernel_repo(root / "marker-repo", marker_kernel_source(row), name="marker-rmsnorm")
    with local_mapping({"RMSNorm": repo}):
        kp.kernelize(reference, mode="inference", device="cpu")
    prompts = [*MARKED, MARKED[0]]
    expected = [solo(reference, tripping, prompt) for prompt in prompts]  # the same falls, and trip, in this process
    stopped = solo(reference, "prefer", PROMPTS[0])  # the first layer's input norm: the original
    kp.reset_failures(reference)
    assert stopped != solo(reference, "prefer", PROMPTS[0])  # the trip shows in the default's tokens
    assert not any(MARKER in tokens for tokens in expected)  # one failure per marker request: its prompt's step

    def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _samples(httpx.get(f"{url}/metrics", timeout=30).text)

    counts = []
    with _server(root, folder, repo, "--allow-policy", tripping) as url:
        for prompt, tokens in zip(prompts, expected, strict=True):
            status, body = chat(url, str(folder), prompt, tripping)
            assert status == 200 and ids(body["choices"][0]["message"]["content"]) == tokens, body
            counts.append(scrape(url))
        status, body = chat(url, str(folder), PROMPTS[0], None)
        assert status == 200 and ids(body["choices"][0]["message"]["content"]) == stopped
        last = scrape(url)

    def series(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> dict[Any, float]:
        return {labels: value for (sample, labels), value in samples.items() if sample == name}

    layer = (("layer", "RMSNorm"),)
    fallbacks, trips = "kernelpolicy_kernel_fallbacks_total", "kernelpolicy_kernel_trips_total"
    assert [series(c, fallbacks) for c in counts] == [{layer: 1.0}, {layer: 2.0}, {layer: 2.0}]
    assert [series(c, trips) for c in counts] == [{}, {layer: 1.0}, {layer: 1.0}]
    assert series(last, fallbacks) == {layer: 2.0} and series(last, trips) == {layer: 1.0}
    requests = series(last, "kernelpolicy_serve_requests_total")
    assert requests == {(("policy", tripping),): 3.0, (("policy", "prefer"),): 1.0}, requests
    assert series(last, "kernelpolicy_serve_errors_total") == {}  # the kernel's errors were caught: no failure


@pytest.mark.slow
@needs_serve
def test_the_canary_verifies_sampled_requests_and_the_client_gets_the_kernels_answer(
    model_and_kernel: tuple[Any, Any, Any, Any], tmp_path: Any
) -> None:
    """``--verify-sample 1``: every request that would run a kernel runs as verify; the kernel (adds 0.5) mismatches,
    which is logged and counted, and the client gets the kernel's tokens. ``disable`` requests are not sampled. Then
    SIGINT stops it (:func:`_stop`)."""
    import httpx

    root, folder, repo, reference = model_and_kernel
    temp, env = _stopping_env(tmp_path)
    with _started(root, folder, repo, "--verify-sample", "1", env=env) as (server, url):
        for policy in (None, "disable"):
            status, body = chat(url, str(folder), PROMPTS[0], policy)
            assert status == 200 and ids(body["choices"][0]["message"]["content"]) == solo(
                reference, policy or "prefer", PROMPTS[0]
            )
        samples = _samples(httpx.get(f"{url}/metrics", timeout=30).text)
        _stop(server, temp, signal.SIGINT, None)
    assert samples[("kernelpolicy_canary_requests_total", (("policy", "prefer"),))] == 1
    assert ("kernelpolicy_canary_requests_total", (("policy", "disable"),)) not in samples
    calls = samples[("kernelpolicy_verify_calls_total", (("layer", "RMSNorm"),))]
    assert calls > 0 and samples[("kernelpolicy_verify_mismatches_total", (("layer", "RMSNorm"),))] == calls
    assert samples[("kernelpolicy_verify_max_abs_error", (("layer", "RMSNorm"),))] == pytest.approx(0.5, abs=1e-3)
    log = "".join(path.read_text() for path in root.glob("server-*.log"))
    assert "verify: kernel layer 'RMSNorm' at 'model.layers.0.input_layernorm' differs from its reference" in log


def test_the_canary_policy_verifies_what_would_run_a_kernel() -> None:
    from kernelpolicy.serving import canary

    assert canary(kp.Policy.parse("prefer,SiLU=require,RMSNorm=disable"), fail=True) == kp.Policy(
        "verify", RMSNorm="disable", on_mismatch="raise"
    )
    assert canary(kp.Policy.parse("prefer,RMSNorm=kernel:fast"), fail=False) == kp.Policy.parse(
        "verify,RMSNorm=kernel:fast,on_mismatch=warn"
    )
    assert canary(kp.Policy.parse("disable,RMSNorm=kernel:fast"), fail=False) is None
    assert canary(kp.Policy.parse("disable"), fail=False) is None
    assert canary(kp.Policy.parse("verify"), fail=False) is None


def _on_one_connection(url: str, *requests: tuple[dict[str, Any], dict[str, str]]) -> list[tuple[int, str, Any]]:
    """Each non-streaming chat request (its body, its headers) in turn on one keep-alive HTTP/1.1 connection (a raw
    socket: a client library would open another if the server closed it); each answer's status, content type and
    body (JSON, else text). A connection the server closes or resets fails the call."""
    host, port = url.removeprefix("http://").split(":")
    answers: list[tuple[int, str, Any]] = []
    with socket.create_connection((host, int(port)), timeout=120) as connection:
        for body, headers in requests:
            payload = json.dumps(body).encode()
            lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
            lines += [f"Content-Length: {len(payload)}", *(f"{name}: {value}" for name, value in headers.items())]
            connection.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = connection.recv(65536)
                assert chunk, f"the server closed the connection: {received!r}"
                received += chunk
            head, _, content = received.partition(b"\r\n\r\n")
            status_line, *fields = head.decode("latin-1").split("\r\n")
            found = {name.lower(): value.strip() for name, _, value in (f.partition(":") for f in fields)}
            assert found.get("connection", "").lower() != "close", head
            while len(content) < int(found["content-length"]):
                chunk = connection.recv(65536)
                assert chunk, f"the server closed the connection: {head!r}"
                content += chunk
            kind = found.get("content-type", "")
            answers.append((int(status_line.split()[1]), kind, json.loads(content) if "json" in kind else content))
    return answers


@pytest.mark.slow
@needs_serve
def test_a_kernel_that_raises_fails_its_request_and_the_server_keeps_serving(
    model_and_kernel: tuple[Any, Any, Any, Any],
) -> None:
    """A kernel that raises on the marker token, under ``prefer`` (no ``fallback_on``): the marked request gets a
    500 naming the kernel's error, and the requests after it their tokens (was: a plain RuntimeError in a step of
    one policy stopped the batching manager, and every later request failed)."""
    import transformers

    from kernelpolicy.testing import local_mapping, write_kernel_repo

    root, folder, _, _ = model_and_kernel
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    row = reference.model.embed_tokens.weight[MARKER, :4].tolist()
    repo = write_kernel_repo(root / "raising-repo", marker_kernel_source(row), name="raising-rmsnorm")
    with local_mapping({"RMSNorm": repo}):
        kp.kernelize(reference, mode="inference", device="cpu")
    with _server(root, folder, repo) as url:
        failed = chat(url, str(folder), MARKED[0], None)
        after = [
            chat(url, str(folder), prompt, policy) for prompt, policy in ((PROMPTS[0], None), (PROMPTS[1], "disable"))
        ]
    status, body = failed
    assert status == 500 and body["error"]["code"] == "request_failed", failed
    assert [status for status, _ in after] == [200, 200], after
    got = [ids(body["choices"][0]["message"]["content"]) for _, body in after]
    assert got == [solo(reference, "prefer", PROMPTS[0]), solo(reference, "disable", PROMPTS[1])]


@pytest.mark.slow
@needs_serve
def test_a_request_the_canary_fails_gets_a_json_500_and_the_connection_serves_the_next(
    model_and_kernel: tuple[Any, Any, Any, Any], tmp_path: Any
) -> None:
    """``--verify-sample 1 --verify-fail``, not streaming: the mismatch fails the request with an error in OpenAI's
    shape (was: a bare text/plain "Internal Server Error", "Exception in ASGI application" logged, the keep-alive
    connection reset); the next request on the same connection gets its answer. Then SIGHUP stops it
    (:func:`_stop`: exit status -SIGHUP)."""
    root, folder, repo, reference = model_and_kernel
    model = str(folder)
    temp, env = _stopping_env(tmp_path)

    def body(prompt: list[int]) -> dict[str, Any]:
        messages = [{"role": "user", "content": words(prompt)}]
        return {"model": model, "messages": messages, "max_tokens": TOKENS, "temperature": 0}

    with _started(root, folder, repo, "--verify-sample", "1", "--verify-fail", env=env) as (server, url):
        failed, served = _on_one_connection(url, (body(PROMPTS[0]), {}), (body(PROMPTS[1]), {HEADER: "disable"}))
        log = root / f"server-{url.rpartition(':')[2]}.log"
        _stop(server, temp, signal.SIGHUP, -signal.SIGHUP)
    status, kind, error = failed
    assert (status, kind) == (500, "application/json"), failed
    assert set(error) == {"error"} and error["error"]["type"] == "server_error", error
    assert error["error"]["code"] == "request_failed" and error["error"]["param"] is None, error
    message = error["error"]["message"]
    assert "kernel output differs from the original forward for module 'model.layers.0.input_layernorm'" in message
    status, kind, answer = served  # disable: not sampled
    assert status == 200 and ids(answer["choices"][0]["message"]["content"]) == solo(reference, "disable", PROMPTS[1])
    assert "Exception in ASGI application" not in log.read_text()


def _stopping_env(tmp_path: Any) -> tuple[Any, dict[str, str]]:
    """A temp directory of its own for the server, in which the command makes its metrics folder (none given), and
    the server's environment (torch's cache goes elsewhere), for :func:`_stop`."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {"TMPDIR": str(temp), "PROMETHEUS_MULTIPROC_DIR": "", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    return temp, env


def _stop(server: subprocess.Popen[bytes], temp: Any, stop: signal.Signals, status: int | None) -> None:
    """Stopping the command leaves no metrics folder and no process: a signal to the command's own process (SIGTERM:
    what Docker and Kubernetes send; SIGINT: Ctrl+C; SIGHUP: its terminal closed), with one API server or two, makes
    it stop the processes it spawned and remove the metrics folder it made in the temp directory (was: SIGTERM and
    SIGHUP left a ``kernelpolicy-metrics-*`` folder behind, one per start); its exit status is the one the signal gave
    before (``status``; None: not checked). Each case ends the life of a server another test started with
    :func:`_stopping_env` (SIGTERM, SIGINT, SIGHUP with one API server, SIGTERM with two), not a start of its own."""
    made = [path.name for path in temp.iterdir()]
    assert len(made) == 1 and made[0].startswith("kernelpolicy-metrics-"), made
    assert any((temp / made[0]).iterdir())  # the counts of the requests, in files
    server.send_signal(stop)  # to the command's process only, as a process manager sends it
    code = server.wait(120)
    deadline = time.monotonic() + 30  # the processes it spawned (the model's, the API servers) exit with it
    while _alive(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(server.pid), "a process the command spawned outlived it"
    assert list(temp.iterdir()) == []
    assert status is None or code == status, (stop, code)


def _alive(group: int) -> bool:
    """Whether a process of process group ``group`` (a server started in a session of its own) is still running."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_bad_verify_sample_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from kernelpolicy import serving

    assert serving.main(["some-model", "--verify-sample", "10%"]) == 2
    assert "--verify-sample takes a fraction from 0 to 1" in capsys.readouterr().err


def _by_process(folder: Any, name: str) -> dict[str, float]:
    """Each process's own total of the counter ``name`` (its sum over labels), from the multiprocess folder's files
    (``counter_PID.db``: one per process that counted)."""
    import shutil
    import tempfile

    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    totals: dict[str, float] = {}
    for path in sorted(folder.glob("counter_*.db")):
        with tempfile.TemporaryDirectory() as alone:
            shutil.copy(path, alone)
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=alone)
            samples = _samples(generate_latest(registry).decode())
        total = sum(value for (sample, _), value in samples.items() if sample == name)
        if total:
            totals[path.stem.removeprefix("counter_")] = total
    return totals


@pytest.mark.slow
@needs_serve
def test_two_api_servers_each_read_the_header_and_the_metrics_count_both(
    model_and_kernel: tuple[Any, Any, Any, Any], tmp_path: Any
) -> None:
    """``--api-server-count 2``: concurrent requests in two policies, spread by the kernel over the two API server
    processes (one socket), each get their prompt's solo tokens under their policy; a refused policy gets its 403
    from both; ``/metrics``, answered by either, counts the requests of both (the sum of every process's files, in
    the metrics folder the command made). Then SIGTERM stops it (:func:`_stop`: transformers' supervisor exits with
    0 on SIGTERM)."""
    import httpx

    if _compat.first_present(_compat.SERVING_API) is None:
        pytest.skip("this transformers serve has not the API servers' entry point of 5.25")
    root, folder, repo, reference = model_and_kernel
    model = str(folder)
    temp, env = _stopping_env(tmp_path)
    jobs = [(prompt, policy) for prompt in PROMPTS for policy in ("prefer", "RMSNorm=disable")]
    expected = [solo(reference, policy, prompt) for prompt, policy in jobs]
    assert expected[0] != expected[1]  # the two policies take different paths
    with _started(root, folder, repo, "--api-server-count", "2", env=env) as (server, url):
        [counts] = temp.glob("kernelpolicy-metrics-*")
        sent = 0
        for _ in range(3):  # which process accepts a connection is the kernel's choice: until both served
            with ThreadPoolExecutor(len(jobs)) as pool:
                answers = list(pool.map(lambda job: chat(url, model, job[0], job[1], stream=True), jobs))
            sent += len(jobs)
            assert [status for status, _ in answers] == [200] * len(jobs)
            assert [ids(text) for _, text in answers] == expected
            if len(_by_process(counts, "kernelpolicy_serve_requests_total")) == 2:
                break
        refused = 0
        for _ in range(5):
            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda _: chat(url, model, PROMPTS[1], "verify"), range(16)))
            refused += len(answers)
            assert all(status == 403 for status, _ in answers)
            assert all(body["error"]["code"] == "policy_not_allowed" for _, body in answers)
            if len(_by_process(counts, "kernelpolicy_serve_errors_total")) == 2:
                break
        with ThreadPoolExecutor(8) as pool:  # the scrapes land on either API server: each shows the sum
            scrapes = list(pool.map(lambda _: _samples(httpx.get(f"{url}/metrics", timeout=30).text), range(8)))
        requests = _by_process(counts, "kernelpolicy_serve_requests_total")
        errors = _by_process(counts, "kernelpolicy_serve_errors_total")
        calls = _by_process(counts, "kernelpolicy_kernel_calls_total")
        _stop(server, temp, signal.SIGTERM, 0)
    assert len(requests) == 2 and sum(requests.values()) == sent, requests  # two API servers counted requests
    assert set(errors) == set(requests) and sum(errors.values()) == refused, errors  # each refused some
    assert len(calls) == 1 and not set(calls) & set(requests), calls  # the model's process, a third
    for samples in scrapes:
        assert samples[("kernelpolicy_serve_requests_total", (("policy", "prefer"),))] == sent / 2
        assert samples[("kernelpolicy_serve_requests_total", (("policy", "other"),))] == sent / 2
        assert samples[("kernelpolicy_serve_generated_tokens_total", (("policy", "prefer"),))] == TOKENS * sent / 2
        assert samples[("kernelpolicy_serve_errors_total", (("kind", "refused_policy"),))] == refused
        assert samples[("kernelpolicy_kernel_calls_total", (("layer", "RMSNorm"), ("path", "kernel")))] > 0
        assert samples[("kernelpolicy_kernel_calls_total", (("layer", "RMSNorm"), ("path", "original")))] > 0

"""``vllm serve`` with kernelpolicy on (kernelpolicy/vllm/_server.py): a request's policy from the X-Kernel-Policy
header or the body's vllm_xargs, the operator's rules, 400s naming the value, a prefix-cache salt per policy, and
the counts per policy in vLLM's /metrics, with two API servers. One real server for the module (no mocks); the
server with the switch off is tests/test_vllm_serve_off.py's.

The server's ``rms_norm`` runs the test kernel (``kp_test``: the native norm plus 0.5) unless a request's policy
says ``rms_norm=disable``: the tokens and log-probs of a request show which path its rows took in the worker.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("vllm")

from _vllm_serve import environment, get, post, save_model, served

from kernelpolicy.serving import HEADER
from kernelpolicy.vllm._admission import SALT_PREFIX, policy_salt
from kernelpolicy.vllm._server import ALLOW_MODES_VAR, ALLOW_POLICY_VAR, ServerRules

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: The operator's rules of the module's server: a client may turn ops off, and choose one listed policy more.
RULES = {ALLOW_MODES_VAR: "disable", ALLOW_POLICY_VAR: "silu_and_mul=prefer"}
PROMPT = "w5 w6 w7 w8"
#: A prompt of many KV blocks (the prefix cache shares whole blocks).
LONG = " ".join(f"w{(7 * i) % 250 + 1}" for i in range(200))


class Server:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def complete(self, headers: dict[str, str] | None = None, **body: Any) -> tuple[int, Any]:
        request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1} | body
        return post(self.url, "/v1/completions", request, headers)

    def answer(self, headers: dict[str, str] | None = None, **body: Any) -> tuple[list[str], list[float]]:
        """The tokens and log-probs of a completion that must succeed."""
        status, found = self.complete(headers, **body)
        assert status == 200, found
        logprobs = found["choices"][0]["logprobs"]
        return logprobs["tokens"], logprobs["token_logprobs"]

    def logged_params(self, seed: int) -> str:
        """The SamplingParams vLLM logged for the request of ``seed`` (a marker: greedy requests ignore it)."""
        found = [line for line in self.log.read_text(errors="replace").splitlines() if f"seed={seed}," in line]
        assert len(found) == 1, found
        return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("vllm-serve")
    model = save_model(folder / "model")
    kernel = '{"ir_op_priority": {"rms_norm": ["kp_test", "native"]}}'
    env = {"KERNELPOLICY_VLLM": "1", "KERNELPOLICY_VLLM_IMPORT": "_vllm_provider"} | RULES
    with served(model, folder / "serve.log", env, "--served-model-name", "tiny", "--kernel-config", kernel,
                "--api-server-count", "2") as url:  # fmt: skip
        yield Server(url, folder / "serve.log")


def error_of(answer: tuple[int, Any]) -> str:
    status, found = answer
    assert status == 400, found
    assert found["error"]["type"] == "BadRequestError" and found["error"]["code"] == 400
    message: str = found["error"]["message"]
    return message


def test_the_header_and_vllm_xargs_reach_extra_args_and_the_worker(server: Server) -> None:
    vllms = server.answer(seed=101)  # no policy: vLLM's own choice, the test kernel
    header = server.answer({HEADER: "rms_norm=disable"}, seed=102)
    body = server.answer(vllm_xargs={"kernel_policy": "rms_norm=disable"}, seed=103)
    entries = server.answer(vllm_xargs={"kernel_policy": {"rms_norm": "disable"}, "other": 1}, seed=104)
    both = server.answer({HEADER: "rms_norm=disable"}, vllm_xargs={"kernel_policy": "rms_norm=disable"}, seed=105)
    assert header == body == entries == both
    assert header[1] != vllms[1]  # the original norm ran on this request's rows
    assert "extra_args=None" in server.logged_params(101)
    for seed in (102, 103, 105):
        assert "extra_args={'kernel_policy': 'rms_norm=disable'}" in server.logged_params(seed)
    assert "extra_args={'kernel_policy': 'rms_norm=disable', 'other': 1}" in server.logged_params(104)
    # chat completions and responses read the header too
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "seed": 106}
    status, found = post(server.url, "/v1/chat/completions", chat, {HEADER: "disable"})
    assert status == 200, found
    assert "extra_args={'kernel_policy': 'disable'}" in server.logged_params(106)
    status, found = post(server.url, "/v1/chat/completions", chat | {"seed": 107}, {HEADER: "prefer"})
    assert "'prefer' is not allowed" in error_of((status, found))
    batch = chat | {"messages": [chat["messages"], chat["messages"]], "seed": 108}
    status, found = post(server.url, "/v1/chat/completions/batch", batch, {HEADER: "disable"})
    assert status == 200, found
    logged = [line for line in server.log.read_text(errors="replace").splitlines() if "seed=108," in line]
    assert len(logged) == 2 and all("extra_args={'kernel_policy': 'disable'}" in line for line in logged)
    responses = {"model": "tiny", "input": PROMPT, "max_output_tokens": 2, "temperature": 0}
    status, found = post(server.url, "/v1/responses", responses, {HEADER: "silu_and_mul=prefer"})
    assert status == 200, found
    status, found = post(server.url, "/v1/responses", responses, {HEADER: "rms_norm=bogus"})
    assert "'bogus'" in error_of((status, found))
    messages = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    status, found = post(server.url, "/v1/messages", messages, {HEADER: "rms_norm=disable"})
    assert status == 200, found
    status, found = post(server.url, "/v1/messages", messages, {HEADER: "prefer"})
    assert "'prefer' is not allowed" in error_of((status, found))
    logged = server.log.read_text(errors="replace")
    assert "extra_args={'kernel_policy': 'silu_and_mul=prefer'}" in logged  # responses' request


def test_bad_policies_get_a_400_naming_the_value_and_the_valid_ones(server: Server) -> None:
    mode = error_of(server.complete({HEADER: "rms_norm=bogus"}))
    assert "'bogus'" in mode and "'prefer', 'disable'" in mode and HEADER in mode
    op = error_of(server.complete(vllm_xargs={"kernel_policy": "no_such_op=disable"}))
    assert "vllm_xargs.kernel_policy='no_such_op=disable'" in op and "rms_norm" in op and "silu_and_mul" in op
    op = error_of(server.complete({HEADER: "no_such_op=disable"}))
    assert f"header {HEADER}='no_such_op=disable': vLLM has no op 'no_such_op'" in op and "rms_norm" in op
    kind = error_of(server.complete(vllm_xargs={"kernel_policy": 3}))
    assert "vllm_xargs.kernel_policy=3" in kind and "not int" in kind
    listed = error_of(server.complete(vllm_xargs={"kernel_policy": ["disable"]}))
    assert "['disable']" in listed and "not list" in listed
    assert "ASCII" in error_of(server.complete({HEADER: "rms_norm=d\xe9sable"}))  # urllib sends it as latin-1
    # the operator's rules: modes 'disable' and the policy 'silu_and_mul=prefer'
    refused = error_of(server.complete({HEADER: "rms_norm=prefer"}))
    assert "'rms_norm=prefer' is not allowed" in refused
    assert "modes 'disable'" in refused and "'silu_and_mul=prefer'" in refused and "no policy" in refused
    assert "not allowed" in error_of(server.complete(vllm_xargs={"kernel_policy": "prefer"}))
    assert server.answer({HEADER: "silu_and_mul=prefer"})  # listed
    assert server.answer({HEADER: "disable"})  # a mode allowed
    # header and body disagreeing
    conflict = error_of(server.complete({HEADER: "disable"}, vllm_xargs={"kernel_policy": "rms_norm=disable"}))
    assert f"{HEADER} 'disable'" in conflict and "'rms_norm=disable'" in conflict and "different policies" in conflict
    # the salts kernelpolicy gives are its own
    reserved = error_of(server.complete(cache_salt=SALT_PREFIX + "x"))
    assert f"'{SALT_PREFIX}x'" in reserved
    # vLLM's own checks stand: a bad salt of the client's is vLLM's 400
    assert "cache_salt" in error_of(server.complete({HEADER: "disable"}, cache_salt="a/b"))


def test_policies_never_share_prefix_cache_blocks_and_a_policy_shares_its_own(server: Server) -> None:
    def cached(headers: dict[str, str] | None = None, **body: Any) -> int:
        status, found = server.complete(headers, prompt=LONG, max_tokens=1, logprobs=None, **body)
        assert status == 200, found
        return int((found["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") or 0)

    cached()  # vLLM's own blocks of the prompt
    assert cached() > 0
    assert cached({HEADER: "rms_norm=disable"}) == 0  # another policy: its own salt, none of those blocks
    assert cached({HEADER: "rms_norm=disable"}) > 0  # the same policy shares
    assert cached(vllm_xargs={"kernel_policy": {"rms_norm": "disable"}}) > 0  # however it is spelled
    assert cached({HEADER: "disable"}) == 0
    assert cached({HEADER: "rms_norm=disable"}, cache_salt="mine") == 0  # a client's salt: combined
    assert cached({HEADER: "rms_norm=disable"}, cache_salt="mine") > 0
    assert cached(cache_salt="mine") == 0  # the client's salt alone: vLLM's own, apart from the policy's


def test_metrics_count_requests_and_tokens_per_policy_over_two_api_servers(server: Server) -> None:
    def counts() -> dict[tuple[str, str], float]:
        found: dict[tuple[str, str], float] = {}
        for line in get(server.url, "/metrics").splitlines():
            match = re.fullmatch(r'kernelpolicy_serve_(\w+)_total\{(?:policy|kind)="([^"]*)"\} (\S+)', line)
            if match:
                found[match[1], match[2]] = found.get((match[1], match[2]), 0.0) + float(match[3])
        return found

    before = counts()
    for _ in range(4):
        server.answer({HEADER: "disable"}, max_tokens=3, ignore_eos=True)
    server.answer({HEADER: "silu_and_mul=prefer"}, max_tokens=2, ignore_eos=True)
    server.answer({HEADER: "rms_norm=disable"}, max_tokens=2, ignore_eos=True)  # allowed, not named: "other"
    server.answer(max_tokens=2, ignore_eos=True)
    status, stream = server.complete({HEADER: "disable"}, max_tokens=3, ignore_eos=True, stream=True)
    assert status == 200 and "data: [DONE]" in stream
    error_of(server.complete({HEADER: "rms_norm=bogus"}))
    error_of(server.complete({HEADER: "prefer"}))
    after = counts()

    def added(name: str, label: str) -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    assert added("requests", "disable") == 5 and added("generated_tokens", "disable") == 15
    assert added("requests", "silu_and_mul=prefer") == 1 and added("generated_tokens", "silu_and_mul=prefer") == 2
    assert added("requests", "other") == 1 and added("generated_tokens", "other") == 2
    assert added("requests", "none") == 1 and added("generated_tokens", "none") == 2
    assert added("errors", "bad_header") == 1 and added("errors", "refused_policy") == 1
    assert "vllm:request_success_total" in get(server.url, "/metrics")  # vLLM's own still there


def op_rows(server: Server) -> dict[tuple[str, str], float]:
    """``kernelpolicy_vllm_op_rows_total`` by (op, path), as vLLM's ``/metrics`` sums it over the API servers."""
    found: dict[tuple[str, str], float] = {}
    for line in get(server.url, "/metrics").splitlines():
        match = re.fullmatch(r'kernelpolicy_vllm_op_rows_total\{op="([^"]*)",path="([^"]*)"\} (\S+)', line)
        if match:
            found[match[1], match[2]] = found.get((match[1], match[2]), 0.0) + float(match[3])
    return found


def test_metrics_count_each_ops_rows_per_path_over_two_api_servers(server: Server) -> None:
    before = op_rows(server)
    rows: dict[str | None, int] = {}  # each policy's token rows: prompt + generated - 1 (the last is not fed back)
    for seed, (policy, tokens) in enumerate([("disable", 3), ("silu_and_mul=prefer", 2), (None, 2), ("disable", 2)]):
        headers = None if policy is None else {HEADER: policy}
        status, found = server.complete(headers, prompt=f"w{seed + 20} w9 w3", max_tokens=tokens, ignore_eos=True)
        assert status == 200, found
        usage = found["usage"]
        rows[policy] = rows.get(policy, 0) + usage["prompt_tokens"] + usage["completion_tokens"] - 1
    # the IR ops the model calls (fused_add_rms_norm in place), the CustomOps with a CPU kernel (apply_rotary_emb: a
    # layer the rotary one builds)
    ops = ("apply_rotary_emb", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul")
    expected: dict[tuple[str, str], float] = {}
    for op in ops:
        expected[op, "original"] = rows["disable"]
        expected[op, "vllm"] = rows[None] + (0 if op == "silu_and_mul" else rows["silu_and_mul=prefer"])
    expected["silu_and_mul", "kernel"] = rows["silu_and_mul=prefer"]
    for _ in range(50):  # a step's stats reach /metrics with its output, in the API server that got them
        after = op_rows(server)
        added = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
        if added == expected:
            break
        time.sleep(0.1)
    assert added == expected, (added, expected)
    assert {op for op, _ in after} == set(ops)  # IR ops the model does not call count nothing


def test_operator_rules_are_checked_when_the_server_starts(tmp_path: Path) -> None:
    from kernelpolicy.testing import free_port

    command = [sys.executable, "-m", "_vllm_serve", "serve", str(tmp_path), "--port", str(free_port())]
    env = environment({"KERNELPOLICY_VLLM": "1", ALLOW_MODES_VAR: "sometimes"})
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode != 0  # before it loads anything
    assert f"PolicyError: {ALLOW_MODES_VAR} 'sometimes': unknown mode 'sometimes'" in done.stdout + done.stderr
    with pytest.raises(ValueError, match=f"{ALLOW_MODES_VAR} 'sometimes': unknown mode 'sometimes'"):
        ServerRules.from_env({ALLOW_MODES_VAR: "sometimes"})
    with pytest.raises(ValueError, match=f"{ALLOW_POLICY_VAR}: kernel_policy='no_op=disable': vLLM has no op"):
        ServerRules.from_env({ALLOW_POLICY_VAR: "rms_norm=disable; no_op=disable"})
    rules = ServerRules.from_env({ALLOW_MODES_VAR: "none", ALLOW_POLICY_VAR: "disable;rms_norm=disable"})
    assert [str(policy) for policy in rules.listed] == ["disable", "rms_norm=disable"]
    assert policy_salt("disable") != policy_salt("disable", "x") != policy_salt("rms_norm=disable", "x")
    assert len(policy_salt("disable", "x" * 128)) <= 128


def test_the_middleware_rewrites_a_body_once_however_often_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import json

    import kernelpolicy.vllm
    from kernelpolicy.vllm._server import PolicyHeaders

    monkeypatch.setattr(kernelpolicy.vllm, "_installed", True)  # the plugin ran in this process
    received: list[tuple[dict[str, Any], bytes]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        chunks = [await receive()]
        while chunks[-1].get("more_body"):
            chunks.append(await receive())
        received.append((scope, b"".join(chunk["body"] for chunk in chunks)))
        assert (await receive())["type"] == "http.disconnect"  # then what the client sends

    async def call(middleware: Any, body: bytes, headers: list[tuple[bytes, bytes]], path: str) -> list[Any]:
        messages = [{"type": "http.request", "body": body[:5], "more_body": True}]
        messages += [{"type": "http.request", "body": body[5:]}, {"type": "http.disconnect"}]
        sent: list[Any] = []

        async def receive() -> Any:
            return messages.pop(0)

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "root_path": ""}
        await middleware(scope, receive, send)
        return sent

    twice = PolicyHeaders(PolicyHeaders(app))
    body = json.dumps({"prompt": "w1", "cache_salt": "mine"}).encode()
    headers = [(b"content-length", str(len(body)).encode()), (HEADER.lower().encode(), b"rms_norm=disable")]
    assert asyncio.run(call(twice, body, headers, "/v1/completions")) == []
    [(scope, rewritten)] = received
    assert json.loads(rewritten) == {
        "prompt": "w1",
        "cache_salt": "mine",  # the engine's admission salts it (_admission.admitted_salt)
        "vllm_xargs": {"kernel_policy": "rms_norm=disable"},
    }
    assert dict(scope["headers"])[b"content-length"] == str(len(rewritten)).encode()
    received.clear()  # other routes, and requests without a policy, pass as they came
    assert asyncio.run(call(twice, body, headers, "/tokenize")) == []
    assert received[0][1] == body
    received.clear()
    assert asyncio.run(call(twice, body, headers[:1], "/v1/completions")) == []
    assert received[0][1] == body
    received.clear()
    sent = asyncio.run(call(twice, body, [(HEADER.lower().encode(), b"bogus")], "/v1/chat/completions"))
    assert sent[0]["status"] == 400 and received == []
    assert "'bogus'" in json.loads(sent[1]["body"])["error"]["message"]

"""The example server (examples/kernelpolicy_server): per-request policies over HTTP, and its load test.

Unit-level tests run the ASGI app in process (Starlette's TestClient, lifespan included); the load test
starts the real server in a subprocess and checks every response against its own policy. Timings are
reported, never asserted.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain `pytest` (importlib mode) does not put the rootdir on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

import kernelpolicy as kp  # noqa: E402
from examples.kernelpolicy_server import HEADER, MAX_NEW_TOKENS, create_app, not_served_message  # noqa: E402
from examples.kernelpolicy_server.loadtest import ALLOWED, CASES, main, parser_message  # noqa: E402
from kernelpolicy._values._policy import MODES  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 0, 42, 8]
STEPS = 3
VALID_MODES = ", ".join(repr(m) for m in MODES)


@pytest.fixture(scope="module")
def client() -> Any:
    threads = torch.get_num_threads()  # the app's lifespan sets 1 for the whole process
    try:
        with TestClient(create_app(workers=2)) as test_client:
            yield test_client
    finally:
        torch.set_num_threads(threads)


def generate(client: TestClient, header: str | None = None, **body: Any) -> Any:
    payload = {"input_ids": PROMPT, "max_new_tokens": STEPS, **body}
    return client.post("/generate", json=payload, headers={} if header is None else {HEADER: header})


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "default_policy": "prefer"}


def test_generate_follows_the_header(client: TestClient) -> None:
    plain = generate(client)
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["policy"] == "prefer"
    assert len(body["tokens"]) == STEPS
    assert body["calls"] == {
        "RMSNorm": {"kernel": 5 * STEPS},
        "SiLU": {"original": 2 * STEPS},
        "rotary_pos_emb": {"original": 2 * STEPS},
    }
    assert body["variants"] == {}  # the default kernel
    alt = generate(client, "RMSNorm=kernel:alt").json()
    assert alt["policy"] == "prefer,RMSNorm=kernel:alt" and alt["variants"] == {"alt": 5 * STEPS}
    assert alt["calls"]["RMSNorm"] == {"kernel": 5 * STEPS}
    disabled = generate(client, "prefer,RMSNorm=disable").json()
    assert disabled["policy"] == "prefer,RMSNorm=disable"
    assert disabled["calls"]["RMSNorm"] == {"original": 5 * STEPS}
    assert disabled["tokens"] == body["tokens"]  # the kernel is bit-exact


@pytest.mark.parametrize("header", ["RMSNorm=fast", "fast", "disable,SiLU=fast"])
def test_malformed_header_is_400_with_the_parser_message(client: TestClient, header: str) -> None:
    response = generate(client, header)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error == parser_message(header)
    assert error.startswith(f"header {HEADER}=") and "'fast'" in error and VALID_MODES in error
    assert generate(client, "disable").status_code == 200  # and the server keeps serving


def test_require_without_kernels_everywhere_is_422(client: TestClient) -> None:
    response = generate(client, "require")
    assert response.status_code == 422
    body = response.json()
    assert "kernel required but unavailable" in body["error"] and "no kernel bound" in body["error"]
    assert body["policy"] == "require"
    assert all("original" not in paths for paths in body["calls"].values())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"input_ids": [1, 2', "Expecting"),
        (b"\xff\xfe", "bad request body"),
        (b"[1, 2, 3]", "JSON object"),
        (b"{}", "input_ids must be a list"),
        (b'{"input_ids": []}', "input_ids must be a list"),
        (b'{"input_ids": [1, 256]}', "integers in [0, 256)"),
        (b'{"input_ids": [1, true]}', "integers in [0, 256)"),
        (b'{"input_ids": [1.5]}', "integers in [0, 256)"),
        (b'{"input_ids": [1], "max_new_tokens": 0}', "max_new_tokens"),
        (f'{{"input_ids": [1], "max_new_tokens": {MAX_NEW_TOKENS + 1}}}'.encode(), "max_new_tokens"),
        (b'{"input_ids": [1], "max_new_tokens": "4"}', "max_new_tokens"),
        (b'{"input_ids": [1], "temperature": 0.5}', "unknown fields ['temperature']"),
    ],
)
def test_bad_body_is_400(client: TestClient, content: bytes, message: str) -> None:
    response = client.post("/generate", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error.startswith("bad request body: ") and message in error


def finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.slow  # the load test: a server subprocess and 120 requests
def test_load_test_mixed_policies_no_leaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "loadtest.json"
    rc = main(["--requests", "40", "--concurrency", "8", "--timeout", "240", "--json", str(out)])
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    checks = results["checks"]
    assert rc == 0 and results["passed"], printed
    assert checks["leaks"] == 0 and not checks["leak_examples"]
    assert checks["transport_errors"] == 0
    assert checks["responses_checked"] == 120  # mixed, policies, prefer: 40 each
    malformed = [c for c in CASES if c.status == 400]
    assert malformed and checks["malformed_sent"] == sum(
        c["sent"] for c in results["cases"] if c["expected_status"] == 400
    )
    assert checks["malformed_400_with_parser_message"] == checks["malformed_sent"] > 0
    assert any(case.body is not None for case in malformed)  # malformed bodies too
    for case in (c for c in malformed if c.body is None):  # "the parser's message": the bad token, the valid modes
        assert case.header is not None
        message = parser_message(case.header)
        assert VALID_MODES in message and ("'fast'" in message or f"({len(case.header)} characters)" in message)
    assert checks["require_422"] == checks["require_sent"] > 0
    assert checks["served_after_malformed"] and checks["generated_200_after_first_400"] > 0
    assert checks["tokens_follow_the_path"] and checks["compiles_after_warmup"] is None
    assert checks["server_shutdown_clean"]
    assert all(case["matched"] == case["sent"] > 0 for case in results["cases"])

    for name in ("mixed", "policies", "prefer"):
        phase = results["phases"][name]
        assert phase["requests"] == 40
        for key in ("wall_s", "requests_per_s", "generations_per_s"):
            assert finite_positive(phase[key]), (name, key)
        assert finite_positive(phase["latency_ms_200"]["p50"]) and finite_positive(phase["latency_ms_200"]["p99"])
    # the cost comparison is like for like: every request of both phases generates
    assert results["phases"]["prefer"]["status_counts"] == {"200": 40}
    assert results["phases"]["policies"]["status_counts"] == {"200": 40}
    ratio = results["ratio_policies_to_prefer"]
    assert all(finite_positive(ratio[key]) for key in ("generations_per_s", "p50_latency", "p99_latency"))
    assert "**0** of 120" in printed and "Per-request policies / no policies" in printed
    ab = results["ab"]  # the A/B of the two RMSNorm kernels: every other request on the variant
    assert ab["requests"] == 40 and ab["wrong"] == [] and ab["consistent_within_arm"]
    assert ab["arms"]["default"]["variant_calls"] == {}
    assert ab["arms"]["alt"] == {"header": "RMSNorm=kernel:alt", "sent": 20, "variant_calls": {"alt": 20 * 5 * 4}}
    assert ab["prompts"] == 4 and 0 <= ab["prompts_agreeing"] <= 4
    assert "A/B of two RMSNorm kernels, 40 requests" in printed


@pytest.mark.slow  # the load test: a server subprocess and 120 requests
def test_compiled_load_test_five_policies_no_leaks_no_compiles_after_warmup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The compiled server (backend eager: Dynamo's capture and guards, without inductor's minutes on 2 cores)."""
    out = tmp_path / "loadtest.json"
    argv = ["--compile", "--compile-backend", "eager", "--requests", "40", "--concurrency", "8", "--timeout", "400"]
    rc = main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    checks = results["checks"]
    assert rc == 0 and results["passed"], printed
    assert checks["leaks"] == 0 and checks["transport_errors"] == 0 and checks["responses_checked"] == 120
    assert checks["compiled_graphs"]["policies"] == [str(p) for p in ALLOWED] and len(ALLOWED) == 5
    # 2 programs (RMSNorm kernel on / off) x 2 sequence-length classes (1, >= 2), none after warm-up.
    assert checks["compiled_graphs"]["graphs_at_warmup"] == 4
    assert checks["compiles_after_warmup"] == 0
    assert checks["tokens_follow_the_path"] and checks["prompts"] == 4
    unlisted = [c for c in results["cases"] if c["header"] in ("require", "prefer,SiLU=disable")]
    assert len(unlisted) == 2 and all(c["expected_status"] == 400 and c["matched"] == c["sent"] > 0 for c in unlisted)
    assert "| graphs compiled at warm-up / after it | 4 / **0** (5 policies) |" in printed


def test_an_allowlist_needs_compiled_serving() -> None:
    with pytest.raises(ValueError, match=r"allowlist of policies is for compiled serving: pass compile=True"):
        create_app(policies=["disable"])
    with pytest.raises(kp.PolicyError, match=r"--policy='fast': unknown kernel policy mode 'fast'"):
        create_app(compile=True, policies=["fast"])


def test_not_served_message_names_the_policy_and_the_allowed_ones() -> None:
    message = not_served_message(kp.Policy("require"), ALLOWED)
    assert message.startswith("policy 'require' is not served by this compiled server")
    assert message.endswith("allowed policies: " + ", ".join(repr(str(p)) for p in ALLOWED))


def test_a_body_nested_too_deep_is_400_not_500(client: TestClient) -> None:
    response = client.post("/generate", content=b"[" * 5000 + b"]" * 5000, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"].startswith("bad request body: ")


def test_a_huge_header_is_400_with_a_short_message(client: TestClient) -> None:
    response = generate(client, "RMSNorm=fast" + "x" * 100_000)
    assert response.status_code == 400
    error = response.json()["error"]
    assert len(error) < 1000 and "... (100012 characters)" in error and VALID_MODES in error

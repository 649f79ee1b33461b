"""``vllm serve`` with kernelpolicy installed and its switch off: vLLM's own server, the X-Kernel-Policy header
unread, ``vllm_xargs`` passed on unchecked, no salt added, no kernelpolicy counts in /metrics (one real server for
the module; the switch on is tests/test_vllm_serve.py's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("vllm")

from _vllm_serve import get, post, save_model, served

from kernelpolicy.serving import HEADER

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LONG = " ".join(f"w{(7 * i) % 250 + 1}" for i in range(200))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("vllm-serve-off")
    with served(
        save_model(folder / "model"), folder / "serve.log", {"KERNELPOLICY_VLLM": "0"}, "--served-model-name", "tiny"
    ) as found:
        yield found


def complete(url: str, headers: dict[str, str] | None = None, **body: Any) -> tuple[int, Any]:
    request = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 4, "temperature": 0, "logprobs": 1} | body
    return post(url, "/v1/completions", request, headers)


def test_the_switch_off_leaves_vllm_serve_as_it_is(url: str) -> None:
    status, plain = complete(url)
    assert status == 200, plain
    for headers, body in [
        ({HEADER: "rms_norm=bogus"}, {}),  # not read: no 400
        ({HEADER: "disable"}, {}),
        ({}, {"vllm_xargs": {"kernel_policy": "disable"}}),  # vLLM passes extra_args on; no worker reads it
        ({HEADER: "disable"}, {"vllm_xargs": {"kernel_policy": "rms_norm=disable"}}),  # no conflict to tell
    ]:
        status, found = complete(url, headers, **body)
        assert status == 200, found
        assert found["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]
    # a dict policy is not a vllm_xargs value vLLM takes: its own 400 (pydantic's), not kernelpolicy's
    status, found = complete(url, vllm_xargs={"kernel_policy": {"rms_norm": "disable"}})
    assert status == 400 and "kernel_policy" in found["error"]["message"]

    def cached(headers: dict[str, str] | None = None) -> int:
        status, found = complete(url, headers, prompt=LONG, max_tokens=1, logprobs=None)
        assert status == 200, found
        return int((found["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") or 0)

    cached()
    assert cached({HEADER: "disable"}) > 0  # no salt per policy: vLLM's own prefix cache
    assert cached(None) > 0
    metrics = get(url, "/metrics")
    assert "vllm:request_success_total" in metrics and "kernelpolicy_" not in metrics

"""The metrics of ``python -m kernelpolicy serve``: ``GET /metrics`` in Prometheus' text format, by policy.

This module owns the metric names (:data:`NAMES`), where each is counted, and the exposition.

Design: transformers serve parses HTTP in an API server process and runs the forward steps in an engine process
it spawns (with ``--api-server-count N``, N API servers and one engine). What happens to a request (its policy,
its tokens, its timing, a refused header) is seen by its API server; what happens to a kernel (each call's path,
a fallback, a trip of ``max_failures``, a kernel's error) only where the forward runs. Each process counts what
it sees with ``prometheus_client`` in its **multiprocess mode**: the launcher points ``PROMETHEUS_MULTIPROC_DIR``
at a fresh folder before anything imports ``prometheus_client``, every process the server spawns inherits it and
writes its counts to files of its own there (memory-mapped, no message to send, no lock across processes), and
``/metrics`` in any API server sums the files of all processes. Nothing travels through transformers' queues.

Label sets are bounded: ``policy`` only takes the operator's set (:meth:`kernelpolicy.serving._access.Access.label`;
other allowed policies are ``other``), ``layer`` the kernel layer names of the model served, ``path`` and
``kind`` fixed values. A client's header cannot create a series.

Kernel calls are counted by recording them (:func:`~kernelpolicy.record_calls`' recorders): every call takes
the slow path, and calls inside a ``torch.compile``d graph are not counted (a compiled graph runs no Python).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any, Final

from ._access import OTHER

if TYPE_CHECKING:
    from .._forward._failures import Failing

__all__ = ["NAMES", "exposition", "observe_request", "prepare"]

#: Every metric, with what it counts (documented in docs/serving.md).
NAMES: Final = {
    "kernelpolicy_serve_requests_total": "generation requests handed to the model, by policy",
    "kernelpolicy_serve_generated_tokens_total": "tokens generated, by policy",
    "kernelpolicy_serve_time_to_first_token_seconds": "time from hand-over to the first token (streaming), by policy",
    "kernelpolicy_serve_tokens_per_second": "tokens generated / the request's time in the model, by policy",
    "kernelpolicy_serve_errors_total": "errors, by kind: bad_header, refused_policy, request_failed (a request the "
    "model failed), and per forward call: kernel_unavailable, kernel_mismatch, kernel_failure",
    "kernelpolicy_kernel_calls_total": "calls of policy-aware layers in the model's process, by layer and path",
    "kernelpolicy_kernel_fallbacks_total": "kernel errors fallback_on caught (the original ran instead), by layer",
    "kernelpolicy_kernel_trips_total": "kernels max_failures stopped, by layer",
    "kernelpolicy_canary_requests_total": "requests --verify-sample ran as verify, by policy",
    "kernelpolicy_verify_calls_total": "calls verify compared with the original forward, by layer",
    "kernelpolicy_verify_mismatches_total": "of those, the calls beyond the tolerance, by layer",
    "kernelpolicy_verify_max_abs_error": "the largest absolute error verify saw, by layer",
    "kernelpolicy_verify_max_rel_error": "the largest relative error verify saw, by layer",
}
logger = logging.getLogger("kernelpolicy")

#: The environment variable ``prometheus_client`` reads its multiprocess folder from.
DIRECTORY_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
#: The environment variable the launcher turns the metrics off in (``0``: ``--no-metrics``), for every process.
ENABLED_ENV: Final = "KERNELPOLICY_SERVE_METRICS"
#: The policy label of the request being served (the API server's middleware sets it).
LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("kernelpolicy.serve.label", default=OTHER)
_RATES: Final = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
#: The error kind of an exception class a forward call raised.
_KINDS: Final = {"KernelUnavailableError": "kernel_unavailable", "KernelMismatchError": "kernel_mismatch"}


def enabled() -> bool:
    """Whether this server counts (``--no-metrics`` turns it off: no ``/metrics``, no recording of kernel calls)."""
    return os.environ.get(ENABLED_ENV, "1") != "0"


def prepare() -> str | None:
    """In the launcher, before ``prometheus_client`` is imported: a fresh multiprocess folder (unless the operator
    gave one), inherited by every process of the server. The folder made, to remove at exit, or None."""
    if os.environ.get(DIRECTORY_ENV):
        return None
    made = tempfile.mkdtemp(prefix="kernelpolicy-metrics-")
    os.environ[DIRECTORY_ENV] = made
    return made


class _Instruments:
    """The metric objects of this process (each process makes its own; the files are summed on exposition)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, *labels: str) -> Any:
            return Counter(name.removesuffix("_total"), NAMES[name], labels)

        self.requests = counter("kernelpolicy_serve_requests_total", "policy")
        self.tokens = counter("kernelpolicy_serve_generated_tokens_total", "policy")
        first = "kernelpolicy_serve_time_to_first_token_seconds"
        self.first_token = Histogram(first, NAMES[first], ["policy"])
        rate = "kernelpolicy_serve_tokens_per_second"
        self.rate = Histogram(rate, NAMES[rate], ["policy"], buckets=_RATES)
        self.errors = counter("kernelpolicy_serve_errors_total", "kind")
        self.calls = counter("kernelpolicy_kernel_calls_total", "layer", "path")
        self.fallbacks = counter("kernelpolicy_kernel_fallbacks_total", "layer")
        self.trips = counter("kernelpolicy_kernel_trips_total", "layer")
        self.canaries = counter("kernelpolicy_canary_requests_total", "policy")
        self.verified = counter("kernelpolicy_verify_calls_total", "layer")
        self.mismatches = counter("kernelpolicy_verify_mismatches_total", "layer")
        largest = ("kernelpolicy_verify_max_abs_error", "kernelpolicy_verify_max_rel_error")
        self.max_abs, self.max_rel = (Gauge(n, NAMES[n], ["layer"], multiprocess_mode="max") for n in largest)


@functools.cache
def metrics() -> _Instruments:
    return _Instruments()


def exposition() -> tuple[bytes, str]:
    """The body and content type of ``GET /metrics``: the counts of every process of the server."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return generate_latest(registry), CONTENT_TYPE_LATEST


def error(kind: str) -> None:
    if enabled():
        metrics().errors.labels(kind).inc()


async def observe_request(send: Any, streamer: Any) -> Any:
    """Await a generation request's result (``send()``), counting it under the request's policy label: the request,
    its tokens, its time to first token (a streaming request's first token), its tokens/s, or its failure."""
    counted, label = metrics(), LABEL.get()
    counted.requests.labels(label).inc()
    started, streamed = time.perf_counter(), [0]
    if streamer is not None:
        put = streamer.put_token

        def put_token(token: int) -> None:
            if not streamed[0]:
                counted.first_token.labels(label).observe(time.perf_counter() - started)
            streamed[0] += 1
            put(token)

        streamer.put_token = put_token
    try:
        result = await send()
    except Exception:
        counted.errors.labels("request_failed").inc()
        raise
    tokens = streamed[0] if streamer is not None else len(result) if isinstance(result, list) else 0
    elapsed = time.perf_counter() - started
    counted.tokens.labels(label).inc(tokens)
    if tokens and elapsed > 0:
        counted.rate.labels(label).observe(tokens / elapsed)
    return result


class CallMetrics:
    """A :func:`~kernelpolicy.record_calls` recorder counting every call of the model's process."""

    def add(
        self, module: object, module_name: str | None, layer_name: str, path: str, reason: str, raised: str = ""
    ) -> None:
        from .._forward._dispatch import FAILED

        counted = metrics()
        counted.calls.labels(layer_name, path).inc()
        if reason.startswith(FAILED):
            counted.fallbacks.labels(layer_name).inc()
        if path == "error":  # require, and the kernel cannot run: KernelUnavailableError (raised after recording)
            counted.errors.labels("kernel_unavailable").inc()
        elif raised:
            kind = _KINDS.get(raised, "kernel_failure" if path == "kernel" else None)
            if kind is not None:
                counted.errors.labels(kind).inc()


#: The one recorder of the model's process.
CALLS: Final = CallMetrics()


def _tripped(binding: Failing) -> None:
    metrics().trips.labels(binding.layer_name).inc()


_LARGEST: dict[tuple[str, str], float] = {}


def _compared(module: Any, tested: Any, reference: Any, mismatch: Any) -> None:
    """After each comparison of ``verify``: the call, a mismatch (logged), the largest errors of its layer."""
    import torch

    from .._forward._binding import BINDING
    from .._values._tensors import tensors_in

    binding = module.__dict__.get(BINDING)
    layer = "" if binding is None else binding.layer_name
    counted = metrics()
    counted.verified.labels(layer).inc()
    largest_abs = largest_rel = 0.0
    for out, expected in zip(tensors_in(tested), tensors_in(reference), strict=False):
        if out.shape != expected.shape or not (expected.is_floating_point() or expected.is_complex()):
            continue
        diff = (out.detach().to(torch.float64) - expected.detach().to(torch.float64)).abs()
        if diff.numel():
            scale = expected.detach().abs().to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny)
            largest_abs = max(largest_abs, float(diff.max()))
            largest_rel = max(largest_rel, float((diff / scale).max()))
    # this process's largest so far (a gauge holds one value); multiprocess mode "max": the largest of every process
    largest_abs = _LARGEST[(layer, "abs")] = max(_LARGEST.get((layer, "abs"), 0.0), largest_abs)
    largest_rel = _LARGEST[(layer, "rel")] = max(_LARGEST.get((layer, "rel"), 0.0), largest_rel)
    counted.max_abs.labels(layer).set(largest_abs)
    counted.max_rel.labels(layer).set(largest_rel)
    if mismatch is not None:
        counted.mismatches.labels(layer).inc()
        logger.warning(
            "verify: kernel layer %r at %r differs from its reference at %s: %s (largest absolute error %.3g, "
            "relative %.3g)",
            layer,
            getattr(binding, "module_name", ""),
            mismatch.where,
            mismatch.detail,
            mismatch.max_abs,
            mismatch.max_rel,
        )


def install_engine() -> None:
    """In the model's process: count trips and verify's comparisons (the forwards' calls are counted by
    :data:`CALLS`)."""
    from .._forward._failures import ON_STOPPED
    from .._forward._verify import COMPARED

    if _tripped not in ON_STOPPED:
        ON_STOPPED.append(_tripped)
    if _compared not in COMPARED:
        COMPARED.append(_compared)

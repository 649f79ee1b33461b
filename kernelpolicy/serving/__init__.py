"""``python -m kernelpolicy serve MODEL ...``: transformers' own server (``transformers serve``), a policy per request.

The ``X-Kernel-Policy`` header (the policy text syntax: ``disable``, ``RMSNorm=disable``, ``prefer,SiLU=require``)
chooses the policy of one request on every OpenAI-compatible route (chat completions, completions, responses),
streaming or not. A malformed header gets a 400 JSON error in OpenAI's shape, a policy the operator does not allow
(``--allow-modes``, ``--allow-policy``, ``--ignore-policy-header``) a 403, and the server goes on serving.
No header: the server's default (``KERNELPOLICY``, else ``prefer``).

How the policy travels: transformers serve parses HTTP in an API server process (``--api-server-count N``: N
of them, spawned) and runs the model in an engine process of its own (spawned), joined by queues. This module
owns the three seams:

- **API server**: a middleware reads and checks the header against the operator's rules (:mod:`kernelpolicy.serving._access`:
  400 if malformed, 403 if not allowed) and runs the request inside that policy's scope; the engine client puts
  the policy in effect (as text) into the request it queues. An API server of ``--api-server-count N`` is
  spawned: it starts in this module's entry point (:func:`run_spawned`, picklable by name), which installs the
  same before serving; the operator's rules and the metrics' folder reach it through the environment;
- **engine process**: the engine's entry point is this module's (picklable by name, so the spawned process
  imports kernelpolicy): it makes the loaded model policy-aware (``auto_attach`` before loading, ``attach``
  after, or ``kernelize`` with the local kernel repositories of ``--kernel NAME=PATH``), and runs each
  request's hand-over to the model inside its policy's scope;
- **the model**: with ``--continuous-batching``, the batching manager carries each request's policy
  (:mod:`kernelpolicy.batching`: one policy per forward step); without, the one-at-a-time runner's thread
  runs each request under its own (``propagate``).

The seams are transformers' private names (``_compat.SERVING``): where one is missing, the command says so
and stops, before serving anything, rather than serving every request under one policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from typing import Any

from .._compat import _compat, _versions
from .._values._errors import PolicyError
from .._values._policy import Policy
from . import _metrics
from ._access import HEADER, MAX_HEADER, Access

__all__ = ["HEADER", "MAX_HEADER", "main", "parse_header"]

#: The key under which a request's policy travels to the engine, in its generation settings.
_KEY = "_kernelpolicy"
#: The environment variable the launcher hands the local kernel repositories to the engine in (JSON).
KERNELS_ENV = "KERNELPOLICY_SERVE_KERNELS"
#: The environment variable the launcher hands the operator's rules (:class:`~kernelpolicy.serving._access.Access`) to
#: every process of the server in (JSON).
ACCESS_ENV = "KERNELPOLICY_SERVE_ACCESS"
#: The environment variable the launcher hands the canary's settings to the engine in (JSON: sample, fail).
CANARY_ENV = "KERNELPOLICY_SERVE_CANARY"


def canary(policy: Policy, *, fail: bool) -> Policy | None:
    """The policy a sampled request runs under (``--verify-sample``): ``prefer`` and ``require`` become ``verify``
    (the client gets the kernel's answer), mismatches warn, or raise with ``fail``; None for a request that would
    run no kernel or verifies already.

    >>> canary(Policy.parse("RMSNorm=disable"), fail=False)
    Policy('verify', RMSNorm='disable', on_mismatch='warn')
    >>> canary(Policy.parse("disable"), fail=False) is None
    True
    """
    entries = [policy.default, *policy.layers.values()]
    if "verify" in entries or not any(entry in ("prefer", "require") for entry in entries):
        return None  # a variant entry runs as chosen: the canary verifies a layer's own kernel only

    def verified(entry: str) -> Any:
        return "verify" if entry in ("prefer", "require") else entry

    layers = {name: verified(entry) for name, entry in policy.layers.items()}
    return policy.overlay(verified(policy.default), layers, {"on_mismatch": "raise" if fail else "warn"})


def parse_header(value: bytes) -> Policy:
    """The policy of a raw ``X-Kernel-Policy`` header value; :class:`PolicyError` naming what is wrong."""
    return Access().parse(value)


def _allowed() -> Access:
    """The operator's rules in this process (the launcher's, through :data:`ACCESS_ENV`; else the defaults)."""
    text = os.environ.get(ACCESS_ENV)
    return Access() if not text else Access.from_json(text)


class PolicyHeader:
    """ASGI middleware: the request runs inside the scope of its ``X-Kernel-Policy`` header (400 if malformed,
    403 if the operator's rules do not allow it; not read at all if they say so)."""

    def __init__(self, app: Any, access: Access | None = None) -> None:
        self.app = app
        self.access = _allowed() if access is None else access

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from .._context._active import current_policy
        from .._context._scope import kernel_policy

        default = current_policy()
        values = [value for name, value in scope["headers"] if name == HEADER.lower().encode()]
        if not values or not self.access.header:
            token = _metrics.LABEL.set(self.access.label(default, default))
            try:
                await self.app(scope, receive, send)
            finally:
                _metrics.LABEL.reset(token)
            return
        with contextlib.ExitStack() as stack:
            try:
                if len(values) > 1:
                    raise PolicyError(f"header {HEADER} given {len(values)} times; give it once")
                policy = self.access.parse(values[0])
                refusal = self.access.refusal(policy, default)
                if refusal is not None:
                    _metrics.error("refused_policy")
                    await _json_error(send, refusal[:2000], 403, "policy_not_allowed")
                    return
                scope_ = kernel_policy(policy)
                scope_._deferred = True  # no model here: the engine checks the variants named (see _policy_aware_load)
                stack.enter_context(scope_)
            except PolicyError as error:
                _metrics.error("bad_header")
                await _json_error(send, str(error)[:2000], 400, "invalid_policy")
                return
            token = _metrics.LABEL.set(self.access.label(policy, default))
            stack.callback(_metrics.LABEL.reset, token)
            await self.app(scope, receive, send)


def _error_body(message: str, code: str, *, kind: str = "invalid_request_error", param: str | None = HEADER) -> Any:
    """An error in OpenAI's shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _json_error(send: Any, message: str, status: int, code: str) -> None:
    body = json.dumps(_error_body(message, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- the API server's side ------------------------------------------------------------------------


async def _metrics_route(request: Any) -> Any:
    """``GET /metrics``: Prometheus' text format, the counts of every process of the server."""
    from starlette.responses import Response

    body, content_type = _metrics.exposition()
    return Response(body, media_type=content_type)


class _RequestFailedError(Exception):
    """A generation request the model's process failed (its error, as the engine sends it: text)."""


async def _request_failed(request: Any, error: Exception) -> Any:
    """A request the model failed (a kernel's error, ``--verify-fail``'s mismatch, ...), not streaming: a 500 in
    OpenAI's error shape, answered like any other response (the connection stays open for the next request); a
    streaming request gets transformers' error event instead."""
    from starlette.responses import JSONResponse

    return JSONResponse(_error_body(str(error), "request_failed", kind="server_error", param=None), status_code=500)


def _install_api_side() -> None:
    """Every app transformers builds gets the middleware; every request queued carries its policy."""
    server = _compat.lookup(_owner(_compat.SERVING_BUILD))
    build = _compat.lookup(_compat.SERVING_BUILD.names[0])

    def build_server(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)
        app.add_middleware(PolicyHeader)
        if _metrics.enabled():
            app.add_route("/metrics", _metrics_route, methods=["GET"])
        app.add_exception_handler(_RequestFailedError, _request_failed)
        return app

    server.build_server = build_server
    client = _compat.lookup(_owner(_compat.SERVING_SEND))
    send = client._send_request

    async def _send_request(self: Any, method: str, args: tuple[Any, ...], streamer: Any = None) -> Any:
        if method == "generate":
            from .._context._active import current_policy

            inputs, settings = args
            args = (inputs, {**settings, _KEY: str(current_policy())})
            try:
                if not _metrics.enabled():
                    return await send(self, method, args, streamer)
                return await _metrics.observe_request(lambda: send(self, method, args, streamer), streamer)
            except RuntimeError as error:
                # the engine sends a request's failure as a plain RuntimeError (its text); transformers' handlers
                # keep theirs: EngineDeadError, a RuntimeError's subclass (a 503), and ValueError (a 400)
                if type(error) is not RuntimeError:
                    raise
                raise _RequestFailedError(str(error)) from error
        return await send(self, method, args, streamer)

    client._send_request = _send_request
    client.run_engine = staticmethod(run_engine)


def _install_api_servers() -> None:
    """With ``--api-server-count N``, the processes transformers spawns start in :func:`run_spawned`.

    A spawned process gets its target pickled by qualified name, so each reference transformers serve holds to
    ``run_until_parent_exits`` (its module's, and the engine client's module's, imported by name) is replaced:
    one left as it was would no longer be the object its name leads to."""
    owner, _, attribute = _compat.SERVING_API.names[0].rpartition(".")
    original, package = _compat.lookup(_compat.SERVING_API.names[0]), owner.rpartition(".")[0]
    for name, module in list(sys.modules.items()):
        if name.startswith(package) and getattr(module, attribute, None) is original:
            setattr(module, attribute, run_spawned)


def run_spawned(target: Any, *args: Any) -> None:
    """The entry point of a process transformers serve spawns (``run_until_parent_exits``): an API server of
    ``--api-server-count N`` is made policy-aware first (a fresh process has none of the launcher's changes); the
    engine's process makes itself so (its target is :func:`run_engine`)."""
    if target is not run_engine:
        _install_api_side()
    _compat.lookup(_compat.SERVING_API.names[0])(target, *args)


# --- the engine's side ------------------------------------------------------------------------------


def run_engine(load: Any, *args: Any) -> None:
    """The engine process's entry point (``EngineClient.run_engine``, made policy-aware first)."""
    _install_engine_side()
    client = _compat.lookup(_owner(_compat.SERVING_SEND))
    client.run_engine(_policy_aware_load(load), *args)


def _policy_aware_load(load: Any) -> Any:
    def loaded(*args: Any, **kwargs: Any) -> Any:
        from .. import _transformers, training  # noqa: F401 - their attach hooks (hub attention, checkpointing)
        from .._attach import _attach as kernelpolicy  # attach, kernelize
        from .._attach._autoattach import auto_attach

        repos = json.loads(os.environ.get(KERNELS_ENV) or "{}")
        previous = auto_attach()  # hub kernels transformers binds while loading
        try:
            model, processor = load(*args, **kwargs)
        finally:
            auto_attach(previous)
        if repos:
            from pathlib import Path

            kernels = _versions.kernels()
            device = str(model.device.type)
            mapping = {
                name: {device: kernels.LocalLayerRepository(repo_path=Path(path), layer_name=name)}
                for name, path in repos.items()
            }
            with kernels.use_kernel_mapping(mapping):
                kernelpolicy.kernelize(model, mode="inference", device=device)
        kernelpolicy.attach(model)
        from .._context._scope import check_variants

        for allowed in _allowed().policies:  # a variant the model has not: refused before serving
            check_variants(allowed, f"--allow-policy {str(allowed)!r}")
        return model, processor

    return loaded


def _install_engine_side() -> None:
    from .. import batching
    from .._context._active import RECORDERS, current_policy
    from .._context._propagate import propagate
    from .._context._scope import _recording_scope, kernel_policy
    from ._metrics import CALLS

    batching.install()
    counted = _metrics.enabled()
    if counted:
        _metrics.install_engine()
    settings_ = json.loads(os.environ.get(CANARY_ENV) or '{"sample": 0, "fail": false}')
    sample, fail, draw = float(settings_["sample"]), bool(settings_["fail"]), random.Random()
    for internal in (_compat.SERVING_GENERATE, _compat.SERVING_CB_GENERATE):
        owner = _compat.lookup(_owner(internal))
        generate = owner.__dict__["generate"]

        def policy_generate(
            self: Any, request_id: int, inputs: Any, settings: dict[str, Any], stream: bool, generate: Any = generate
        ) -> None:
            settings = dict(settings)
            policy = Policy.parse(settings.pop(_KEY)) if _KEY in settings else current_policy()
            if sample and draw.random() < sample:
                sampled = canary(policy, fail=fail)
                if sampled is not None:
                    if counted:
                        _metrics.metrics().canaries.labels(_allowed().label(policy, current_policy())).inc()
                    policy = sampled
            with contextlib.ExitStack() as scopes:
                scopes.enter_context(kernel_policy(policy))
                if counted:  # every call of this request counts (continuous batching: in the steps serving it)
                    recorders = (*RECORDERS.get(), CALLS)
                    scopes.enter_context(_recording_scope(None, recording=True, recorders=recorders))
                generate(self, request_id, inputs, settings, stream)

        owner.generate = policy_generate
    runner = _compat.lookup(_owner(_compat.SERVING_GENERATE))
    init = runner.__init__

    def runner_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        put = self.queue.put

        def put_with_policy(item: Any, *rest: Any, **options: Any) -> None:
            request_id, function, *others = item  # the one-at-a-time runner's thread runs it: under its policy
            put((request_id, propagate(function), *others), *rest, **options)

        self.queue.put = put_with_policy

    runner.__init__ = runner_init


def _owner(internal: _compat.Internal) -> str:
    """The module or class that holds the name ``internal`` looks up."""
    return internal.names[0].rpartition(".")[0]


def _option(arguments: list[str], name: str) -> str | None:
    """The value given to option ``name`` in ``arguments`` (``name VALUE`` or ``name=VALUE``), or None."""
    for i, item in enumerate(arguments):
        if item == name and i + 1 < len(arguments):
            return arguments[i + 1]
        if item.startswith(f"{name}="):
            return item.partition("=")[2]
    return None


# --- the command --------------------------------------------------------------------------------------


#: kernelpolicy's own options of the command, each taking a value (the others are ``transformers serve``'s).
_VALUED = ("--kernel", "--allow-modes", "--allow-policy", "--verify-sample")
#: Its flags.
_FLAGS = ("--ignore-policy-header", "--verify-fail", "--no-metrics")


def _own_options(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """kernelpolicy's options of the command line (``--name VALUE`` or ``--name=VALUE``), and the rest."""
    own: dict[str, list[str]] = {}
    rest: list[str] = []
    items = iter(argv)
    for item in items:
        name = item.partition("=")[0]
        if name in _VALUED:
            own.setdefault(name, []).append(item.partition("=")[2] if "=" in item else next(items, ""))
        elif item in _FLAGS:
            own.setdefault(item, []).append("")
        else:
            rest.append(item)
    return own, rest


#: The signals whose default action ends the command without its exit handlers: handled to remove the metrics folder
#: first (SIGINT raises KeyboardInterrupt, which runs them).
_STOPPING = ("SIGTERM", "SIGHUP")


def _remove_at_exit(folder: str) -> None:
    """Remove the metrics folder the command made when it exits: normally, by an exception (Ctrl+C), or by a signal
    of :data:`_STOPPING` (SIGTERM, which Docker and Kubernetes send, and which uvicorn re-raises once it has drained),
    which then ends the command as it would have (exit status -15 for SIGTERM). The processes the server spawned go
    first: the model's process is stopped as a normal exit stops it (terminated: it is a daemon), and each is waited
    for a while, so that none still writes its counts there."""
    import atexit
    import multiprocessing
    import shutil
    import signal
    import threading

    def remove() -> None:
        children = multiprocessing.active_children()
        for child in children:
            if child.daemon:
                child.terminate()
        for child in children:
            child.join(5)
        shutil.rmtree(folder, ignore_errors=True)

    def stopped(number: int, frame: object) -> None:
        signal.signal(number, signal.SIG_DFL)
        remove()
        signal.raise_signal(number)

    atexit.register(remove)
    if threading.current_thread() is not threading.main_thread():
        return
    for name in _STOPPING:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is signal.SIG_DFL:  # one the caller set is left as it is
            signal.signal(number, stopped)


def main(argv: list[str]) -> int:
    """``python -m kernelpolicy serve [--kernel NAME=PATH ...] [--allow-modes MODES] [--allow-policy POLICY ...]
    [--ignore-policy-header] [--verify-sample FRACTION [--verify-fail]] [--no-metrics] MODEL [transformers serve
    options]``."""
    own, rest = _own_options(argv)
    kernels: dict[str, str] = {}
    for value in own.get("--kernel", []):
        name, _, path = value.partition("=")
        if not name or not path:
            print(f"--kernel takes NAME=PATH (a local kernel repository), got {value!r}", file=sys.stderr)
            return 2
        kernels[name] = os.path.abspath(path)
    modes = own.get("--allow-modes", [])
    if len(modes) > 1:
        print(f"--allow-modes given {len(modes)} times; give it once (comma-separated modes)", file=sys.stderr)
        return 2
    try:
        access = Access.from_options(
            modes[0] if modes else None, own.get("--allow-policy", []), ignore_header="--ignore-policy-header" in own
        )
    except PolicyError as error:
        print(f"kernelpolicy serve: {error}", file=sys.stderr)
        return 2
    fraction = (own.get("--verify-sample") or ["0"])[-1]
    try:
        sample = float(fraction)
    except ValueError:
        sample = -1.0
    if not 0.0 <= sample <= 1.0:
        print(f"--verify-sample takes a fraction from 0 to 1 (0.01: 1% of requests), got {fraction!r}", file=sys.stderr)
        return 2
    if not _compat.all_present((_compat.SERVING_BUILD, _compat.SERVING_SEND, *_compat.SERVING_RUNNERS)):
        print("kernelpolicy serve: this transformers serve lacks the seams a policy travels through", file=sys.stderr)
        return 1
    servers = _option(rest, "--api-server-count")
    several = servers not in (None, "1")
    if several and not _compat.all_present((_compat.SERVING_API,)):
        print(
            f"kernelpolicy serve: --api-server-count {servers}: this transformers serve lacks the seam its API "
            "server processes start through (they would not read the X-Kernel-Policy header); serve with one",
            file=sys.stderr,
        )
        return 1
    import importlib.util

    counted = "--no-metrics" not in own
    os.environ[_metrics.ENABLED_ENV] = "1" if counted else "0"  # every process of the server reads it
    if (
        counted and importlib.util.find_spec("prometheus_client") is None
    ):  # not imported: its multiprocess folder comes first
        print(
            "kernelpolicy serve: GET /metrics needs prometheus_client: pip install 'kernelpolicy[server]'",
            file=sys.stderr,
        )
        return 1
    if kernels:
        os.environ[KERNELS_ENV] = json.dumps(kernels)
    made = _metrics.prepare() if counted else None  # before prometheus_client's values are made, in every process
    if made is not None:
        _remove_at_exit(made)
    os.environ[ACCESS_ENV] = access.to_json()  # the API server processes read it too
    os.environ[CANARY_ENV] = json.dumps({"sample": sample, "fail": "--verify-fail" in own})
    from .._context._active import current_policy

    print(f"kernelpolicy serve: {access.describe(current_policy())}", file=sys.stderr)
    _install_api_side()
    if several:
        _install_api_servers()
    from transformers.cli.transformers import app

    app(args=["serve", *rest], prog_name="python -m kernelpolicy serve")
    return 0

"""``vllm serve`` with kernelpolicy on: a request's policy from its ``X-Kernel-Policy`` header or its body.

This module owns the API server's side of the vLLM plugin: :class:`PolicyHeaders` (a pure-ASGI middleware on the
generation routes, :data:`ROUTES`), the operator's rules for ``vllm serve`` (:class:`ServerRules`, read from
:data:`ALLOW_MODES_VAR` and :data:`ALLOW_POLICY_VAR`), the
counts per policy in vLLM's own ``/metrics``, and :func:`install`, which the plugin's ``register`` calls in every
process (it acts in vLLM's API server processes only).

A request's policy comes from the header (the same header and syntax as ``python -m kernelpolicy serve``) or from
the body's ``vllm_xargs.kernel_policy`` (a string, or a dict of op entries); both given must say the same policy.
The middleware checks it (the syntax, vLLM's op names, the operator's rules) and rewrites the JSON body before vLLM
parses it: ``vllm_xargs.kernel_policy`` becomes the policy's canonical text (what reaches
``SamplingParams.extra_args``; the engine's admission gives it the policy's ``cache_salt``, ``_admission``). Bad input gets a 400 in vLLM's error shape naming
the value and the valid ones. A request without a policy passes unchanged (vLLM's own choice, vLLM's own cache).

Counts: ``kernelpolicy_serve_requests_total`` and ``kernelpolicy_serve_generated_tokens_total`` by ``policy`` (the
names of ``python -m kernelpolicy serve``, :mod:`kernelpolicy.serving._metrics`), counted where the API server hands
a request to the engine (``AsyncLLM.generate``), and ``kernelpolicy_serve_errors_total`` by ``kind`` for the
middleware's refusals. They live in ``prometheus_client``'s default registry, which vLLM's ``/metrics`` serves; with
``--api-server-count N`` vLLM points ``PROMETHEUS_MULTIPROC_DIR`` at a folder before it spawns the API servers, and
its ``/metrics`` sums every process's files, these counts included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Final

from .._values._errors import PolicyError, shown
from .._values._policy import NO_OPTIONS
from ..serving import _metrics
from ..serving._access import HEADER, OTHER, Access
from ._admission import KEY, SALT_PREFIX, request_policy

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable

    from ._admission import RequestPolicy

__all__ = [
    "ALLOW_MODES_VAR",
    "ALLOW_POLICY_VAR",
    "ROUTES",
    "PolicyHeaders",
    "ServerRules",
    "install",
]

#: The modes a client may give for the default and any op (``--allow-modes`` of ``python -m kernelpolicy serve``:
#: comma-separated, or ``none``); default ``prefer,disable``.
ALLOW_MODES_VAR: Final = "KERNELPOLICY_VLLM_ALLOW_MODES"
#: Whole policies a client may choose besides those (``--allow-policy``), separated by ``;``.
ALLOW_POLICY_VAR: Final = "KERNELPOLICY_VLLM_ALLOW_POLICY"
#: The routes whose JSON body carries ``vllm_xargs`` and ``cache_salt``: where a request's policy is read.
ROUTES: Final = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/responses",
    "/v1/messages",
)
#: The metrics label of a request without a policy (vLLM's own choice).
NO_POLICY: Final = "none"
#: Where the body's policy is, in error messages.
_BODY: Final = f"vllm_xargs.{KEY}"
#: The scope key a :class:`PolicyHeaders` sets, so that a second one on the same app passes requests through.
_SEEN: Final = "kernelpolicy.vllm.policy"
_installed = False


@dataclasses.dataclass(frozen=True)
class ServerRules:
    """The operator's rules: the modes a client may give (``access.modes``) and the whole policies it may choose
    (``listed``, as vLLM reads them: ``rms_norm=disable`` leaves the other ops to vLLM, ``prefer,rms_norm=disable``
    does not). A request without a policy is always allowed."""

    access: Access = dataclasses.field(default_factory=Access)
    listed: tuple[RequestPolicy, ...] = ()

    @classmethod
    def from_env(cls, environ: Any = os.environ) -> ServerRules:
        """The rules of :data:`ALLOW_MODES_VAR` and :data:`ALLOW_POLICY_VAR`; :class:`PolicyError` naming a bad one."""
        modes = environ.get(ALLOW_MODES_VAR)
        texts = [text.strip() for text in environ.get(ALLOW_POLICY_VAR, "").split(";") if text.strip()]
        try:
            access = Access.from_options(modes, [])
        except PolicyError as error:
            raise PolicyError(str(error).replace("--allow-modes", ALLOW_MODES_VAR)) from None
        try:
            listed = tuple(dict.fromkeys(request_policy(text) for text in texts))
        except PolicyError as error:
            raise PolicyError(f"{ALLOW_POLICY_VAR}: {error}") from None
        return cls(access, tuple(found for found in listed if found is not None))

    def refusal(self, policy: RequestPolicy, where: str) -> str | None:
        """Why a client may not choose ``policy`` (given in ``where``), or None if it may."""
        if policy in self.listed or self._by_modes(policy):
            return None
        return f"{where}: policy {str(policy)!r} is not allowed on this server; {self.describe()}"

    def _by_modes(self, policy: RequestPolicy) -> bool:
        entries = [policy.policy.entry_for(op) for op in policy.named]
        if policy.default_given:
            entries.append(policy.policy.default)
        return policy.policy.options == NO_OPTIONS and all(entry in self.access.modes for entry in entries)

    def describe(self) -> str:
        """The allowed set, in words (error messages)."""
        modes = self.access.modes
        by_modes = (
            f"modes {', '.join(map(repr, modes))} for the default and any op (no variants, no options)"
            if modes
            else "no mode by itself"
        )
        listed = "".join(f", {str(policy)!r}" for policy in self.listed)
        return f"allowed: {by_modes}; no policy (vLLM's own choice){listed}"

    def label(self, policy: RequestPolicy | None) -> str:
        """The metrics label of ``policy``: its text if the operator named it (a listed policy, or an allowed mode
        alone), :data:`NO_POLICY` for none, else :data:`~kernelpolicy.serving._access.OTHER` (a bounded set)."""
        if policy is None:
            return NO_POLICY
        alone = policy.default_given and not policy.policy.layers and policy.policy.default in self.access.modes
        return str(policy) if alone or policy in self.listed else OTHER


@functools.cache
def operator_rules() -> ServerRules:
    """This process's rules (read once, from its environment: ``vllm serve``'s API servers inherit it)."""
    return ServerRules.from_env()


class _BadRequestError(Exception):
    """A request the middleware answers with a 400: the message, the parameter, the error kind counted."""

    def __init__(self, message: str, param: str, kind: str) -> None:
        super().__init__(message)
        self.param, self.kind = param, kind


def _header_policy(values: list[bytes], access: Access) -> RequestPolicy | None:
    if not values:
        return None
    try:
        if len(values) > 1:
            raise PolicyError(f"header {HEADER} given {len(values)} times; give it once")
        access.parse(values[0])  # its bounds (length, ASCII, entries, variants) and syntax, errors naming the header
        return request_policy(values[0].decode("ascii"))
    except PolicyError as error:
        raise _BadRequestError(str(error).replace(f"{KEY}=", f"header {HEADER}=", 1), HEADER, "bad_header") from None


def _rewritten(body: bytes, header: RequestPolicy | None, rules_: ServerRules) -> bytes | None:
    """``body`` with the request's policy and salt written in; None where it stays as it is (no policy, or a body
    that is not a JSON object: vLLM answers that itself)."""
    if header is None and b"kernel_policy" not in body and b"cache_salt" not in body and b"\\u" not in body:
        return None  # nothing of ours in it (a key spelled with \u escapes is parsed below)
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    xargs = data.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        return None  # not vLLM's type: its own 400
    given = None if xargs is None else xargs.get(KEY)
    try:
        from_body = request_policy(given)
    except PolicyError as error:
        raise _BadRequestError(str(error).replace(f"{KEY}=", f"{_BODY}=", 1), _BODY, "bad_policy") from None
    if header is not None and from_body is not None and header != from_body:
        raise _BadRequestError(
            f"header {HEADER} {str(header)!r} and the body's {_BODY} {str(from_body)!r} give different policies; "
            "give one of them, or the same policy in both",
            HEADER,
            "policy_conflict",
        )
    policy = header if header is not None else from_body
    salt = data.get("cache_salt")
    if policy is None:
        if isinstance(salt, str) and salt.startswith(SALT_PREFIX):
            raise _BadRequestError(
                f"cache_salt {shown(salt)} starts with {SALT_PREFIX!r}, which kernelpolicy keeps for the salts of "
                "requests that carry a kernel policy; give a salt that does not",
                "cache_salt",
                "reserved_salt",
            )
        return None
    refusal = rules_.refusal(policy, HEADER if header is not None else _BODY)
    if refusal is not None:
        raise _BadRequestError(refusal, HEADER if header is not None else _BODY, "refused_policy")
    text = str(policy)
    data["vllm_xargs"] = {**(xargs or {}), KEY: text}
    return json.dumps(data).encode()


async def _error(send: Callable[[Any], Awaitable[None]], problem: _BadRequestError) -> None:
    """A 400 in vLLM's error shape (``ErrorResponse``)."""
    _metrics.error(problem.kind)
    error = {"message": str(problem)[:2000], "type": "BadRequestError", "param": problem.param, "code": 400}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class PolicyHeaders:
    """ASGI middleware: on :data:`ROUTES`, a POST's policy (header or body) is checked and written into its body.

    :func:`install` adds it to every app ``vllm serve`` builds with kernelpolicy on, inside vLLM's own middleware
    (``--api-key`` is checked first): nothing to add to the command line. Named in ``--middleware
    kernelpolicy.vllm._server.PolicyHeaders`` as well, or with kernelpolicy off, it changes nothing: a request
    passes the first one only, and with the switch off vLLM's processes have no policy to follow.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or path not in ROUTES
            or _SEEN in scope
            or not _switched_on()
        ):
            await self.app(scope, receive, send)
            return
        scope[_SEEN] = True
        rules_ = operator_rules()
        values = [value for name, value in scope["headers"] if name == HEADER.lower().encode()]
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: vLLM sees it so
                await self.app(scope, _replaying([], message, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            header = _header_policy(values, rules_.access)
            found = _rewritten(body, header, rules_)
        except _BadRequestError as problem:
            await _error(send, problem)
            return
        if found is not None:
            body = found
            headers = [(name, value) for name, value in scope["headers"] if name != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replaying([body], None, receive), send)


def _replaying(bodies: list[bytes], last: dict[str, Any] | None, receive: Any) -> Callable[[], Awaitable[Any]]:
    """A ``receive`` that gives the body read (one message), then ``last`` if given, then what the client sends."""
    pending: list[dict[str, Any]] = [{"type": "http.request", "body": b"".join(bodies), "more_body": False}]
    if last is not None:
        pending.append(last)

    async def replayed() -> Any:
        return pending.pop(0) if pending else await receive()

    return replayed


def _switched_on() -> bool:
    from . import installed

    return installed()


# --- counting, where the API server hands a request to the engine ----------------------------------------------


def _counted(generate: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncGenerator[Any, None]]:
    """``AsyncLLM.generate`` that checks a request's policy against the operator's rules (whatever route it came
    by) and counts the request and its tokens under its policy's label."""

    @functools.wraps(generate)
    async def counted_generate(self: Any, prompt: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(sampling_params, "extra_args", None)
        policy = None
        if extra and KEY in extra:
            try:
                policy = request_policy(extra[KEY])
                refusal = None if policy is None else operator_rules().refusal(policy, f"extra_args[{KEY!r}]")
                if refusal is not None:
                    raise PolicyError(refusal)
            except PolicyError as error:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(str(error), parameter=_BODY) from None
        counted = _metrics.enabled()
        label = operator_rules().label(policy)
        if counted:
            _metrics.metrics().requests.labels(label).inc()
        delta = str(getattr(getattr(sampling_params, "output_kind", None), "name", "")) == "DELTA"
        tokens: dict[int, int] = {}
        try:
            async with contextlib.aclosing(generate(self, prompt, sampling_params, *args, **kwargs)) as outputs:
                async for output in outputs:
                    for completion in getattr(output, "outputs", ()):
                        seen = len(completion.token_ids)
                        tokens[completion.index] = tokens.get(completion.index, 0) + seen if delta else seen
                    yield output
        finally:
            if counted:
                _metrics.metrics().tokens.labels(label).inc(sum(tokens.values()))

    return counted_generate


# --- installing ------------------------------------------------------------------------------------------------

#: The module of vLLM's API server whose ``init_entrypoints_middleware`` :func:`install` wraps.
_APP_MODULE: Final = "vllm.entrypoints.launchers.app"


def install() -> None:
    """In a vLLM API server process (``vllm serve`` has imported its app builder): every app it builds gets
    :class:`PolicyHeaders`, and every request handed to the engine is checked and counted. Elsewhere (the engine
    core, the workers, an offline ``LLM``) nothing. The same when called twice. Bad operator rules
    (:data:`ALLOW_MODES_VAR`, :data:`ALLOW_POLICY_VAR`) stop the server at start with :class:`PolicyError`."""
    global _installed
    app_module: Any = sys.modules.get(_APP_MODULE)
    if _installed or app_module is None:
        return
    operator_rules()  # the operator's rules, checked before serving
    _installed = True
    from vllm.v1.engine import async_llm

    init = app_module.init_entrypoints_middleware

    @functools.wraps(init)
    def init_entrypoints_middleware(args: Any, app: Any, supported_tasks: Any, *rest: Any, **kwargs: Any) -> Any:
        if not any(getattr(entry, "cls", None) is PolicyHeaders for entry in app.user_middleware):
            app.add_middleware(PolicyHeaders)  # added first: the innermost, inside vLLM's CORS and --api-key
        return init(args, app, supported_tasks, *rest, **kwargs)

    app_module.init_entrypoints_middleware = init_entrypoints_middleware
    engine: Any = async_llm.AsyncLLM
    engine.generate = _counted(engine.generate)

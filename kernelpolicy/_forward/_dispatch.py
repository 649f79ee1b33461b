"""The per-call decision: kernel forward or original forward. The hot path.

This module owns :func:`decide` (the decision table, a pure function used by
the slow path and by ``explain``) and :func:`make_forward`, which builds the
closure a policy-aware module calls as its ``forward``.

The closure reads the policy once (``DEFAULTS.active._current``, see
``_active``), looks up the layer's mode, and takes a fast exit in the common
cases: ``disable``; a usable kernel under ``prefer`` or ``require``; no
kernel under ``prefer``. Everything else (``verify``, recorded calls, a
tracer, a kernel without backward on a call autograd records) goes to
:meth:`Binding.slow_path`, which applies :func:`decide` and verifies, records,
raises or logs. Nothing on the hot path allocates,
logs, locks or calls ``ContextVar.get`` directly, so TorchDynamo traces it
without a graph break and guards on the policy read.

The decision table (``usable``: eager or a traceable kernel, and not a kernel
without backward on a call autograd records, see :func:`autograd_records`;
a rule is what ``kernel_accepts`` declared for the layer, see ``_rules``):

======= ============= ======== ===================================
mode    kernel bound  usable   path
======= ============= ======== ===================================
disable any           any      original
prefer  no            --       original
prefer  yes           no       original (logged once per reason)
prefer  yes           yes      kernel (if its rule accepts the call,
                               else the original, logged once)
require no            --       KernelUnavailableError
require yes           no       KernelUnavailableError (see below)
require yes           yes      kernel (if its rule accepts the call,
                               else KernelUnavailableError)
verify  --            --       as prefer; when the kernel runs in eager
                               code, the original runs too and the
                               outputs are compared (see ``_verify``);
                               not under a ``torch.func`` transform
                               (there: as prefer, logged once)
======= ============= ======== ===================================

A call that raises (the kernel's error, the original's, a mismatch of
``verify``) is recorded by ``record_calls`` with the path it took and the
exception's class.

Under ``prefer``, a policy with the ``fallback_on`` option turns a kernel's
error of those types into a call of the original forward (counted per module,
recorded, logged once; :meth:`Binding.failed`); with ``max_failures`` the
module stops trying its kernel after that many (its forward becomes ``ruled``,
which asks :meth:`Binding.refused` first) until ``reset_failures``. Eager code
only: a traced program has no exceptions to catch.

One failure is known only when the kernel is called: a custom-op kernel given
DTensor inputs or parameters (tensor or sequence parallelism) for which its op
has no sharding strategy. DTensor raises that ``NotImplementedError`` before
the op computes anything, so in eager code ``prefer`` then runs the original
(logged once) and ``require`` raises :class:`KernelUnavailableError` from it
(:meth:`Binding.unsupported`); any other error of a kernel propagates.

A traced program cannot raise, so under ``torch.compile`` a ``require``
failure first breaks the graph (``torch._dynamo.graph_break`` with the error
message): with ``fullgraph=True`` compilation fails with
``torch._dynamo.exc.Unsupported`` carrying that message; with
``fullgraph=False`` the :class:`KernelUnavailableError` is raised at run time
by the code after the break. It never runs the untraceable kernel silently.
Strict ``torch.export`` traces with TorchDynamo, so it fails as
``fullgraph=True`` does; under non-strict export, fx and jit tracing the
Python code runs, so the error is raised as in eager code.

Nor can a traced program log: TorchDynamo calls ``_failures.log_fallback``
while it traces (the ``traced_fallback`` cell of an untraceable kernel).
"""

from __future__ import annotations

import functools
import inspect
import keyword
import linecache
import logging
import types
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import torch
import torch.compiler as _compiler  # noqa: F401 - read by the generated forwards (TRACING_CHECK)
import torch.fx._symbolic_trace as _fx  # noqa: F401 - read by the generated forwards (TRACING_CHECK)
from torch import is_grad_enabled as _grad  # noqa: F401 - read by the generated forwards
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._context import _state
from .._context._active import DEFAULTS, RECOMPUTED_WITH_GRAD, in_effect  # noqa: F401 - DEFAULTS, in_effect: read by the generated forwards
from .._values._rules import RULES
from .._values._tensors import tensors_in
from ._mixing import Mixed, run_mixed
from ._persisted import checked, persisting  # noqa: F401 - read by the generated forwards
from ._replay import GO_ON  # noqa: F401 - read by the generated forwards

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from .._context._state import ExecutionState
    from .._values._policy import PolicyMode
    from ._replay import Replays

__all__ = ["Dispatched", "Path", "autograd_records", "decide", "forward_variant", "make_forward"]

logger = logging.getLogger("kernelpolicy")

Path = Literal["kernel", "original", "error"]

NO_KERNEL: Final = "no kernel bound"
DISABLED: Final = "disabled by policy"
USABLE: Final = "kernel usable"
VERIFIED: Final = "kernel usable; verified against the original forward"


class Dispatched(Mixed, Protocol):
    """What :func:`make_forward` reads of a binding (``_binding.Binding``, a layer above, satisfies it).

    Besides what a mixed call reads (:func:`run_mixed` gets the binding): the forward's parts.
    """

    @property
    def stopped(self) -> str | None: ...
    @property
    def has_backward(self) -> bool: ...
    @property
    def owner(self) -> type: ...
    @property
    def own(self) -> Any: ...
    @property
    def watched(self) -> type: ...
    @property
    def watched_own(self) -> Any: ...
    @property
    def replays(self) -> Replays: ...
    def slow_path(
        self, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any], state: ExecutionState | None = None
    ) -> Any: ...
    def unsupported(
        self,
        error: NotImplementedError,
        mode: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recorders: tuple[Any, ...] = (),
        reason: str = ...,
    ) -> Any: ...
    def failed(
        self, error: Exception, args: tuple[Any, ...], kwargs: dict[str, Any], recorders: tuple[Any, ...] = ()
    ) -> Any: ...
    def refused(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None: ...
    def patched(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...
    @property
    def traced_fallback(self) -> Callable[[], bool]: ...


def untraceable(state: ExecutionState) -> str:
    return f"kernel cannot be traced under {state} (it does not declare can_torch_compile = True)"


NO_BACKWARD: Final = (
    "kernel has no backward (has_backward = False) and autograd records this call "
    "(grad enabled and a tensor argument or parameter requires grad)"
)
UNVERIFIED_IN_TRANSFORM: Final = "kernel usable; not verified under a torch.func transform (runs as under prefer)"
INELIGIBLE: Final = "kernel does not accept this call"
#: What a ``ruled`` forward passes its slow path under TorchDynamo when the kernel is on (see ``_compiled_mode``).
KERNEL_ON: Final = "kernel on (compiled)"
#: The ``reference`` option's name for the original forward.
ORIGINAL: Final = "original"
FAILED: Final = "kernel raised; the original forward ran (the policy's fallback_on)"


def autograd_records(module: nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> bool:
    """Whether autograd records a call of ``module`` with these arguments.

    Grad mode is enabled and a tensor argument (at any depth of tuples, lists
    and dicts) or a parameter of ``module`` requires grad: the output then
    needs a backward, in train and eval mode alike (``torch.func.grad``'s
    inputs and ``functional_call``'s parameters count, as they require grad
    inside the transform). A kernel without backward must not run such a call.
    Also every call of the forward pass of a reentrant checkpoint taken with
    grad enabled (:func:`kernelpolicy.training.checkpoint`): torch runs it
    under ``no_grad``, but autograd records its recomputation, which must
    take the same path.
    """
    if not torch.is_grad_enabled():
        return not _is_dynamo() and RECOMPUTED_WITH_GRAD.get()
    nested: list[Any] = []
    for value in args:  # the common case first: tensors passed positionally
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (tuple, list, dict)):
            nested.append(value)
    # The parameters of the module and its children (nn.Module.parameters()'s generators cost 6x more).
    for parameter in module._parameters.values():
        if parameter is not None and parameter.requires_grad:
            return True
    if module._modules:  # a kernel layer with children (an MLP, say); norms and activations have none
        children = [child for child in module._modules.values() if child is not None]
        while children:
            child = children.pop()
            for parameter in child._parameters.values():
                if parameter is not None and parameter.requires_grad:
                    return True
            children.extend(grandchild for grandchild in child._modules.values() if grandchild is not None)
    if kwargs:
        nested.append(kwargs)
    return bool(nested) and any(t.requires_grad for t in tensors_in(nested))


def decide(
    mode: PolicyMode,
    *,
    has_kernel: bool,
    can_torch_compile: bool,
    has_backward: bool,
    state: ExecutionState,
    needs_backward: bool,
    refused: str | None = None,
) -> tuple[Path, str]:
    """The path one call takes, and why (``refused``: why the kernel may not run this call, or None).

    >>> decide("prefer", has_kernel=True, can_torch_compile=False, has_backward=True,
    ...        state="compile", needs_backward=False)
    ('original', 'kernel cannot be traced under compile (it does not declare can_torch_compile = True)')
    """
    if mode == "disable":
        return "original", DISABLED
    if not has_kernel:
        reason = NO_KERNEL
    elif state != "eager" and not can_torch_compile:
        reason = untraceable(state)
    elif needs_backward and not has_backward:
        reason = NO_BACKWARD
    elif refused is not None:
        reason = refused
    else:
        return "kernel", VERIFIED if mode == "verify" and state == "eager" else USABLE
    return ("error" if mode == "require" else "original"), reason


# The four forwards, generated once per (variant, signature) with the original forward's own parameters:
# forwarding ``*args, **kwargs`` costs more than the rest of the dispatch together (measured: ~400 ns per call
# on CPython 3.11 here, against ~90 ns for a fixed-arity call). They are compiled with this module's globals, so
# what all layers share (DEFAULTS, torch, the tracer flags) has one source for TorchDynamo: no aliasing guards
# between layers, which cost guard time and are not thread-safe in torch 2.13. What differs per layer is a
# closure cell filled by ``_factory``. Under TorchDynamo (``_is_dynamo()`` folds to a constant there) each body
# reads only what its traced program depends on: whether the kernel is on (``active.kernel_on``: any mode but
# ``disable``) and, where an error can be due, whether it is required (``active.required``; ``"mixed"`` in a
# mixed step's table sends the call to ``mixed``). Dynamo guards on exactly those reads, so policies that spell
# one program differently (``prefer``, ``require`` and ``verify`` on a traceable kernel; ``prefer`` and
# ``disable`` on a layer without kernel; any mode with call recording) share one compiled graph.
_BODIES: dict[str, str] = {
    "without_kernel": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            active = in_effect()
            if {required} == "mixed":  # rows of a policy that requires a kernel: theirs fail, eagerly
                return mixed({pack})
            out = slow("require", {pack}) if {required} else (original(self, {call}) if persisting() or {same} else {patch}(self, {call}))
            return checked(out, active, {name}, "r") if persisting() else out
        mode = {lookup}
        if mode == "prefer" or mode == "disable":
            return (original(self, {call}) if {same} else patched({pack}))
        return slow(mode, {pack})""",
    "always_usable": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            active = in_effect()
            if {kernel_on} == "mixed":
                return mixed({pack})
            out = kernel(self, {call}) if {kernel_on} else (original(self, {call}) if persisting() or {same} else {patch}(self, {call}))
            return checked(out, active, {name}, "k") if persisting() else out
        mode = {lookup}
        if active is not last:
            out = replay(active, {pack})
            if out is not GO_ON:
                return out
        if mode == "prefer" or mode == "require":
            try:
                return kernel(self, {call})
            except NotImplementedError as error:
                return unsupported(error, mode, {pack})
            except Exception as error:
                if mode != "prefer" or not active.policy.fallback_on:
                    raise
                return failed(error, {pack})
        if mode == "disable":
            return (original(self, {call}) if {same} else patched({pack}))
        return slow(mode, {pack})""",
    "general": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            active = in_effect()
            if ({kernel_on} if traceable else {required}) == "mixed":  # untraceable: kernel_on never read (one program)
                return mixed({pack})
            if traceable and {kernel_on}:
                out = slow("require" if {required} else "prefer", {pack})
            elif not traceable and {required}:
                out = slow("require", {pack})
            else:
                if not traceable:  # one program under every mode but require: said while it is traced
                    traced_fallback()
                out = (original(self, {call}) if persisting() or {same} else {patch}(self, {call}))
            return checked(out, active, {name}, "kr") if persisting() else out
        mode = {lookup}
        if active is not last or (not has_backward and _grad()):
            out = replay(active, {pack})
            if out is not GO_ON:
                return out
        if mode == "disable":
            return (original(self, {call}) if {same} else patched({pack}))
        if (mode == "prefer" or mode == "require") and not ({tracing}) and (
            has_backward or not (torch.is_grad_enabled() or RECOMPUTED_WITH_GRAD.get()) or not autograd_records(self, {pack})
        ):
            try:
                return kernel(self, {call})
            except NotImplementedError as error:
                return unsupported(error, mode, {pack})
            except Exception as error:
                if mode != "prefer" or not active.policy.fallback_on:
                    raise
                return failed(error, {pack})
        return slow(mode, {pack})""",
    "ruled": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            active = in_effect()
            if {kernel_on} == "mixed":
                return mixed({pack})
            out = slow(KERNEL_ON, {pack}) if {kernel_on} else (original(self, {call}) if persisting() or {same} else {patch}(self, {call}))
            return checked(out, active, {name}, "krv") if persisting() else out
        mode = {lookup}
        if active is not last or (not has_backward and _grad()):
            out = replay(active, {pack})
            if out is not GO_ON:
                return out
        if mode == "disable":
            return (original(self, {call}) if {same} else patched({pack}))
        if (mode == "prefer" or mode == "require") and not ({tracing}) and (
            has_backward or not (torch.is_grad_enabled() or RECOMPUTED_WITH_GRAD.get()) or not autograd_records(self, {pack})
        ) and refused(self, {pack}) is None:
            try:
                return kernel(self, {call})
            except NotImplementedError as error:
                return unsupported(error, mode, {pack})
            except Exception as error:
                if mode != "prefer" or not active.policy.fallback_on:
                    raise
                return failed(error, {pack})
        return slow(mode, {pack})""",
}
_CELLS = (
    "original, kernel, slow, unsupported, failed, has_backward, traceable, refused, replay, last, owner, own, "
    "watched, watched_own, patched, mixed, traced_fallback"
)
#: No class patched since binding (``Binding.own``, ``watched``); the class is a cell, since kernels >= 0.19 calls
#: a wrapper's forward with another module as ``self``. And, in traced code, the patched forward to call.
_SAME: Final = "(owner.forward is own and watched.forward is watched_own)"
_PATCH: Final = "(owner.forward if owner.forward is not own else watched.forward)"
_FACTORIES: dict[tuple[str, str, str, str, str], Callable[..., Callable[..., Any]]] = {}


def _parameters(function: Callable[..., Any]) -> tuple[str, str, str]:
    """(parameter list, call arguments, ``args, kwargs`` packing) for ``function`` minus ``self``.

    Falls back to ``*args, **kwargs`` for defaults, variadics, or names that
    would clash with the closure's cells.
    """
    star = ("*args, **kwargs", "*args, **kwargs", "args, kwargs")
    try:
        params = list(inspect.signature(function, follow_wrapped=False).parameters.values())[1:]
    except (TypeError, ValueError):
        return star
    reserved = {*_CELLS.replace(" ", "").split(","), *globals(), "self", "active", "mode", "out", "args", "kwargs"}
    for param in params:
        if (
            param.default is not param.empty
            or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
            or param.name in reserved
            or not param.name.isidentifier()
            or keyword.iskeyword(param.name)
        ):
            return star
    decl: list[str] = []
    positional = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    decl += only + (["/"] if only else [])
    decl += [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    decl += (["*"] if keywords else []) + keywords
    call = ", ".join(positional + [f"{k}={k}" for k in keywords])
    pack = "({}), {{{}}}".format("".join(f"{n}, " for n in positional), ", ".join(f"{k!r}: {k}" for k in keywords))
    return ", ".join(decl), call, pack


def forward_source(variant: str, function: Callable[..., Any], layer_name: str) -> str:
    """The source of the forward ``variant`` for a layer whose original forward is ``function``.

    What :func:`make_forward` compiles, and what ``inspect.getsource`` shows
    for a policy-aware module's ``forward`` (docs/design.md prints the three
    variants for ``forward(self, hidden_states)``):

    >>> print(forward_source("without_kernel", lambda self, x: x, "Double"))  # doctest: +NORMALIZE_WHITESPACE
    def make(original, kernel, slow, unsupported, failed, has_backward, traceable, refused, replay, last, owner, own, watched, watched_own, patched, mixed, traced_fallback):
        def forward(self, x):
            active = DEFAULTS.active._current
            if _is_dynamo():
                active = in_effect()
                if active.required.Double == "mixed":  # rows of a policy that requires a kernel: theirs fail, eagerly
                    return mixed((x, ), {})
                out = slow("require", (x, ), {}) if active.required.Double else (original(self, x) if persisting() or (owner.forward is own and watched.forward is watched_own) else (owner.forward if owner.forward is not own else watched.forward)(self, x))
                return checked(out, active, 'Double', "r") if persisting() else out
            mode = active.modes.Double
            if mode == "prefer" or mode == "disable":
                return (original(self, x) if (owner.forward is own and watched.forward is watched_own) else patched((x, ), {}))
            return slow(mode, (x, ), {})
        return forward
    """
    params, call, pack = _parameters(function)
    # The layer's entries in the Active's tables (see _active.Active), by attribute when the name allows.
    plain = layer_name.isidentifier() and not keyword.iskeyword(layer_name) and not layer_name.startswith("__")

    def entry(table: str) -> str:
        return f"active.{table}.{layer_name}" if plain else f"getattr(active.{table}, {layer_name!r})"

    body = _BODIES[variant].format(
        call=call,
        pack=pack,
        tracing=_state.TRACING_CHECK,
        lookup=entry("modes"),
        kernel_on=entry("kernel_on"),
        required=entry("required"),
        name=repr(layer_name),
        same=_SAME,
        patch=_PATCH,
    )
    return f"def make({_CELLS}):\n    def forward(self, {params}):{body}\n    return forward\n"


def _factory(variant: str, function: Callable[..., Any], layer_name: str) -> Callable[..., Callable[..., Any]]:
    params, call, pack = _parameters(function)
    key = (variant, params, call, pack, layer_name)
    found = _FACTORIES.get(key)
    if found is None:
        source = forward_source(variant, function, layer_name)
        filename = f"<kernelpolicy forward {variant} ({params})>"
        namespace: dict[str, Any] = {}
        exec(compile(source, filename, "exec"), globals(), namespace)  # fixed template, checked names
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        found = _FACTORIES.setdefault(key, namespace["make"])
    return found


def forward_variant(binding: Dispatched) -> str:
    """Which of the four forwards ``binding``'s module gets (see :func:`make_forward`). A kernel whose layer has a
    rule (``kernel_accepts``) takes ``ruled``: ``general`` that also asks the rule (:meth:`Binding.refused`)."""
    if binding.kernel is None and not binding.variants:
        return "without_kernel"
    if binding.layer_name in RULES or binding.stopped is not None or binding.variants:
        return "ruled"
    return "always_usable" if binding.can_torch_compile and binding.has_backward else "general"


def make_forward(binding: Dispatched) -> Callable[..., Any]:
    """Build the ``forward`` a policy-aware module calls.

    Four variants (:func:`forward_variant`), chosen once per binding so that each call tests only what can change
    between calls (the policy, the tracer, the autograd state), each with the original forward's parameters.
    """
    variant = forward_variant(binding)
    forward = _factory(variant, binding.original, binding.layer_name)(
        binding.original,
        binding.kernel,
        binding.slow_path,
        binding.unsupported,
        binding.failed,
        binding.has_backward,
        binding.can_torch_compile,
        binding.refused,
        binding.replays.check,
        None,
        binding.owner,
        binding.own,
        binding.watched,
        binding.watched_own,
        binding.patched,
        functools.partial(run_mixed, binding),
        binding.traced_fallback,
    )
    forward.__qualname__ = f"kernelpolicy.{variant}.forward"
    freevars = forward.__code__.co_freevars
    binding.replays.cell = forward.__closure__[freevars.index("last")] if "last" in freevars else None  # type: ignore[index]
    # Bound ahead of time, like the MethodType kernels binds: the module is
    # ``self``, not a closure cell (a cell aliasing the module costs a guard).
    return types.MethodType(forward, binding.module)

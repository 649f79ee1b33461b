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
"""

from __future__ import annotations

import inspect
import keyword
import linecache
import logging
import sys
import types
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, final

import torch
import torch.compiler as _compiler  # noqa: F401 - read by the generated forwards (TRACING_CHECK)
import torch.fx._symbolic_trace as _fx  # noqa: F401 - read by the generated forwards (TRACING_CHECK)
from torch import is_grad_enabled as _grad  # noqa: F401 - read by the generated forwards
from torch.compiler import is_dynamo_compiling as _is_dynamo

from . import _state
from ._active import DEFAULTS, RECOMPUTED_WITH_GRAD, RECORD_SUFFIX, RECORDERS, register_layer_name
from ._compat import DYNAMO_DISABLE_MARK, kernel_repository
from ._errors import KernelMismatchError, KernelUnavailableError, OriginalUnavailableError, unavailable_message
from ._persisted import checked, persisting  # noqa: F401 - read by the generated forwards
from ._policy import DEFAULT_VARIANT, VARIANTS, exception_types, variant_names
from ._replay import GO_ON, Replays  # noqa: F401 - GO_ON: read by the generated forwards
from ._rules import RULES, VARIANT_RULES, KernelRule, parameter_names
from ._verify import tensors_in

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from ._policy import PolicyMode
    from ._state import ExecutionState

__all__ = ["LOCAL_SHARDS", "Binding", "Kernel", "Path", "autograd_records", "decide", "make_forward"]

logger = logging.getLogger("kernelpolicy")

Path = Literal["kernel", "original", "error"]

NO_KERNEL: Final = "no kernel bound"
DISABLED: Final = "disabled by policy"
USABLE: Final = "kernel usable"
VERIFIED: Final = "kernel usable; verified against the original forward"


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


_logged: set[tuple[str, str]] = set()


class Kernel(NamedTuple):
    """A kernel variant bound to a module (``kernelize(..., variant=name)``): called as ``function(module, ...)``."""

    function: Callable[..., Any]
    kernel_class: type | None
    repository: str | None
    can_torch_compile: bool
    has_backward: bool


def kernel_of(function: Callable[..., Any], kernel_class: type | None, repository: str | None) -> Kernel:
    """A :class:`Kernel` with the declarations its kernel layer class makes."""
    return Kernel(
        function,
        kernel_class,
        repository,
        getattr(kernel_class, "can_torch_compile", False) is True,
        getattr(kernel_class, "has_backward", True) is not False,
    )


@final
class Binding:
    """What kernelpolicy knows about one policy-aware module.

    ``kernel`` is called as ``kernel(module, *args, **kwargs)`` (the kernel
    layer's ``forward`` function); ``original`` likewise.
    """

    __slots__ = (
        "can_torch_compile",
        "dropped",
        "dtensor_failure",
        "failures",
        "has_backward",
        "kernel",
        "kernel_class",
        "last_failure",
        "layer_name",
        "module",
        "module_class",
        "module_name",
        "no_original",
        "original",
        "parameters",
        "replays",
        "repository",
        "stopped",
        "variants",
    )

    def __init__(
        self,
        *,
        module: nn.Module,
        module_name: str | None,
        layer_name: str,
        original: Callable[..., Any],
        kernel: Callable[..., Any] | None,
        kernel_class: type | None,
        repository: str | None,
        no_original: str | None = None,
    ) -> None:
        self.module = module
        self.module_name = module_name
        self.layer_name = layer_name
        register_layer_name(layer_name)
        self.module_class = _class_name(module)
        #: Why the module has no original forward (a fused layout), or None; ``original`` then raises that.
        self.no_original = no_original
        if no_original is not None:

            def original(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                raise self.error(no_original)

        self.original = original
        #: The forward's parameter names after ``self``: a rule's refusal names the argument.
        self.parameters = parameter_names(original)
        self.kernel = kernel
        self.kernel_class = kernel_class
        self.repository = repository
        self.can_torch_compile = kernel is not None and getattr(kernel_class, "can_torch_compile", False) is True
        self.has_backward = kernel is None or getattr(kernel_class, "has_backward", True) is not False
        #: The last "no sharding strategy" error of the kernel on DTensor arguments, for ``explain``.
        self.dtensor_failure: str | None = None
        #: The kernel this module had before it was pickled (pickling drops kernels), for ``explain``.
        self.dropped: str | None = None
        #: Failures of the kernel that ``fallback_on`` caught, the last one, and why it is off (``max_failures``).
        self.failures = 0
        self.last_failure: str | None = None
        self.stopped: str | None = None
        #: Kernel variants by name (``kernelize(..., variant=name)``), chosen by a policy entry "kernel:name|...".
        self.variants: dict[str, Kernel] = {}
        #: What the forward recorded for recomputations in backward (activation checkpointing), see ``_replay``.
        self.replays = Replays(self)

    def kernel_name(self) -> str | None:
        """The bound kernel as ``explain`` shows it: its repository and layer when known, else its class; None without."""
        if self.kernel is None:
            return None
        repository = self.repository or kernel_repository(self.module, self.kernel)
        if repository is not None:
            return repository
        if self.kernel_class is not None:
            return f"{self.kernel_class.__module__}.{self.kernel_class.__qualname__}"
        return str(getattr(self.kernel, "__qualname__", self.kernel))

    def decide(
        self, mode: str, state: ExecutionState, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[Path, str]:
        """The path of a call with ``args`` and ``kwargs`` under ``mode`` (a mode, or a variant entry).

        Without them: of a call whose arguments need no grad and that the layer's rule accepts.
        """
        if mode.startswith(VARIANTS):
            path, reason, _, _ = self.choose(mode, state, args, kwargs)
            return path, reason
        flags = {
            "has_kernel": self.kernel is not None,
            "can_torch_compile": self.can_torch_compile,
            "has_backward": self.has_backward,
            "state": state,
            "needs_backward": not self.has_backward and autograd_records(self.module, args, kwargs),
        }
        path, reason = decide(mode, **flags)  # type: ignore[arg-type]
        if path == "kernel" and (self.stopped is not None or args or kwargs):  # asked only if the kernel would run
            refused = self.refused(self.module, args, kwargs or {})
            if refused is not None:
                path, reason = decide(mode, **flags, refused=refused)  # type: ignore[arg-type]
        if reason == NO_KERNEL and self.dropped is not None:
            reason = f"{NO_KERNEL}: {self.dropped} was dropped when the module was pickled (kernelize after loading)"
        if path == "original" and self.no_original is not None:
            return "error", self.no_original
        return path, reason

    def kernel_named(self, name: str) -> Kernel | None:
        """The variant ``name`` (``default``: the kernel bound without a name), or None if not bound."""
        if name == DEFAULT_VARIANT:
            if self.kernel is None:
                return None
            return Kernel(self.kernel, self.kernel_class, self.repository, self.can_torch_compile, self.has_backward)
        return self.variants.get(name)

    def choose(
        self, entry: str, state: ExecutionState, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[Path, str, Callable[..., Any] | None, str | None]:
        """Under a variant entry: the first variant that can run this call (path, reason, its function, its name).

        Else the original: (``"original"``, why each variant cannot, None, None).
        """
        refusals = []
        for name in variant_names(entry):
            kernel = self.kernel_named(name)
            if kernel is None:
                refusals.append(f"{name!r} not bound")
                continue
            path, reason = decide(
                "prefer",
                has_kernel=True,
                can_torch_compile=kernel.can_torch_compile,
                has_backward=kernel.has_backward,
                state=state,
                needs_backward=not kernel.has_backward and autograd_records(self.module, args, kwargs),
            )
            if path == "kernel" and name == DEFAULT_VARIANT and self.stopped is not None:
                path, reason = "original", self.stopped  # the failures counted are the default kernel's
            elif path == "kernel" and (args or kwargs):
                layer_rule, own_rule = RULES.get(self.layer_name), VARIANT_RULES.get((self.layer_name, name))
                refused = self._asked(layer_rule, args, kwargs or {}) or self._asked(own_rule, args, kwargs or {})
                if refused is not None:
                    path, reason = "original", refused
            if path == "kernel":
                where = f" ({kernel.repository})" if kernel.repository else ""
                return "kernel", f"variant {name!r}{where}", kernel.function, name
            refusals.append(f"{name!r}: {reason}")
        return "original", f"no variant can run ({'; '.join(refusals)})", None, None

    def refused(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why the kernel may not run this call (none bound: only variants, or :meth:`blocked`); else None."""
        return NO_KERNEL if self.kernel is None else self.blocked(module, args, kwargs)

    def blocked(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why the kernel may not run this call: stopped after failures, or refused by the layer's rule."""
        if self.stopped is not None:
            return self.stopped
        return self._asked(RULES.get(self.layer_name), args, kwargs)

    def _asked(self, rule: KernelRule | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why ``rule`` refuses this call, as a reason; None without a rule or if it accepts."""
        if rule is None:
            return None
        try:
            why = rule.reject(self.module, args, kwargs, self.parameters)
        except Exception as error:
            if hasattr(error, "add_note"):  # Python >= 3.11; the error itself passes unchanged otherwise
                error.add_note(
                    f"kernelpolicy: raised by the kernel_accepts check of kernel layer {self.layer_name!r} "
                    f"({self.module_class} at {self.module_name!r}), asked before its kernel runs"
                )
            raise
        return None if why is None else f"{INELIGIBLE}: {why}"

    def failed(
        self, error: Exception, args: tuple[Any, ...], kwargs: dict[str, Any], recorders: tuple[Any, ...] = ()
    ) -> Any:
        """The kernel raised ``error`` under ``prefer``: the original forward if the policy's ``fallback_on`` names it.

        Counts the failure; at the policy's ``max_failures`` the module stops trying its kernel (its forward
        is rebuilt to ask :meth:`refused` first) until :func:`kernelpolicy.reset_failures`. An error the
        policy does not name propagates, recorded as the kernel's.
        """
        policy = DEFAULTS.active._current.policy
        if not isinstance(error, exception_types(policy.fallback_on)):
            self._record(recorders, "kernel", USABLE, error)
            raise error
        self.failures += 1
        self.last_failure = f"{type(error).__name__}: {error}"
        limit = policy.max_failures
        if limit is not None and self.failures >= limit and self.stopped is None:
            self.stopped = (
                f"kernel stopped after {self.failures} failures (last: {self.last_failure}); "
                "kernelpolicy.reset_failures(model) tries it again"
            )
            self.module.__dict__["forward"] = make_forward(self)
            self._log_once("stopped", logging.WARNING, f"is off: {self.stopped}")
        else:
            self._log_once("failed", logging.WARNING, f"raised {self.last_failure}; the original forward ran instead")
        return self._run(recorders, "original", f"{FAILED} ({self.last_failure})", self.original, args, kwargs)

    def reset_failures(self) -> None:
        """Forget the kernel's failures; a stopped kernel is tried again."""
        stopped = self.stopped is not None
        self.failures, self.last_failure, self.stopped = 0, None, None
        if stopped:
            self.module.__dict__["forward"] = make_forward(self)

    def slow_path(
        self, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any], state: ExecutionState | None = None
    ) -> Any:
        """Every call the fast exits of the forward closure do not take."""
        if mode == KERNEL_ON:
            mode = self._compiled_mode(args, kwargs)
        recording = mode.endswith(RECORD_SUFFIX)  # traced: a string test, no guard on UNRECORDED (see there)
        if recording:
            mode = mode[: -len(RECORD_SUFFIX)]
        if state is None:
            state = _state.execution_state()
        if mode.startswith(VARIANTS):
            return self._run_variant(mode, state, args, kwargs, recording)
        path, reason = self.decide(mode, state, args, kwargs)
        recorders = RECORDERS.get() if recording and not _is_dynamo() else ()
        if path == "kernel" and state == "eager":
            assert self.kernel is not None
            if reason == VERIFIED and _state.in_transform():
                reason = UNVERIFIED_IN_TRANSFORM
                self._log_once("not verified in transform", logging.WARNING, f"is {reason}")
            try:
                out = self.verify(args, kwargs) if reason == VERIFIED else self.kernel(self.module, *args, **kwargs)
            except NotImplementedError as error:
                return self.unsupported(error, mode, args, kwargs, recorders, reason)
            except Exception as error:
                if mode == "prefer" and DEFAULTS.active._current.policy.fallback_on:
                    return self.failed(error, args, kwargs, recorders)
                self._record(recorders, path, reason, error)
                raise
            except BaseException as error:
                self._record(recorders, path, reason, error)
                raise
            self._record(recorders, path, reason)
            return out
        if path == "error":
            self._record(recorders, path, reason)
        elif path == "kernel":
            return self._run(recorders, path, reason, self.kernel, args, kwargs)  # type: ignore[arg-type]
        else:
            if self.kernel is not None and reason != DISABLED and not _is_dynamo():
                self._log_fallback(reason)
            return self._run(recorders, path, reason, self.original, args, kwargs)
        if _is_dynamo():
            # Constructing or raising an exception in traced code is unsupported;
            # break the graph here so that fullgraph=True fails with this message,
            # and raise from code Dynamo never traces (torch 2.9 traces the code
            # after the break and fails on the raise with an internal error).
            torch._dynamo.graph_break(
                msg=unavailable_message(self.module_name, self.layer_name, self.module_class, reason) + COMPILED_FIX
            )
            _raise_unavailable(self, reason)
        raise self.error(reason)

    def _compiled_mode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The mode of a ``ruled`` forward's call under TorchDynamo with the kernel on, from what the program reads.

        The variant entry if the layer has variants (its own table: recording is not in it), else ``prefer``
        when the kernel runs, and ``require`` or ``prefer`` as ``active.required`` says only when it is
        refused: so ``prefer``, ``require`` and ``verify`` share the program where the kernel runs.
        """
        active = DEFAULTS.active._current
        entry: str = getattr(active.variants, self.layer_name) if self.variants else ""
        if entry:
            return entry
        if self.decide("prefer", "compile", args, kwargs)[0] == "kernel":
            return "prefer"
        return "require" if getattr(active.required, self.layer_name) else "prefer"

    def _run_variant(
        self, entry: str, state: ExecutionState, args: tuple[Any, ...], kwargs: dict[str, Any], recording: bool
    ) -> Any:
        """A call under a variant entry: the first variant that can run it, else the original (logged once).

        With the policy's ``reference`` option, in eager code outside ``torch.func`` transforms, the variant's
        output is compared with the reference's as ``verify`` compares (:meth:`verify`).
        """
        path, reason, function, name = self.choose(entry, state, args, kwargs)
        recorders = RECORDERS.get() if recording and not _is_dynamo() else ()
        if function is not None:
            policy = DEFAULTS.active._current.policy
            if policy.options.reference is not None and state == "eager" and not _state.in_transform():
                compared = lambda module, *a, **k: self.verify(a, k, function, f"variant {name!r}")  # noqa: E731
                return self._run(
                    recorders, path, f"{reason}; verified against {policy.options.reference}", compared, args, kwargs
                )
            if not policy.fallback_on or state != "eager" or _is_dynamo():
                return self._run(recorders, path, reason, function, args, kwargs)
            try:
                out = function(self.module, *args, **kwargs)
            except Exception as error:
                if not isinstance(error, exception_types(policy.fallback_on)):
                    self._record(recorders, path, reason, error)
                    raise
                return self._variant_failed(entry, name, error, state, args, kwargs, recording, recorders)
            self._record(recorders, path, reason)
            return out
        if not _is_dynamo():
            self._log_fallback(reason)
        return self._run(recorders, path, reason, self.original, args, kwargs)

    def _variant_failed(
        self,
        entry: str,
        name: str | None,
        error: Exception,
        state: ExecutionState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recording: bool,
        recorders: tuple[Any, ...],
    ) -> Any:
        """Variant ``name`` raised an error ``fallback_on`` names: the next candidate of ``entry``, else the original."""
        self.failures += 1
        self.last_failure = f"variant {name!r}: {type(error).__name__}: {error}"
        names = variant_names(entry)
        rest = names[names.index(name) + 1 :] if name in names else ()
        following = f"the next of {'|'.join(rest)}" if rest else "the original forward"
        self._log_once(
            f"variant {name} failed", logging.WARNING, f"raised {self.last_failure}; {following} ran instead"
        )
        if rest:
            return self._run_variant(VARIANTS + "|".join(rest), state, args, kwargs, recording)
        return self._run(recorders, "original", f"{FAILED} ({self.last_failure})", self.original, args, kwargs)

    def unsupported(
        self,
        error: NotImplementedError,
        mode: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recorders: tuple[Any, ...] = (),
        reason: str = USABLE,
    ) -> Any:
        """The kernel raised ``error`` before running: the original under ``prefer``, an error under ``require``.

        Only for what is known to fail before the kernel computes anything: a
        custom-op kernel given DTensor inputs or parameters for which its op has
        no sharding strategy (tensor or sequence parallelism). A kernel layer
        declared with :func:`kernelpolicy.distributed.run_on_local_shards` runs
        on the local shards instead, under every mode that asked for the kernel
        (``verify`` does not compare those calls: logged once). Anything else is
        the kernel's own error and propagates unchanged. ``mode`` is a plain
        mode (the fast exits and :meth:`slow_path` strip recording); ``recorders``
        count the path taken (``reason``: why the kernel was called, for a call whose error propagates).
        """
        if not _no_sharding_strategy(error, (args, kwargs, self.module)):
            if mode == "prefer" and DEFAULTS.active._current.policy.fallback_on:
                return self.failed(error, args, kwargs, recorders)
            self._record(recorders, "kernel", reason, error)
            raise error
        self.dtensor_failure = str(error)
        on_local_shards = LOCAL_SHARDS.get(self.layer_name)
        if on_local_shards is not None:
            assert self.kernel is not None
            self._record(recorders, "kernel", ON_LOCAL_SHARDS)
            if mode == "verify":
                self._log_once("not verified", logging.WARNING, "verify does not compare kernels run on local shards")
            return on_local_shards(self.kernel, self.module, args, kwargs)
        reason = f"{NO_SHARDING}: {error}"
        if mode == "require":
            self._record(recorders, "error", NO_SHARDING)
            raise self.error(reason) from error
        self._log_fallback(reason)
        return self._run(recorders, "original", NO_SHARDING, self.original, args, kwargs)

    def _run(
        self,
        recorders: tuple[Any, ...],
        path: Path,
        reason: str,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Call ``forward`` and record the call (with the exception's class when it raises)."""
        if not recorders:
            return forward(self.module, *args, **kwargs)
        try:
            out = forward(self.module, *args, **kwargs)
        except BaseException as error:
            self._record(recorders, path, reason, error)
            raise
        self._record(recorders, path, reason)
        return out

    def _record(self, recorders: tuple[Any, ...], path: Path, reason: str, error: BaseException | None = None) -> None:
        raised = "" if error is None else type(error).__name__
        for recorder in recorders:
            recorder.add(self.module_name, self.layer_name, path, reason, raised)

    def verify(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tested: Callable[..., Any] | None = None,
        tested_name: str = "kernel",
    ) -> Any:
        """Run the reference (on cloned inputs) and the tested kernel; compare; return the tested kernel's output.

        The tested kernel is the module's kernel unless given (a variant); the reference is the original
        forward, or the variant the policy's ``reference`` option names (the original, logged once, where
        this module has no such variant).
        """
        from ._verify import BufferState, clone_tensors, compare

        policy = DEFAULTS.active._current.policy
        kernel = self.kernel if tested is None else tested
        assert kernel is not None
        reference, reference_name = self.original, "the original forward"
        named = policy.options.reference
        if named is not None and named != ORIGINAL:
            found = self.kernel_named(named)
            if found is not None:
                reference, reference_name = found.function, f"variant {named!r}"
            else:
                self._log_once(f"no {named}", logging.WARNING, f"has no variant {named!r}: compared with its original")
        devices = sorted({t.device.index or 0 for t in tensors_in((args, kwargs)) if t.is_cuda})
        buffers = BufferState(self.module)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                expected = reference(self.module, *clone_tensors(args), **clone_tensors(kwargs))
            expected_buffers = clone_tensors(buffers.current()) if buffers else {}
        finally:
            buffers.restore()
        out = kernel(self.module, *args, **kwargs)
        mismatch = compare(out, expected, rtol=policy.rtol, atol=policy.atol)
        if mismatch is None and buffers:
            mismatch = compare(buffers.current(), expected_buffers, rtol=policy.rtol, atol=policy.atol, where="buffers")
        if mismatch is not None:
            error = KernelMismatchError(
                module_name=self.module_name,
                layer_name=self.layer_name,
                module_class=self.module_class,
                where=mismatch.where,
                detail=mismatch.detail,
                max_abs=mismatch.max_abs,
                max_rel=mismatch.max_rel,
                index=mismatch.index,
                tested=tested_name,
                reference=reference_name,
            )
            if policy.on_mismatch == "raise":
                raise error
            if (self.layer_name, "mismatch") not in _logged:
                _logged.add((self.layer_name, "mismatch"))
                logger.warning("%s (logged once per layer)", error)
        return out

    def error(self, reason: str) -> KernelUnavailableError:
        cls = OriginalUnavailableError if reason == self.no_original else KernelUnavailableError
        return cls(
            module_name=self.module_name, layer_name=self.layer_name, module_class=self.module_class, reason=reason
        )

    def _log_fallback(self, reason: str) -> None:
        """Log once per reason that the original ran instead of the bound kernel.

        A warning where the bound kernel cannot run in a whole situation (a tracer, autograd, DTensor, a
        stopped kernel); INFO where a ``kernel_accepts`` rule declined one call, as it was declared to.
        """
        level = logging.INFO if reason.startswith(INELIGIBLE) or reason == NO_KERNEL else logging.WARNING
        self._log_once(reason, level, f"falls back to its original forward: {reason}")

    def _log_once(self, key: str, level: int, what: str) -> None:
        if (self.layer_name, key) not in _logged:
            _logged.add((self.layer_name, key))
            logger.log(
                level, "kernel layer %r (%s at %r) %s", self.layer_name, self.module_class, self.module_name, what
            )


#: What a failing ``require`` under TorchDynamo adds to its message: Dynamo prints it after its own
#: "Call to torch._dynamo.graph_break()" line and before its hint to remove the call, which does not apply.
COMPILED_FIX: Final = (
    ". This graph break is kernelpolicy's `require` failing (not a call to remove): run this layer under "
    "'prefer' to take its original forward when compiled, or bind a kernel that can be traced; with "
    "fullgraph=False the KernelUnavailableError is raised at run time instead"
)
NO_SHARDING: Final = "kernel cannot run on DTensor inputs (its op has no sharding strategy)"
ON_LOCAL_SHARDS: Final = "kernel run on local shards (declared with kernelpolicy.distributed.run_on_local_shards)"
#: Kernel layer name -> how its kernel runs on local shards when its op has no DTensor sharding strategy:
#: ``run(kernel, module, args, kwargs)``. Registered by :func:`kernelpolicy.distributed.run_on_local_shards`.
LOCAL_SHARDS: dict[str, Callable[[Callable[..., Any], nn.Module, tuple[Any, ...], dict[str, Any]], Any]] = {}


def _no_sharding_strategy(error: NotImplementedError, where: tuple[Any, ...]) -> bool:
    """Whether ``error`` is DTensor's "no sharding strategy" for a call that has DTensor arguments or parameters."""
    if "does not have a sharding strategy registered" not in str(error):
        return False
    args, kwargs, module = where
    return has_dtensor(module) or any(_is_dtensor(t) for t in tensors_in((args, kwargs)))


def has_dtensor(module: nn.Module) -> bool:
    """Whether ``module`` has DTensor parameters or buffers of its own."""
    return any(_is_dtensor(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def _is_dtensor(tensor: torch.Tensor) -> bool:
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it is imported
    dtensor = getattr(tensor_module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def _raise_unavailable(binding: Binding, reason: str) -> None:
    raise binding.error(reason)


# The mark ``torch.compiler.disable`` puts on a function: TorchDynamo calls it eagerly
# instead of tracing it. Set directly, since ``torch.compiler.disable`` imports TorchDynamo
# (over a second) at import time. See ``_compat.DYNAMO_DISABLE_MARK``.
setattr(_raise_unavailable, DYNAMO_DISABLE_MARK, True)


def _class_name(module: nn.Module) -> str:
    cls = getattr(type(module), "_kernelpolicy_original", type(module))
    return f"{cls.__module__}.{cls.__qualname__}"


# The four forwards, generated once per (variant, signature) with the original
# forward's own parameters: forwarding ``*args, **kwargs`` costs more than the
# rest of the dispatch together (measured: ~400 ns per call on CPython 3.11
# here, against ~90 ns for a fixed-arity call). They are compiled with this
# module's globals, so what all layers share (DEFAULTS, torch, the tracer
# flags) has one source for TorchDynamo: no aliasing guards between layers,
# which cost guard time and are not thread-safe in torch 2.13. What differs per
# layer is a closure cell filled by ``_factory``.
# Under TorchDynamo (``_is_dynamo()`` folds to a constant there) each body reads
# only what its traced program depends on: whether the kernel is on
# (``active.kernel_on``: any mode but ``disable``) and, where an error can be
# due, whether it is required (``active.required``). Dynamo guards on exactly
# those reads, so policies that spell one program differently (``prefer``,
# ``require`` and ``verify`` on a traceable kernel; ``prefer`` and ``disable`` on
# a layer without kernel; any mode with call recording) share one compiled graph.
_BODIES: dict[str, str] = {
    "without_kernel": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            out = slow("require", {pack}) if {required} else original(self, {call})
            return checked(out, active, {name}, "r") if persisting() else out
        mode = {lookup}
        if mode == "prefer" or mode == "disable":
            return original(self, {call})
        return slow(mode, {pack})""",
    "always_usable": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            out = kernel(self, {call}) if {kernel_on} else original(self, {call})
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
            return original(self, {call})
        return slow(mode, {pack})""",
    "general": """
        active = DEFAULTS.active._current
        if _is_dynamo():
            if traceable and {kernel_on}:
                out = slow("require" if {required} else "prefer", {pack})
            elif not traceable and {required}:
                out = slow("require", {pack})
            else:
                out = original(self, {call})
            return checked(out, active, {name}, "kr") if persisting() else out
        mode = {lookup}
        if active is not last or (not has_backward and _grad()):
            out = replay(active, {pack})
            if out is not GO_ON:
                return out
        if mode == "disable":
            return original(self, {call})
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
            out = slow(KERNEL_ON, {pack}) if {kernel_on} else original(self, {call})
            return checked(out, active, {name}, "krv") if persisting() else out
        mode = {lookup}
        if active is not last or (not has_backward and _grad()):
            out = replay(active, {pack})
            if out is not GO_ON:
                return out
        if mode == "disable":
            return original(self, {call})
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
_CELLS = "original, kernel, slow, unsupported, failed, has_backward, traceable, refused, replay, last"
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
    def make(original, kernel, slow, unsupported, failed, has_backward, traceable, refused, replay, last):
        def forward(self, x):
            active = DEFAULTS.active._current
            if _is_dynamo():
                out = slow("require", (x, ), {}) if active.required.Double else original(self, x)
                return checked(out, active, 'Double', "r") if persisting() else out
            mode = active.modes.Double
            if mode == "prefer" or mode == "disable":
                return original(self, x)
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


def make_forward(binding: Binding) -> Callable[..., Any]:
    """Build the ``forward`` a policy-aware module calls.

    Four variants, chosen once per binding so that each call tests only what
    can change between calls (the policy, the tracer, the autograd state),
    each with the original forward's parameters. A kernel whose layer has a
    rule (``kernel_accepts``) takes ``ruled``: ``general`` that also asks the
    rule (:meth:`Binding.refused`) before the kernel runs.
    """
    if binding.kernel is None and not binding.variants:
        variant = "without_kernel"
    elif binding.layer_name in RULES or binding.stopped is not None or binding.variants:
        variant = "ruled"
    elif binding.can_torch_compile and binding.has_backward:
        variant = "always_usable"
    else:
        variant = "general"
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
    )
    forward.__qualname__ = f"kernelpolicy.{variant}.forward"
    freevars = forward.__code__.co_freevars
    binding.replays.cell = forward.__closure__[freevars.index("last")] if "last" in freevars else None  # type: ignore[index]
    # Bound ahead of time, like the MethodType kernels binds: the module is
    # ``self``, not a closure cell (a cell aliasing the module costs a guard).
    return types.MethodType(forward, binding.module)

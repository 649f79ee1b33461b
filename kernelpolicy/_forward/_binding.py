"""The binding: what kernelpolicy knows about one policy-aware module, and every call its fast exits do not take.

This module owns :class:`Binding` (the module's original forward, its kernel and kernel variants, their
declarations, its failures) and its slow path (:meth:`Binding.slow_path`): the decision of ``_dispatch``
applied with everything the generated forward leaves out (``verify``, recorded calls, tracers, rules,
variants, ``fallback_on``, DTensor's "no sharding strategy"), raising or logging as the mode says. Which
variant runs a call is ``_variants``'; what a kernel's failure does, and the lines logged once, ``_failures``'.
``_aware`` makes a module policy-aware with a binding; ``_dispatch.make_forward`` builds its forward
from it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final, final

import torch
import torch.compiler as _compiler  # noqa: F401 - read by the generated forwards (TRACING_CHECK)
import torch.fx._symbolic_trace as _fx  # noqa: F401 - read by the generated forwards (TRACING_CHECK)
from torch import is_grad_enabled as _grad  # noqa: F401 - read by the generated forwards
from torch.compiler import is_dynamo_compiling as _is_dynamo

from .._compat._attributes import DYNAMO_DISABLE_MARK
from .._compat._kernel_objects import kernel_repository
from .._context import _state
from .._context._active import MIXED, RECORD_SUFFIX, RECORDERS, in_effect, register_layer_name
from .._values._errors import KernelMismatchError, KernelUnavailableError, OriginalUnavailableError, unavailable_message
from .._values._exceptions import exception_types
from .._values._policy import VARIANTS, variant_names
from .._values._rules import RULES, KernelRule, parameter_names
from . import _failures
from ._called import called_name
from ._dispatch import (
    DISABLED,
    FAILED,
    INELIGIBLE,
    KERNEL_ON,
    NO_KERNEL,
    ORIGINAL,
    UNVERIFIED_IN_TRANSFORM,
    VERIFIED,
    Path,
    autograd_records,
    decide,
    forward_variant,
    make_forward,
)
from ._failures import failed, first_time, log_fallback, log_once, reset_failures, unsupported, variant_failed
from ._mixing import run_mixed
from ._persisted import checked, define, persisting  # noqa: F401 - checked, persisting: read by the generated forwards
from ._replay import Replays
from ._variants import Kernel, choose, kernel_named

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from .._context._state import ExecutionState

__all__ = ["BINDING", "ON_CLASS_PATCH", "Binding", "redirect"]

logger = logging.getLogger("kernelpolicy")

#: Where a policy-aware module keeps its :class:`Binding` (``module.__dict__[BINDING]``).
BINDING: Final = "_kernelpolicy"
#: ``rebind(module)``: bind ``module`` again, its class's forward now the original (``_aware`` registers it).
ON_CLASS_PATCH: list[Callable[[nn.Module], None]] = []


def redirect(state: dict[str, Any], old: Any, new: Any) -> None:
    """Point what in a module's ``state`` is the dispatcher ``old``, or its function bound to a copy, at ``new``."""
    for key, value in list(state.items()):
        if getattr(value, "__func__", None) is old.__func__:  # each dispatcher has a function of its own
            state[key] = new


@final
class Binding:
    """What kernelpolicy knows about one policy-aware module.

    ``kernel`` is called as ``kernel(module, *args, **kwargs)`` (the kernel
    layer's ``forward`` function); ``original`` likewise.
    """

    __slots__ = (
        "can_torch_compile",
        "direct_kernel",
        "dispatcher",
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
        "nested",
        "no_original",
        "original",
        "own",
        "owner",
        "parameters",
        "replays",
        "repository",
        "stopped",
        "traced_fallback",
        "variants",
        "watched",
        "watched_own",
        "wrapper",
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
        watched: type | None = None,
        replacing: Binding | None = None,
    ) -> None:
        """Bind ``module``: the binding is stored on it and its forward installed (one call from ``_aware``).

        ``replacing``: the module's binding until now (kernelized again: ``train()``/``eval()``), whose variants
        and other library's wrapper stay, and whose forward is redirected to the new one. ``watched``: see there.
        """
        define()  # the op a persisted program checks its policy with: see _persisted
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
        #: The forward ``_dispatch.make_forward`` built (see :meth:`install`), and the forward another library
        #: assigned around it (accelerate's hooks, a user's wrapper), which ``module.forward`` is while set.
        self.dispatcher: Any = None
        self.wrapper: Any = None
        #: The class's forward when the module was bound: the forward asks whether it is still the class's
        #: (a patch, ``mock.patch.object(cls, "forward", ...)``, replaces it) before it runs the original.
        self.owner: Any = type(module)
        self.own: Any = getattr(self.owner, "forward", None)
        #: And the forward of the class above it that the original comes from (``_aware``'s class forward
        #: stands for it there): a patch there changes it (the module's class itself if not given).
        self.watched: Any = type(module) if watched is None else watched
        self.watched_own: Any = getattr(self.watched, "forward", None)
        #: What the forward recorded for recomputations in backward (activation checkpointing), see ``_replay``.
        self.replays = Replays(self)
        self.nested: bool | None = None  # policy-aware layers inside the module? (asked by a mixed call)
        #: What the traced branch of a forward whose kernel cannot be traced calls: logs why, while traced.
        self.traced_fallback = _failures.traced_fallback(self)
        if replacing is not None:
            self.variants = replacing.variants
            self.wrapper = replacing.wrapper
        module.__dict__[BINDING] = self
        self.install(None if replacing is None else replacing.dispatcher)

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
            path, reason, _, _ = choose(self, mode, state, args, kwargs)
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

    #: A variant by name, and which variant a call under a variant entry takes: ``_variants``' functions.
    kernel_named = kernel_named
    choose = choose

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

    #: When the kernel raises: ``_failures``' functions, as this class's methods (the generated forwards call
    #: ``failed`` and ``unsupported``; :func:`kernelpolicy.reset_failures` calls ``reset_failures``).
    failed = failed
    unsupported = unsupported
    reset_failures = reset_failures

    def install(self, previous: Any = None) -> None:
        """Build the module's forward (after its kernel, rules or failures changed) and put it in place.

        It becomes ``module.forward``, unless another library's wrapper is (:attr:`wrapper`): that stays, and
        what of the module referred to the forward being replaced (``previous``, else this binding's own;
        accelerate's ``_old_forward``, which its hook calls) now refers to the new one.
        """
        old = self.dispatcher if previous is None else previous
        new = self.dispatcher = make_forward(self)
        #: The kernel each eager prefer or require call runs, whatever the call, else None (a mixed call's groups).
        self.direct_kernel = self.kernel if forward_variant(self) == "always_usable" else None
        state = self.module.__dict__
        if self.wrapper is None or "forward" not in state:
            state["forward"] = new
        if old is not None:
            redirect(state, old, new)

    def patched(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The class's forward changed since binding (a patch): bind again with it as the original, and call."""
        for rebind in ON_CLASS_PATCH:
            rebind(self.module)
        return self.module.__dict__[BINDING].dispatcher(*args, **kwargs)

    def has_aware_children(self) -> bool:
        """Whether policy-aware layers sit inside the module (asked once)."""
        if self.nested is None:
            self.nested = any(BINDING in m.__dict__ for m in self.module.modules() if m is not self.module)
        return self.nested

    def slow_path(
        self, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any], state: ExecutionState | None = None
    ) -> Any:
        """Every call the fast exits of the forward closure do not take."""
        if (self.owner.forward is not self.own or self.watched.forward is not self.watched_own) and not (
            _is_dynamo()
        ):  # a class was patched: its original
            return self.patched(args, kwargs)
        if mode == MIXED:  # rows of several policies (a mixed step of continuous batching, see ``_mixing``)
            return run_mixed(self, args, kwargs)
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
                log_once(self, "not verified in transform", logging.WARNING, f"is {reason}")
            try:
                out = self.verify(args, kwargs) if reason == VERIFIED else self.kernel(self.module, *args, **kwargs)
            except NotImplementedError as error:
                return unsupported(self, error, mode, args, kwargs, recorders, reason)
            except Exception as error:
                if mode == "prefer" and in_effect().policy.fallback_on:
                    return failed(self, error, args, kwargs, recorders)
                self._record(recorders, path, reason, error)
                raise
            except BaseException as error:
                self._record(recorders, path, reason, error)
                raise
            self._record(recorders, path, reason)
            return out
        if path == "kernel":
            return self._run(recorders, path, reason, self.kernel, args, kwargs)  # type: ignore[arg-type]
        if path == "original":
            if self.kernel is not None and reason != DISABLED and (_failures.LOGS_WHILE_TRACING or not _is_dynamo()):
                log_fallback(self, reason)  # where TorchDynamo traces too: it calls it then (see there)
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
        refusal = self.error(reason)
        self._record(recorders, path, reason, refusal)  # with the class of the error raised (KernelUnavailableError)
        raise refusal

    def _compiled_mode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The mode of a ``ruled`` forward's call under TorchDynamo with the kernel on, from what the program reads.

        The variant entry if the layer has variants (its own table: recording is not in it), else ``prefer``
        when the kernel runs, and ``require`` or ``prefer`` as ``active.required`` says only when it is
        refused: so ``prefer``, ``require`` and ``verify`` share the program where the kernel runs.
        """
        active = in_effect()
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
        path, reason, function, name = choose(self, entry, state, args, kwargs)
        recorders = RECORDERS.get() if recording and not _is_dynamo() else ()
        if function is not None:
            policy = in_effect().policy
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
                rest = variant_failed(self, name, error, variant_names(entry))
                if rest:
                    return self._run_variant(VARIANTS + "|".join(rest), state, args, kwargs, recording)
                return self._run(recorders, "original", f"{FAILED} ({self.last_failure})", self.original, args, kwargs)
            self._record(recorders, path, reason)
            return out
        if _failures.LOGS_WHILE_TRACING or not _is_dynamo():
            log_fallback(self, reason)  # where TorchDynamo traces too
        return self._run(recorders, path, reason, self.original, args, kwargs)

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
            recorder.add(self.module, self.module_name, self.layer_name, path, reason, raised)

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
        policy = in_effect().policy
        kernel = self.kernel if tested is None else tested
        assert kernel is not None
        reference, reference_name = self.original, "the original forward"
        named = policy.options.reference
        if named is not None and named != ORIGINAL:
            found = kernel_named(self, named)
            if found is not None:
                reference, reference_name = found.function, f"variant {named!r}"
            else:
                log_once(self, f"no {named}", logging.WARNING, f"has no variant {named!r}: compared with its original")
        from ._verify import run_and_compare  # on the first verify call, not in import kernelpolicy (~1 ms)

        out, mismatch = run_and_compare(
            self.module, reference, kernel, args, kwargs, rtol=policy.rtol, atol=policy.atol
        )
        if mismatch is not None:
            error = KernelMismatchError(
                module_name=called_name(self.module, self.module_name),
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
            if first_time(self.layer_name, "mismatch", logging.WARNING):
                logger.warning("%s (logged once per layer)", error)
        return out

    def error(self, reason: str) -> KernelUnavailableError:
        cls = OriginalUnavailableError if reason == self.no_original else KernelUnavailableError
        name = called_name(self.module, self.module_name)
        return cls(module_name=name, layer_name=self.layer_name, module_class=self.module_class, reason=reason)


#: What a failing ``require`` under TorchDynamo adds to its message: Dynamo prints it after its own
#: "Call to torch._dynamo.graph_break()" line and before its hint to remove the call, which does not apply.
COMPILED_FIX: Final = (
    ". This graph break is kernelpolicy's `require` failing (not a call to remove): run this layer under "
    "'prefer' to take its original forward when compiled, or bind a kernel that can be traced; with "
    "fullgraph=False the KernelUnavailableError is raised at run time instead"
)


def _raise_unavailable(binding: Binding, reason: str) -> None:
    raise binding.error(reason)


# ``torch.compiler.disable``'s mark (called eagerly, not traced), set directly: that imports TorchDynamo (over 1 s).
setattr(_raise_unavailable, DYNAMO_DISABLE_MARK, True)


def _class_name(module: nn.Module) -> str:
    cls = getattr(type(module), "_kernelpolicy_original", type(module))
    return f"{cls.__module__}.{cls.__qualname__}"

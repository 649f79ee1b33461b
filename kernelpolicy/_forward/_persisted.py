"""The policy a persisted compiled program was traced under, carried in the program and checked when it runs.

TorchDynamo guards the policy a forward reads, which is what makes a model compiled in this process follow
its caller's scope (see ``_active``). Two ways of persisting a compiled program lose that guard, measured on
torch 2.13 (issue 26):

- ``torch.compile(fn, fullgraph=True).aot_compile(...)`` (and ``load_compiled_function`` in another
  process) drops every guard on a global, the policy's among them;
- Dynamo caching precompile (``TORCH_CACHING_PRECOMPILE=1``) saves the guards, but the process that loads
  them rebuilds their expected values from its own state at load time, so they no longer say which policy
  a program was traced under.

So when TorchDynamo traces a program that will be persisted (:func:`persisting`: caching precompile is on,
or ``aot_compile`` is tracing), the traced branch of the first policy-aware layer of each name in a traced
frame (:func:`_first_check`: layers of one name read the same facts) passes its output through
:func:`checked`, which adds to it the result of the op ``kernelpolicy::policy_check``: a zero scalar whose
arguments are what the branch read (the layer's name, whether its kernel was on, whether it was required,
its variant entry) and the traced policy's text. When the program runs, in this process or in one that
loaded it, the op compares them with the policy in effect in the calling thread and raises
:class:`ArtifactPolicyError` on a mismatch, naming both policies. The layer's output is unchanged (``x +
0``; a negative zero becomes a positive one) and Inductor fuses the addition; the op costs a Python call
(about 5 us on this machine's CPU) per layer name and compiled frame at each call, in persisted programs only.
Programs compiled for this process alone never contain it.

The op is registered with the first :class:`~kernelpolicy._forward._binding.Binding` (:func:`define`), so a
process that builds policy-aware layers can run a loaded program; a process without them cannot (torch names
the missing ``kernelpolicy::policy_check``). Not at import: torch's ``register_fake`` asks ``inspect`` for its
caller's module, a walk of ``sys.modules`` that cost 2-10 ms of ``import kernelpolicy`` on this machine.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any, Final, cast

import torch

from .._compat._attributes import CACHING_PRECOMPILE, DYNAMO_CONSTANT_MARK, DYNAMO_DISABLE_MARK
from .._compat._compat import TRACING_CONTEXT, first_present, lookup
from .._context._active import ensure_env, in_effect, layer_facts
from .._values._errors import ArtifactPolicyError

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._context._active import Active

__all__ = ["OP", "checked", "define", "persisting"]

#: The op's qualified name.
OP: Final = "kernelpolicy::policy_check"
#: Which of the layer's facts a traced branch read: its kernel on (``k``), required (``r``), variant (``v``).
READS: Final = {"k": "kernel on", "r": "kernel required", "v": "variant entry"}


def _check(
    anchor: torch.Tensor, layer: str, reads: str, kernel_on: bool, required: bool, variant: str, traced: str
) -> torch.Tensor:
    """The op's kernel (every device): a zero scalar, or :class:`ArtifactPolicyError` if the policy differs."""
    ensure_env()
    policy = in_effect().policy
    _, now_on, now_required, now_variant = layer_facts(policy, layer)
    was = {"k": kernel_on, "r": required, "v": variant}
    is_ = {"k": now_on, "r": now_required, "v": now_variant}
    differ = [key for key in reads if was[key] != is_[key]]
    if differ:
        what = "; ".join(f"{READS[key]}: {was[key]!r} in the program, {is_[key]!r} now" for key in differ)
        raise ArtifactPolicyError(
            f"kernelpolicy: this compiled program was traced under the policy {traced!r}, and the policy in effect "
            f"is {str(policy)!r}: layer {layer!r} would take the program's path, not this policy's ({what}). A "
            "persisted program (aot_compile, caching precompile) keeps the path of its trace; call it under that "
            "policy, or build one program per policy (kernelpolicy.artifacts)"
        )
    return anchor.new_zeros(())


def _fake(
    anchor: torch.Tensor, layer: str, reads: str, kernel_on: bool, required: bool, variant: str, traced: str
) -> torch.Tensor:
    return anchor.new_empty(())


@functools.cache
def define() -> Any:
    """Register the op and its kernels (once; called by each new binding), and return its library."""
    # Through Any: torch.library's Library is untyped in some releases and typed in others (mypy strict on each).
    torch_library: Any = torch.library
    library = torch_library.Library("kernelpolicy", "FRAGMENT")
    library.define(
        "policy_check(Tensor anchor, str layer, str reads, bool kernel_on, bool required, str variant, str traced)"
        " -> Tensor"
    )
    library.impl("policy_check", _check, "CompositeExplicitAutograd")
    torch_library.register_fake(OP, _fake, lib=library)
    return library


def persisting() -> bool:
    """Whether TorchDynamo is tracing a program that will be persisted (called by Dynamo at trace time).

    Caching precompile is on, or the trace is ``aot_compile``'s (its function is on the stack). TorchDynamo
    calls this function as it is and folds the result into the program without a guard, so a program
    compiled for this process alone does not contain the check.
    """
    config = sys.modules.get("torch._dynamo.config")
    if config is not None and getattr(config, CACHING_PRECOMPILE, False):
        return True
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "aot_compile_fullgraph" and frame.f_globals.get("__name__", "").startswith("torch."):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _traced_policy() -> str:
    """The text of the policy in effect while TorchDynamo traces (called by Dynamo at trace time)."""
    return str(in_effect().policy)


_CHECKED: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()


@functools.cache
def _trace_context() -> Callable[[], Any] | None:
    """TorchDynamo's ``TracingContext.try_get`` (see ``_compat.TRACING_CONTEXT``), or None without it."""
    name = first_present(TRACING_CONTEXT)
    return None if name is None else cast("Callable[[], Any]", lookup(name))


def _first_check(layer: str, reads: str) -> bool:
    """Whether the frame being traced has no check of ``layer`` yet (called by Dynamo at trace time).

    Layers of one name read the same facts of one policy, so a program needs one check per name: a Llama's
    65 RMSNorm calls cost one. Without TorchDynamo's trace context (see ``_compat``), every call is checked.
    """
    try_get = _trace_context()
    context = None if try_get is None else try_get()
    if context is None:
        return True
    seen = _CHECKED.setdefault(context, set())
    if (layer, reads) in seen:
        return False
    seen.add((layer, reads))
    return True


# ``torch._dynamo.assume_constant_result``'s mark, set directly (importing TorchDynamo takes over a second).
for _function in (persisting, _traced_policy, _first_check):
    setattr(_function, DYNAMO_CONSTANT_MARK, True)


def _cannot_carry(layer: str, out: Any) -> None:
    raise ArtifactPolicyError(
        f"kernelpolicy: layer {layer!r} returns a {type(out).__name__}, which cannot carry the check of its policy "
        "into a persisted program (aot_compile, caching precompile): it needs a tensor, or a tuple or list whose "
        "first item is one. Compile without persisting, or export one program per policy (kernelpolicy.artifacts)"
    )


setattr(_cannot_carry, DYNAMO_DISABLE_MARK, True)  # raised at run time, after the graph break


def checked(out: Any, active: Active, layer: str, reads: str) -> Any:
    """``out`` with the policy check added (traced by TorchDynamo; see the module docstring)."""
    if not _first_check(layer, reads):
        return out
    kernel_on = getattr(active.kernel_on, layer) if "k" in reads else False
    required = getattr(active.required, layer) if "r" in reads else False
    variant = getattr(active.variants, layer) if "v" in reads else ""
    first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) and out else None
    if not isinstance(first, torch.Tensor):
        _cannot_carry(layer, out)
        return out
    zero = torch.ops.kernelpolicy.policy_check(
        first.detach(), layer, reads, kernel_on, required, variant, _traced_policy()
    )
    if first is out:
        return out + zero
    if type(out) is tuple:
        return (out[0] + zero, *out[1:])
    if type(out) is list:
        return [out[0] + zero, *out[1:]]
    _cannot_carry(layer, out)  # a tuple or list subclass (a named tuple, say) cannot be rebuilt here
    return out

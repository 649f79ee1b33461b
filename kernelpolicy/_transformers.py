"""transformers' hub-kernel entry points beyond marked layers: what the policy reaches, and what it cannot.

Marked layers (``use_kernel_forward_from_hub``) and kernel functions
(``use_kernelized_func``, ``use_kernel_func_from_hub_with_fallback``) are
policy-aware modules like any other (``_binding``). This module owns the rest:

- **Attention kernels** (:class:`HubAttention`, :func:`attach_attention`), as
  the kernel layer ``attention``, which :func:`kernelpolicy.attach` and
  :func:`kernelpolicy.kernelize` set up for a model whose
  ``config._attn_implementation`` is a hub kernel (``"org/repo[@revision][:function]"``,
  loaded by transformers' ``load_and_register_attn_kernel``).
- **Lazily loaded kernels** (:func:`lazily_loaded`): those transformers' ``lazy_load_kernel``
  loads for quantized and MoE layers, which no policy reaches; ``explain`` lists them.
- **Fused layouts** (:func:`fused_layout`): a kernel fusion's layout class has no
  original forward, so a policy that would run it raises instead of returning ``None``.
- **Functions with a package fallback** (:func:`package_fallback`):
  ``use_kernel_func_from_hub_with_fallback`` runs the hub kernel, else an original package (FLA,
  mamba-ssm) on the devices it supports, else torch. ``disable`` turns every optimized implementation
  off, so it takes the torch path; ``prefer`` without a hub kernel runs what transformers runs without
  one (the package where it runs); ``require`` runs the hub kernel or raises.

transformers resolves attention by name at every call: each attention layer
calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``
and the model builds its masks with
``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``. Both entries of
the kernel's name are replaced, under the same name (so every check
transformers makes on the name still holds):

- the attention function by a :class:`HubAttention` module, a policy-aware
  layer named ``attention`` whose kernel is the hub kernel's function and whose
  original forward is the fallback implementation (``sdpa``, or ``eager`` for
  a model without sdpa support, or the one named);
- the mask builder by a function that asks the same question first
  (:func:`~kernelpolicy.will_use_kernel`), so that in one forward the mask has
  the layout of the implementation that will use it. Under ``verify`` it builds
  both masks, passed on as one :class:`MaskPair` that each side unpacks.

The names are process-wide, as transformers' registries are: every model using
that kernel name follows the policy, per call, thread and task. The decision
is per model forward: keep the policy fixed across a forward (a scope around
the call), as the mask is built before the first attention layer runs.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from torch import nn
from torch.compiler import is_dynamo_compiling as _is_dynamo

from ._attach._attach import ATTACH_HOOKS
from ._attach._aware import NO_ORIGINAL, ORIGINALS, _make_class_aware, binding_of
from ._compat import _compat, _kernel_objects
from ._context._active import RECORD_SUFFIX, UNRECORDED, in_effect
from ._forward import _watch
from ._tell._explain import ROW_SOURCES, UNGOVERNED_SOURCES, Ungoverned
from ._values._errors import PolicyError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._forward._binding import Binding

__all__ = [
    "ATTENTION",
    "HubAttention",
    "MaskPair",
    "attach_attention",
    "fused_layout",
    "hub_attention_of",
    "lazily_loaded",
    "package_fallback",
]

#: The kernel layer name of attention kernels in policies: ``kernel_policy(attention="disable")``.
ATTENTION: Final = "attention"
#: The module name under which ``explain`` and ``record_calls`` show a model's attention kernel.
ROW: Final = "(attention)"

_LOCK = threading.Lock()
#: Kernel name -> its policy-aware attention (one per name, as transformers' registries hold one).
_HUB: dict[str, HubAttention] = {}


class MaskPair(NamedTuple):
    """The masks of both implementations of one mask-builder call (built under ``verify`` only)."""

    kernel: Any
    fallback: Any


class HubAttention(nn.Module):
    """A hub attention kernel as a policy-aware layer: transformers calls it as its attention function.

    ``forward`` (the original) runs the fallback implementation; the kernel
    runs the hub kernel's function (bound at construction, the way
    ``kernels`` binds a layer's kernel).
    """

    kernel_layer_name = ATTENTION

    def __init__(self, name: str, function: Callable[..., Any], mask: Callable[..., Any], fallback: str) -> None:
        super().__init__()
        self.name = name
        self.function = function
        self.kernel_mask = mask
        self.fallback = fallback
        #: transformers' ``ALL_ATTENTION_FUNCTIONS`` and ``ALL_MASK_ATTENTION_FUNCTIONS``.
        self.attention_functions, self.mask_functions = _registries()

    def forward(
        self, module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if isinstance(attention_mask, MaskPair):
            attention_mask = attention_mask.fallback
        if self.fallback == "eager":  # not registered: each modeling file has its own, as the layer's default
            function = getattr(sys.modules[type(module).__module__], "eager_attention_forward")  # noqa: B009
        else:
            function = self.attention_functions[self.fallback]
        if "cu_seq_lens_q" in kwargs:  # a packed batch (continuous batching): transformers built no mask for it
            key, value, attention_mask = _packed_batch(self.name, module, query, key, value, kwargs)
        return function(module, query, key, value, attention_mask, *args, **kwargs)

    def build_mask(self, *args: Any, **kwargs: Any) -> Any:
        """The mask builder registered under the kernel's name: the kernel's or the fallback's, as the call will go."""
        from ._tell._explain import will_use_kernel

        if not will_use_kernel(self):
            return self.mask_functions[self.fallback](*args, **kwargs)
        mask = self.kernel_mask(*args, **kwargs)
        if not _is_dynamo():
            entry = getattr(in_effect().modes, ATTENTION)
            if UNRECORDED.get(entry, entry) == "verify":
                return MaskPair(mask, self.mask_functions[self.fallback](*args, **kwargs))
        return mask

    def registered(self) -> bool:
        """Whether transformers' attention registry still holds this module under its name (the mask builder goes with it)."""
        return self.attention_functions._global_mapping.get(self.name) is self

    def extra_repr(self) -> str:
        return f"{self.name!r}, fallback={self.fallback!r}"


_make_class_aware(HubAttention)


class _HubKernel:
    """The kernel side of :class:`HubAttention` (its ``forward`` is bound as the module's kernel)."""

    can_torch_compile = True  # transformers compiles hub attention kernels (fullgraph included)

    def forward(  # type: ignore[misc]  # called as kernel(hub_attention, ...), as kernels binds a layer's forward
        self: HubAttention,
        module: nn.Module,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if isinstance(attention_mask, MaskPair):
            attention_mask = attention_mask.kernel
        out = self.function(module, query, key, value, attention_mask, *args, **kwargs)
        if not _is_dynamo() and not self.registered():
            # transformers keeps one flash implementation loaded: a call under another kernel name in
            # between reloads this one and registers its raw function again (lazy_import_flash_attention)
            _register(self)
        return out


def _packed_batch(name: str, module: nn.Module, query: Any, key: Any, value: Any, kwargs: dict[str, Any]) -> Any:
    """The fallback's keys, values and mask for a packed batch (a continuous-batching step) under a flash kernel.

    transformers packs the step's requests into one sequence and, for a flash implementation, builds no mask
    for it (the kernel reads the sequence boundaries, ``cu_seq_lens_q``/``cu_seq_lens_k``) and passes
    ``is_causal=True``: sdpa or eager on that alone would attend across requests. Here the mask is each
    request's causal block of the packed batch (its sliding window too), additive, so that rows of padding
    queries attend to nothing real and give no NaN. transformers 5.22 leaves the paged cache to the attention
    function (a ``cache`` argument): it is updated here, as sdpa's own path does, which also puts this layer's
    ``cu_seq_lens_k`` in ``kwargs``; 5.25 updates it before the call. A block table (the fast decode path: the
    flash kernel reads the paged cache itself) leaves no keys for the fallback: refused by name.
    """
    import torch

    if kwargs.get("block_table") is not None:
        raise PolicyError(
            f"attention=disable for the hub attention kernel {name!r} in continuous batching with a block table: "
            "the fallback cannot read the paged KV cache of the fast decode path (max_blocks_per_request=0 in the "
            "ContinuousBatchingConfig turns it off), or a policy that runs the kernel"
        )
    cache = kwargs.pop("cache", None)
    if cache is not None:
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    starts_q, starts_k = kwargs["cu_seq_lens_q"].long(), kwargs["cu_seq_lens_k"].long()
    count = starts_q.numel() - 1
    q_index = torch.arange(query.shape[-2], device=query.device)
    k_index = torch.arange(key.shape[-2], device=query.device)
    q_seq = torch.searchsorted(starts_q[1:], q_index, right=True)  # count: a padding query
    k_seq = torch.searchsorted(starts_k[1:], k_index, right=True)
    seq = q_seq.clamp(max=count - 1)
    lengths_q, lengths_k = starts_q.diff(), starts_k.diff()
    # Each query's place among its request's keys (which end with the step's own tokens), each key's.
    q_place = q_index - starts_q[seq] + lengths_k[seq] - lengths_q[seq]
    k_place = k_index - starts_k[k_seq.clamp(max=count - 1)]
    allowed = (q_seq[:, None] == k_seq[None, :]) & (q_seq < count)[:, None] & (k_place[None, :] <= q_place[:, None])
    window = kwargs.get("sliding_window")
    if window is not None:
        allowed &= q_place[:, None] - k_place[None, :] < window
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    mask.masked_fill_(~allowed, torch.finfo(query.dtype).min)
    kwargs["is_causal"] = False
    return key, value, mask[None, None]


def _registries() -> tuple[Any, Any]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _kernel_name(model: nn.Module) -> str | None:
    """``config._attn_implementation`` of a transformers model when it names a hub kernel, else None."""
    if "transformers" not in sys.modules:  # no transformers model exists unless it is imported
        return None
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not isinstance(name, str):
        return None
    from transformers.integrations.hub_kernels import is_kernel

    return name if is_kernel(name.split("|")[-1]) else None


def attach_attention(model: nn.Module, fallback: str | None = None) -> HubAttention | None:
    """Put the hub attention kernel of ``model`` (if it has one) under the policy; return its :class:`HubAttention`.

    ``fallback`` is the attention implementation the original path runs:
    default ``sdpa``, or ``eager`` where the model does not support sdpa. One
    kernel name has one fallback in a process; naming another is an error.
    Idempotent; after ``set_attn_implementation`` registers the kernel again,
    call it again.
    """
    name = _kernel_name(model)
    if name is None:
        return None
    attention, masks = _registries()
    if fallback is None:
        fallback = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    valid = sorted(key for key in attention.valid_keys() if key not in _HUB)
    if fallback not in valid and fallback != "eager":
        raise PolicyError(f"unknown attention fallback {fallback!r}; valid ones are {', '.join(map(repr, valid))}")
    with _LOCK:
        hub = _HUB.get(name)
        if hub is not None and hub.registered():
            if hub.fallback != fallback:
                raise PolicyError(
                    f"the attention kernel {name!r} already falls back to {hub.fallback!r}, not {fallback!r} "
                    "(one fallback per kernel name in a process, as transformers registers one function per name)"
                )
            return hub
        current = attention._global_mapping.get(name)
        if current is None:
            raise PolicyError(
                f"the attention kernel {name!r} is not registered in transformers' ALL_ATTENTION_FUNCTIONS"
            )
        hub = HubAttention(name, current, masks[name], fallback)
        with _watch.binding_a_kernel():  # kernelpolicy's binding, not one by hand (explain says which)
            hub.forward = types.MethodType(_HubKernel.forward, hub)  # type: ignore[method-assign]
        binding = binding_of(hub)
        assert binding is not None
        binding.module_name = ROW
        binding.repository = name
        _HUB[name] = hub
        _register(hub)
    return hub


def _register(hub: HubAttention) -> None:
    hub.attention_functions.register(hub.name, hub)
    hub.mask_functions.register(hub.name, hub.build_mask)


def hub_attention_of(model: nn.Module) -> tuple[str, HubAttention | None] | None:
    """``(kernel name, its HubAttention)`` of a model with a hub attention kernel; None for the HubAttention
    when the name is registered but not policy-aware (not attached, or registered again since). None without one.
    """
    name = _kernel_name(model)
    if name is None:
        return None
    hub = _HUB.get(name)
    return name, hub if hub is not None and hub.registered() else None


def lazily_loaded() -> tuple[str, ...]:
    """Hub kernels transformers' ``lazy_load_kernel`` has loaded in this process (no policy reaches them).

    Each as ``"name (repo)"``; empty when transformers is not imported.
    """
    if "transformers" not in sys.modules:
        return ()
    loaded = _compat.resolve(_compat.TRANSFORMERS_LAZY_KERNELS) or {}
    repos = _compat.resolve(_compat.TRANSFORMERS_LAZY_REPOS) or {}
    return tuple(
        f"{name} ({repos.get(name, {}).get('repo_id', 'a local package')})"
        for name, module in sorted(loaded.items())
        if isinstance(module, types.ModuleType)
    )


#: The reason of :class:`~kernelpolicy.errors.OriginalUnavailableError` for a fused layout.
FUSED: Final = (
    "a layout of transformers' kernel fusion holds weights and no forward of its own (the fused children are "
    "nn.Identity): keep its kernel (prefer or require), or load the model without that KernelConfig entry"
)


def fused_layout(original: Callable[..., Any]) -> bool:
    """Whether ``original`` (a class's forward) is the no-op stub transformers gives a kernel's layout class.

    ``register_kernel_replacements_and_fusions`` installs it on a ``<Kernel>Layout``
    class without a forward of its own (fusions, ``KernelConfig`` tuple keys, and
    stateful replacements): the layout only holds the weights the kernel reads.
    """
    code = getattr(original, "__code__", None)  # functools.wraps copies the kernel's names, not the code
    return (
        code is not None
        and code.co_name == "_noop_forward"
        and code.co_filename.replace("\\", "/").endswith("transformers/integrations/hub_kernels.py")
    )


def package_fallback(forward: Callable[..., Any], layer_name: str) -> Callable[..., Any] | None:
    """For a function module of ``use_kernel_func_from_hub_with_fallback``: its original, the torch path under disable.

    The function such a module wraps is transformers' ``wrapped`` (the package where it runs, else torch),
    made with ``functools.wraps`` of the torch function; anything else gets None (no replacement).
    """
    if "transformers" not in sys.modules:
        return None
    wrapped = _kernel_objects.kernel_function_of(forward)
    code = getattr(wrapped, "__code__", None)
    torch_function = getattr(wrapped, "__wrapped__", None)
    if (
        code is None
        or torch_function is None
        or code.co_name != "wrapped"  # functools.wraps copied the torch function's names, not its code
        or not code.co_filename.replace("\\", "/").endswith("transformers/integrations/hub_kernels.py")
    ):
        return None

    @functools.wraps(forward)
    def original(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        entry = getattr(in_effect().modes, layer_name)  # the table the forward read
        if entry in ("disable", f"disable{RECORD_SUFFIX}"):  # no lookup in UNRECORDED: it is traced
            return torch_function(*args, **kwargs)
        return forward(module, *args, **kwargs)

    return original


def _on_attach(model: nn.Module, options: Mapping[str, Any]) -> None:
    if "transformers" in sys.modules:  # no transformers model exists unless it is imported
        attach_attention(model, options.get("attention_fallback"))


def _no_original(original: Callable[..., Any]) -> str | None:
    return FUSED if "transformers" in sys.modules and fused_layout(original) else None


def _attention_rows(model: nn.Module) -> list[tuple[str, Binding | Ungoverned]]:
    """``explain``'s row for the model's hub attention kernel, if it has one."""
    found = hub_attention_of(model)
    if found is None:
        return []
    kernel_name, hub = found
    binding = binding_of(hub) if hub is not None else None
    if binding is not None:
        return [(ROW, binding)]
    reason = "not policy-aware (registered by transformers since): call kernelpolicy.attach(model)"
    return [(ROW, Ungoverned(ATTENTION, "transformers ALL_ATTENTION_FUNCTIONS", kernel_name, reason))]


ATTACH_HOOKS.append(_on_attach)
NO_ORIGINAL.append(_no_original)
ORIGINALS.append(package_fallback)
ROW_SOURCES.append(_attention_rows)
UNGOVERNED_SOURCES.append(lazily_loaded)

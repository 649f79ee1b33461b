"""The public way in: :func:`attach`, :func:`kernelize`, the class decorators, rules and failures.

This module owns :func:`attach`, :func:`kernelize`, :func:`use_kernel_forward_from_hub`,
:func:`replace_kernel_forward_from_hub`, :func:`kernel_accepts` (a rule per kernel layer name; see
``_rules``), :func:`reset_failures` and :func:`kernel_modules`. How a module becomes policy-aware is
``_aware``'s.

Features plug in through :data:`ATTACH_HOOKS`, called at the end of :func:`attach` as
``hook(model, options)``, ``options`` being ``attach``'s feature options (``attention_fallback``):
transformers' attention kernels, activation checkpointing. This module imports none of them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import torch
from torch import nn

from .._compat import _attributes, _compat, _kernel_objects, _versions
from .._context._active import ensure_env
from .._forward import _watch
from .._values._errors import PolicyError
from .._values._policy import check_layer_name
from .._values._rules import RULES, VARIANT_RULES, KernelRule
from . import _copies  # noqa: F401 - its members join _aware.CLASS_MEMBERS before anything is made aware
from ._aware import (
    _AWARE_MODULES,
    _VARIANT,
    KERNELIZING,
    _make_aware,
    _make_class_aware,
    _resync,
    binding_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

    from kernels import KernelizeFallback
    from kernels import Mode as KernelsMode

__all__ = [
    "ATTACH_HOOKS",
    "attach",
    "kernel_accepts",
    "kernel_modules",
    "kernelize",
    "replace_kernel_forward_from_hub",
    "reset_failures",
    "use_kernel_forward_from_hub",
]

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)

#: ``hook(model, options)``, called at the end of :func:`attach` (see the module docstring).
ATTACH_HOOKS: list[Callable[[nn.Module, Mapping[str, Any]], None]] = []


def kernel_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every kernel-capable module under ``model`` with its qualified name.

    Layers marked with ``use_kernel_forward_from_hub`` and kernel functions
    attached with ``use_kernelized_func`` (named ``<owner>.<function>``; one
    function module may serve many owners, it is listed once).
    """
    seen: set[int] = set()
    for name, module in model.named_modules():
        if hasattr(type(module), "kernel_layer_name") and id(module) not in seen:
            seen.add(id(module))
            yield name, module
        funcs = module.__dict__.get("_kernel_funcs")
        if isinstance(funcs, dict):
            for func_name, func in funcs.items():
                if isinstance(func, nn.Module) and id(func) not in seen:
                    seen.add(id(func))
                    yield (f"{name}.{func_name}" if name else func_name), func


def attach(model: M, *, attention_fallback: str | None = None) -> M:
    """Make every kernel-capable module of an already kernelized model policy-aware.

    For models kernelized by ``kernels.kernelize`` or by transformers'
    ``use_kernels=True``. A transformers model whose attention is a hub
    kernel (``attn_implementation="org/repo"``) gets it under the policy name
    ``attention``, falling back to ``attention_fallback`` (default ``sdpa``,
    ``eager`` where the model has no sdpa; see ``_transformers``). The
    model's activation checkpointing (transformers', ``checkpoint_wrapper``)
    recomputes under the policy of the forward (see
    :mod:`kernelpolicy.training`). Idempotent; returns ``model``.

    >>> import torch, kernels, kernelpolicy
    >>> @kernels.use_kernel_forward_from_hub("Double")
    ... class Double(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 2 * x
    >>> model = kernelpolicy.attach(torch.nn.Sequential(Double()))
    >>> with kernelpolicy.kernel_policy("require"):
    ...     model(torch.ones(1))
    Traceback (most recent call last):
    ...
    kernelpolicy.KernelUnavailableError: kernel required but unavailable for module '0' (...Double, kernel layer 'Double'): no kernel bound
    """
    ensure_env()
    _watch.watch()
    for name, module in kernel_modules(model):
        _make_aware(module, name or None)
    options = {"attention_fallback": attention_fallback}
    for hook in ATTACH_HOOKS:
        hook(model, options)
    return model


def kernelize(
    model: M,
    *,
    mode: KernelsMode | str,
    device: str | torch.device | None = None,
    use_fallback: bool | KernelizeFallback = True,
    attention_fallback: str | None = None,
    variant: str | None = None,
) -> M:
    """``kernels.kernelize`` with the same arguments, then :func:`attach` (with ``attention_fallback``).

    ``mode`` is kernels' (which kernel variants to bind), not a policy mode:
    a ``kernels.Mode`` or a string such as ``"inference"`` or
    ``"training|torch_compile"``.

    ``variant``: bind the kernels of the mapping in effect as a named variant, next to the kernel each layer
    already has (the ``default`` variant) and the other variants; a policy entry ``"kernel:name|..."``
    chooses among them per call (``kernel_policy(RMSNorm="kernel:liger|default")``: liger where it can run,
    else the default kernel, else the original forward). A layer the mapping has no kernel for loses that
    variant. Kernelizing again without ``variant`` (transformers' ``train()``/``eval()`` do) keeps the variants.
    """
    if variant is not None:
        _check_variant_name(variant)
        attach(model, attention_fallback=attention_fallback)  # every module policy-aware: kernels' bindings land here
    kernels = _versions.kernels()
    _watch.watch()
    before = {id(module): module.__dict__.get(REPO) for _, module in kernel_modules(model)} if variant else {}
    token, named = KERNELIZING.set(True), _VARIANT.set(variant)
    try:
        kernels.kernelize(model, mode=_kernels_mode(mode), device=device, use_fallback=use_fallback)
        # Without a variant, attach (below) takes in a forward kernels popped (binding_of resyncs each module).
        # A variant's must be taken in while it is being bound: "no such variant", not "no kernel".
        if variant is not None:
            for _, module in kernel_modules(model):
                _resync(module)  # a forward kernels popped while no watch was installed
                _variant_repository(module, variant, before.get(id(module)))
    finally:
        _VARIANT.reset(named)
        KERNELIZING.reset(token)
    return attach(model, attention_fallback=attention_fallback)


#: kernels >= 0.19 records the repository of a module's kernel on the module (see ``_attributes``).
REPO: Final = _attributes.KERNEL_REPO_ATTRIBUTE


def _variant_repository(module: nn.Module, variant: str, before: object) -> None:
    """After binding ``variant``: give it the repository kernels recorded, and put back the default kernel's.

    kernels >= 0.19 records the repository of what it bound on the module, which its public
    ``get_kernelized_layers`` reports as the module's kernel: that stays the default kernel's.
    """
    binding = binding_of(module)
    kernel = binding.variants.get(variant) if binding is not None else None
    if binding is not None and kernel is not None:
        recorded = module.__dict__.get(REPO)
        repository = (
            _compat.describe_repository(recorded)
            if recorded is not None and recorded is not before
            else _kernel_objects.cached_layer_repository(kernel.function)
        )
        binding.variants[variant] = kernel._replace(repository=repository)
    if before is None:
        module.__dict__.pop(REPO, None)
    else:
        module.__dict__[REPO] = before


def _check_variant_name(name: object) -> None:
    from .._values._policy import DEFAULT_VARIANT, MODES

    if not isinstance(name, str) or not name.isidentifier() or name in MODES or name == DEFAULT_VARIANT:
        raise PolicyError(
            f"kernelize(variant=...) takes an identifier other than the modes and {DEFAULT_VARIANT!r} "
            f"(the kernel bound without a variant name); got {name!r}"
        )


def _kernels_mode(mode: object) -> KernelsMode:
    Mode = _versions.kernels().Mode  # noqa: N806 - the kernels class

    if isinstance(mode, Mode):
        return mode
    valid = ", ".join(repr(m.name.lower()) for m in Mode if m.name and m.name != "FALLBACK")
    if not isinstance(mode, str) or not mode.strip():
        raise ValueError(f"unknown kernelize mode {mode!r}; give a kernels.Mode or a '|'-joined string of {valid}")
    result = None
    for part in mode.split("|"):
        member = Mode.__members__.get(part.strip().upper())
        if member is None or member is Mode.FALLBACK:
            raise ValueError(f"unknown kernelize mode {part.strip()!r} in {mode!r}; valid modes are {valid}")
        result = member if result is None else result | member
    return result


def use_kernel_forward_from_hub(
    layer_name: str, condition: Callable[[nn.Module], bool] | None = None
) -> Callable[[T], T]:
    """Drop-in for ``kernels.use_kernel_forward_from_hub``: also policy-aware from the start.

    On a class, every instance (and every instance of a subclass) is
    policy-aware as soon as it is constructed, so ``require`` raises even
    before any kernelize. On a function, the returned ``Func`` module is.
    ``condition`` is kernels' (>= 0.17): ``kernelize`` binds a kernel only to
    the instances for which it returns True.
    """
    ensure_env()  # KERNELPOLICY holds from the first forward of a marked class
    mark = _versions.kernels().use_kernel_forward_from_hub(
        layer_name, *_condition(condition, "use_kernel_forward_from_hub")
    )

    def decorator(obj: T) -> T:
        marked = mark(obj)
        if isinstance(marked, nn.Module):
            _make_aware(marked, None)
        elif inspect.isclass(marked):
            _make_class_aware(cast("type", marked))
        return cast("T", marked)

    return decorator


def replace_kernel_forward_from_hub(
    cls: type[nn.Module], layer_name: str, condition: Callable[[nn.Module], bool] | None = None
) -> None:
    """Drop-in for ``kernels.replace_kernel_forward_from_hub`` that also makes ``cls`` policy-aware."""
    ensure_env()
    _versions.kernels().replace_kernel_forward_from_hub(
        cls, layer_name, *_condition(condition, "replace_kernel_forward_from_hub")
    )
    _make_class_aware(cls)


def _condition(condition: Callable[[nn.Module], bool] | None, what: str) -> tuple[Any, ...]:
    """kernels' ``condition`` argument, passed only when given (kernels 0.16 has none)."""
    if condition is None:
        return ()
    if "condition" not in inspect.signature(getattr(_versions.kernels(), what)).parameters:
        from importlib.metadata import version

        raise TypeError(f"{what}(condition=...) needs kernels >= 0.17 (installed: {version('kernels')})")
    return (condition,)


def kernel_accepts(
    layer_name: str,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    devices: Iterable[str] | None = None,
    check: Callable[..., bool | str | None] | None = None,
    variant: str | None = None,
) -> None:
    """Declare which calls the kernels of ``layer_name`` accept; the others take the original forward.

    Checked at every call that would run the kernel: ``dtypes``, the dtypes its floating-point tensor
    arguments may have; ``devices``, the device types of its tensor arguments (``"cuda"``, ``"cpu"``, ...);
    ``check(module, *args, **kwargs)``, True to accept, False or a string saying why not to refuse. Under
    ``prefer`` a refused call runs the original forward (logged once per reason, recorded by
    ``record_calls``); under ``require`` it raises :class:`~kernelpolicy.KernelUnavailableError` naming the
    argument and the rule. Under ``torch.compile`` the rule runs at trace time and its reads (dtypes,
    devices, shapes) are guarded: each outcome is one program, without a graph break; a ``check`` must read
    what tensors are, not what they hold. ``explain`` shows the rule; ``explain(model, *example_args)`` says
    what these inputs get. Replaces the layer's earlier rule, for modules bound before and after; no
    criteria removes it. With ``variant``, the rule is that kernel variant's alone (on top of the layer's):
    under ``"kernel:half|fast"`` a call ``half`` refuses goes to ``fast``. A rule costs an eager call about 1 µs (dtypes; 2 µs with devices and a check,
    against 18 µs for an RMSNorm call on a CPU; a refused call takes the slow path, 6 µs;
    ``benchmarks/eligibility.py``); layers without a rule pay nothing.

    >>> import types, torch, kernelpolicy
    >>> @kernelpolicy.use_kernel_forward_from_hub("HalfOnly")
    ... class HalfOnly(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x
    >>> class PlusOne(torch.nn.Module):  # a kernel layer, as a kernel repository has them
    ...     def forward(self, x):
    ...         return x + 1
    >>> layer = HalfOnly()
    >>> layer.forward = types.MethodType(PlusOne.forward, layer)  # as kernels.kernelize binds it
    >>> kernelpolicy.kernel_accepts("HalfOnly", dtypes=[torch.float16, torch.bfloat16])
    >>> layer(torch.ones(1, dtype=torch.float16)), layer(torch.ones(1))
    (tensor([2.], dtype=torch.float16), tensor([1.]))
    >>> with kernelpolicy.kernel_policy("require"):
    ...     layer(torch.ones(1))
    Traceback (most recent call last):
    ...
    kernelpolicy.KernelUnavailableError: kernel required but unavailable for an unnamed module (...): kernel does not accept this call: argument 0 (x) has dtype torch.float32; the kernel accepts torch.bfloat16, torch.float16
    >>> kernelpolicy.kernel_accepts("HalfOnly")  # accepts every call again
    """
    name = check_layer_name(layer_name)
    if variant is not None:
        _check_variant_name(variant)
    rule = KernelRule(name, _dtypes(dtypes), _devices(devices), _check(check))
    rules: dict[Any, KernelRule] = RULES if variant is None else VARIANT_RULES
    key = name if variant is None else (name, variant)
    if rule.dtypes is None and rule.devices is None and rule.check is None:
        rules.pop(key, None)
    else:
        rules[key] = rule
    for module in list(_AWARE_MODULES.get(name, ())):
        binding = binding_of(module)
        if binding is not None:
            binding.install()


def reset_failures(model: nn.Module) -> None:
    """Forget the kernel failures counted under the ``fallback_on`` option in ``model``; stopped kernels run again.

    With ``kernel_policy("prefer", fallback_on=RuntimeError, max_failures=3)``, a module whose kernel
    raised a ``RuntimeError`` three times stops trying it (``explain`` says so); this turns it back on.
    """
    for _, module in kernel_modules(model):
        binding = binding_of(module)
        if binding is not None:
            binding.reset_failures()


def _dtypes(dtypes: Iterable[torch.dtype] | None) -> frozenset[torch.dtype] | None:
    if dtypes is None:
        return None
    found = frozenset(dtypes) if not isinstance(dtypes, torch.dtype) else frozenset((dtypes,))
    bad = [d for d in found if not isinstance(d, torch.dtype) or not d.is_floating_point]
    if bad or not found:
        raise TypeError(
            f"kernel_accepts(dtypes=...) takes floating-point torch dtypes (torch.float16, torch.bfloat16, "
            f"torch.float32, ...); got {bad[0] if bad else 'none'!r}"
        )
    return found


def _devices(devices: Iterable[str] | None) -> frozenset[str] | None:
    if devices is None:
        return None
    found = frozenset((devices,)) if isinstance(devices, str) else frozenset(devices)
    for device in found:
        try:
            valid = isinstance(device, str) and torch.device(device).type == device
        except RuntimeError:
            valid = False
        if not valid:
            raise ValueError(
                f"kernel_accepts(devices=...) takes device types such as 'cuda', 'cpu', 'mps', 'xpu'; got {device!r}"
            )
    if not found:
        raise ValueError("kernel_accepts(devices=...) got no device type; leave it out to accept every device")
    return found


def _check(check: Callable[..., bool | str | None] | None) -> Callable[..., bool | str | None] | None:
    if check is not None and not callable(check):
        raise TypeError(f"kernel_accepts(check=...) takes a function of (module, *args, **kwargs); got {check!r}")
    return check

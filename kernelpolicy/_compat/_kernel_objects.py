"""What kernelpolicy reads of the objects kernels makes: its function modules and where a bound kernel came from.

Public API first: where the installed kernels has a public way
(``kernels.get_kernelized_layers`` from 0.19, ``kernels.kernelize`` itself),
the helpers here use it, and a private name of ``_compat``'s table
(``_compat.KERNELS_LAYER_CACHE``, read there at each call) is the fallback for
older releases. kernels' function modules (``use_kernel_forward_from_hub`` on
a function) are recognised by their class's ``forward``.
"""

from __future__ import annotations

from typing import Any

from . import _compat, _versions

__all__ = [
    "cached_layer_repository",
    "kernel_function_of",
    "kernel_repository",
    "kernels_loaded_a_layer",
    "routes_by_module",
]


def routes_by_module(forward: Any) -> bool:
    """Whether ``forward`` is the forward of a kernels >= 0.19 function module, which routes a call by ``self``.

    kernels 0.19 gives each model its own wrapper of a kernel function (``use_kernelized_func``); the
    function's global module hands a call to the wrapper of the model running, and under compile calls that
    wrapper's forward with the *global* module as ``self``. Detected by the function's qualified name and the
    routing table it reads (absent before 0.19, whose function modules ignore ``self``).
    """
    code = getattr(forward, "__code__", None)
    return (
        getattr(forward, "__qualname__", "") == "_create_func_module.<locals>.Func.forward"
        and code is not None
        and "_ACTIVE_KERNEL_FUNCS" in code.co_names
    )


def kernel_function_of(forward: Any) -> Any:
    """The function a kernels function module wraps, from its class's ``forward``; None if it is not one.

    ``use_kernel_forward_from_hub`` on a function builds a module class whose ``forward`` calls the function
    through its closure variable ``func`` (kernels 0.16-0.19).
    """
    if getattr(forward, "__qualname__", "") != "_create_func_module.<locals>.Func.forward":
        return None
    import inspect

    return inspect.getclosurevars(forward).nonlocals.get("func")


def kernel_repository(module: Any, kernel: Any) -> str | None:
    """Where the kernel ``kernel`` bound on ``module`` came from (``repo:layer``), or None when unknown.

    kernels >= 0.19: its public ``get_kernelized_layers`` (the module's own entry). Older releases: kernels'
    cache of loaded layers (:func:`cached_layer_repository`).
    """
    public = getattr(_versions.kernels(), "get_kernelized_layers", None)
    if public is None:
        return cached_layer_repository(kernel)
    entry = public(module).layers.get("")
    return _compat.describe_repository(entry.repo) if entry is not None else None


def cached_layer_repository(kernel: Any) -> str | None:
    """The repository of the loaded kernel layer whose ``forward`` is ``kernel`` (``_compat.KERNELS_LAYER_CACHE``)."""
    import inspect

    cache = _compat.resolve(_compat.KERNELS_LAYER_CACHE)
    for repo, layer in dict(cache or {}).items():
        if inspect.getattr_static(layer, "forward", None) is kernel:
            return _compat.describe_repository(repo)
    return None


def kernels_loaded_a_layer() -> bool:
    """Whether kernels has loaded any kernel layer in this process (True when it cannot tell)."""
    public = getattr(_versions.kernels(), "get_loaded_kernels", None)
    if public is not None and public():
        return True
    cache = _compat.resolve(_compat.KERNELS_LAYER_CACHE)
    return True if cache is None else bool(cache)

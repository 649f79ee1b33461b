"""Training: a forward that PyTorch runs again takes the path its first run took.

This module owns :func:`checkpoint` and the replay that :func:`kernelpolicy.attach`
installs on the activation checkpointing it finds in a model.

Activation checkpointing runs a forward twice: once in the forward pass, and
again during ``backward()`` to recompute the activations it did not keep.
``torch.utils.checkpoint`` restores the RNG and autocast state for the
recomputation, but not context variables: the recomputation runs in the
context of whoever calls ``backward()``. A training step written as::

    with kernelpolicy.kernels_disabled():
        loss = model(batch).sum()
    loss.backward()

recomputes under the policy of the forward pass anyway: every policy-aware
forward records, in the forward pass, the policy it ran under, and replays it
when a backward pass recomputes it (``kernelpolicy._forward._replay``). That covers
torch's checkpointing however it is reached (``torch.utils.checkpoint.checkpoint``
in both modes, ``checkpoint_sequential``, ``checkpoint_wrapper``,
``apply_activation_checkpointing``, FSDP2 with activation checkpointing). Where
the forward's path cannot be told or taken again, the recomputation raises
:class:`RecomputationError`, which names the module, both policies and the
fix; the fix is usually this module's :func:`checkpoint`.

:func:`checkpoint` carries the policy in effect when it is called and runs the
checkpointed function under it, in the forward pass and in every
recomputation, whatever scope or thread calls ``backward()``: exact in the
cases the recorded replay cannot tell apart (a reentrant checkpoint whose
module runs again under ``no_grad`` and another policy before ``backward()``).
Call recording is not carried: a recomputation is counted by a
``record_calls()`` active where ``backward()`` runs. A reentrant checkpoint runs
its forward pass under ``no_grad``, where a kernel without backward could run,
and recomputes with grad, where it cannot: taken with grad enabled, the
forward pass gives way to the original too, so both passes take one path.

Also reached by :func:`kernelpolicy.attach` and :func:`kernelpolicy.kernelize`:

- transformers' gradient checkpointing (``model.gradient_checkpointing_enable()``,
  ``Trainer(gradient_checkpointing=True)``, reentrant or not, with ``offload``),
  enabled before or after ``attach``: the checkpoint function transformers
  gives each layer is wrapped, and so is every later one (``attach`` wraps the
  model's ``_set_gradient_checkpointing`` on the instance);
- ``torch.distributed``'s ``checkpoint_wrapper`` modules already in the model.

Under ``torch.compile`` the recomputation is part of the compiled graph (the
policy was read, and guarded, when the forward was traced), so :func:`checkpoint`
calls the checkpoint function as it is.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any, final

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ._attach._attach import ATTACH_HOOKS
from ._compat import _compat
from ._context._active import RECOMPUTED_WITH_GRAD, ensure_env, in_effect
from ._context._scope import kernel_policy
from ._forward._replay import REPLAYING
from ._values._errors import RecomputationError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from torch import nn

    from ._values._policy import Policy

__all__ = ["RecomputationError", "checkpoint"]


def checkpoint(
    function: Callable[..., Any], /, *args: Any, checkpoint_fn: Callable[..., Any] | None = None, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose recomputation takes the path of the forward.

    The same arguments as torch's (``use_reentrant``, ``context_fn``,
    ``preserve_rng_state``, ...). ``checkpoint_fn`` checkpoints with another
    function of the same calling convention (transformers' offloading one, a
    ``functools.partial``); the default is ``torch.utils.checkpoint.checkpoint``.

    >>> import torch, kernelpolicy
    >>> from kernelpolicy.training import checkpoint
    >>> layer = torch.nn.Linear(2, 2)
    >>> x = torch.ones(1, 2, requires_grad=True)
    >>> with kernelpolicy.kernels_disabled():
    ...     y = checkpoint(layer, x, use_reentrant=False)
    >>> y.sum().backward()  # recomputes under kernels_disabled()

    As the ``checkpoint_fn`` of ``checkpoint_wrapper`` (FSDP2's usual set-up)::

        checkpoint_wrapper(block, checkpoint_fn=kernelpolicy.training.checkpoint, use_reentrant=False)
    """
    run: Callable[..., Any] = torch_checkpoint if checkpoint_fn is None else checkpoint_fn
    if _is_dynamo():
        return run(function, *args, **kwargs)
    ensure_env()
    return run(_Carried(function, in_effect().policy, torch.is_grad_enabled()), *args, **kwargs)


@final
class _Carried:
    """``function`` run under ``policy``: what :func:`checkpoint` hands the checkpoint function.

    ``grad``: whether grad was enabled where the checkpoint was taken. A
    reentrant checkpoint runs its forward pass under ``no_grad`` and its
    recomputation with grad; a kernel without backward, which the forward pass
    alone would allow, must give way in both (see ``_dispatch.autograd_records``).
    """

    __slots__ = ("function", "grad", "policy", "scope")

    def __init__(self, function: Callable[..., Any], policy: Policy, grad: bool) -> None:
        self.function = function
        self.policy = policy
        self.grad = grad
        self.scope = kernel_policy(policy)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replaying = REPLAYING.set(True)  # the forwards' own replay stands aside: this one is exact
        try:
            with self.scope:
                if not self.grad or torch.is_grad_enabled():
                    return self.function(*args, **kwargs)
                token = RECOMPUTED_WITH_GRAD.set(True)
                try:
                    return self.function(*args, **kwargs)
                finally:
                    RECOMPUTED_WITH_GRAD.reset(token)
        finally:
            REPLAYING.reset(replaying)

    def __repr__(self) -> str:
        return f"<{self.function!r} under {self.policy}>"


def replaying(checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``checkpoint_fn`` as :func:`checkpoint` calls it (unchanged when it replays already)."""
    if isinstance(checkpoint_fn, functools.partial) and checkpoint_fn.func is checkpoint:
        return checkpoint_fn
    return functools.partial(checkpoint, checkpoint_fn=checkpoint_fn)


# --- what attach reaches ---------------------------------------------------------------------

_TRANSFORMERS_FUNC = "_gradient_checkpointing_func"
_TRANSFORMERS_SETTER = "_set_gradient_checkpointing"
_WRAPPER_MODULE = _compat.CHECKPOINT_WRAPPER.names[0].rpartition(".")[0]  # looked at only once imported


def attach_checkpointing(model: nn.Module, options: Mapping[str, Any] | None = None) -> None:
    """Make the activation checkpointing of ``model`` replay the policy (an ``attach`` hook; see the module docstring)."""
    transformers = "transformers" in sys.modules
    wrapper = _compat.resolve(_compat.CHECKPOINT_WRAPPER) if _WRAPPER_MODULE in sys.modules else None
    if not transformers and wrapper is None:
        return  # neither exists unless imported
    for module in model.modules():
        found = module.__dict__.get(_TRANSFORMERS_FUNC)
        if found is not None:
            module.__dict__[_TRANSFORMERS_FUNC] = replaying(found)
        if transformers and _has_new_style_setter(module):
            module.__dict__[_TRANSFORMERS_SETTER] = _ReplayingSetter(module)
        if wrapper is not None and isinstance(module, wrapper):
            module.checkpoint_fn = replaying(module.checkpoint_fn)


def _has_new_style_setter(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers model whose ``_set_gradient_checkpointing`` takes the function."""
    if _TRANSFORMERS_SETTER in module.__dict__ or not hasattr(module, "gradient_checkpointing_enable"):
        return False
    setter = getattr(type(module), _TRANSFORMERS_SETTER, None)
    return setter is not None and "gradient_checkpointing_func" in inspect.signature(setter).parameters


@final
class _ReplayingSetter:
    """A model's ``_set_gradient_checkpointing``, wrapping the checkpoint function it is given.

    Stored on the instance by :func:`attach_checkpointing`, so that
    ``gradient_checkpointing_enable()`` called after ``attach`` hands every layer
    a replaying checkpoint function too. GroupInputs and pickles with the model.
    """

    __slots__ = ("model",)

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        setter = getattr(type(self.model), _TRANSFORMERS_SETTER)
        bound = inspect.signature(setter).bind(self.model, *args, **kwargs)
        bound.apply_defaults()
        bound.arguments["gradient_checkpointing_func"] = replaying(bound.arguments["gradient_checkpointing_func"])
        return setter(*bound.args, **bound.kwargs)

    def __reduce__(self) -> tuple[object, ...]:
        return (_ReplayingSetter, (self.model,))


ATTACH_HOOKS.append(attach_checkpointing)

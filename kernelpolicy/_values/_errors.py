"""The exceptions kernelpolicy raises, in one place (each reports ``kernelpolicy`` as its module).

- :class:`PolicyError` -- bad policy input, raised where the policy is written
  (a scope, ``set_default_policy``, ``Policy.parse``, the ``KERNELPOLICY``
  variable), never inside a forward.
- :class:`ScopeError` -- a scope used out of order (exited twice, exited in
  another thread or context than it was entered in).
- :class:`KernelUnavailableError` -- ``require`` asked for a kernel that cannot
  run for this call.
- :class:`OriginalUnavailableError` -- the policy sends a layer that has no
  original forward (a fused layout of transformers' kernel fusion) to it.
- :class:`KernelMismatchError` -- ``verify`` found the kernel's output differs
  from the original forward's.
- :class:`PolicyMismatchError` -- ``distributed.check_consistent`` found ranks of a process group
  under different policies or on different paths.

Warnings that point at a mistake go through :func:`warn_at_caller`, so they name the user's line.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import types

__all__ = [
    "ArtifactPolicyError",
    "KernelMismatchError",
    "KernelUnavailableError",
    "OriginalUnavailableError",
    "PolicyError",
    "PolicyMismatchError",
    "RecomputationError",
    "ScopeError",
    "shown",
    "warn_at_caller",
]

#: kernelpolicy's folder, with its subfolders: a frame whose file is inside is kernelpolicy's.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


#: How much of a text an error message quotes (a policy from an HTTP header can be any size).
SHOWN_CHARS = 200


def shown(text: object) -> str:
    """``repr(text)``, cut to :data:`SHOWN_CHARS` characters of a long string."""
    if isinstance(text, str) and len(text) > SHOWN_CHARS:
        return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"
    return repr(text)


def warn_at_caller(message: str, category: type[Warning] = UserWarning, *, also_skip: tuple[str, ...] = ()) -> None:
    """Warn at the first frame outside kernelpolicy and the ``also_skip`` packages: the user's line.

    As pandas' ``find_stack_level`` does: kernelpolicy's frames by their file (a doctest of kernelpolicy
    is the user's code; the generated forwards are kernelpolicy's), the others by their module's top-level
    package.
    """

    def skipped(frame: types.FrameType) -> bool:
        package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        file = frame.f_code.co_filename
        return file.startswith(_PACKAGE) or file.startswith("<kernelpolicy ") or package in also_skip

    level, frame = 1, sys._getframe(0)
    while frame.f_back is not None and skipped(frame):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)


class PolicyError(ValueError):
    """A malformed policy: unknown mode, bad layer name, bad syntax."""

    __module__ = "kernelpolicy"


class ScopeError(RuntimeError):
    """A policy scope was exited out of order or in another context."""

    __module__ = "kernelpolicy.errors"


class PolicyMismatchError(RuntimeError):
    """The ranks of a process group disagree on the policy or on a layer's path (raised on every rank)."""

    __module__ = "kernelpolicy.distributed"


class ArtifactPolicyError(RuntimeError):
    """A persisted compiled program was called under a policy that would take another path than its trace."""

    __module__ = "kernelpolicy.artifacts"


class RecomputationError(RuntimeError):
    """A recomputation in ``backward()`` (activation checkpointing) would take another path than its forward pass."""

    __module__ = "kernelpolicy.training"


class KernelUnavailableError(RuntimeError):
    """``require`` is in effect for a layer whose kernel cannot run now.

    Attributes name the module (``module_name``: its path in the model being called, else the name it was
    attached under, when known; see ``_called``), the kernel layer name, the module class and the reason.
    """

    __module__ = "kernelpolicy"

    def __init__(self, *, module_name: str | None, layer_name: str, module_class: str, reason: str) -> None:
        self.module_name = module_name
        self.layer_name = layer_name
        self.module_class = module_class
        self.reason = reason
        super().__init__(unavailable_message(module_name, layer_name, module_class, reason))

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_unavailable, (self.module_name, self.layer_name, self.module_class, self.reason))


class OriginalUnavailableError(KernelUnavailableError):
    """The policy asks for the original forward of a layer that has none (``disable``, or a kernel that cannot run).

    A fused layout of transformers' kernel fusion (``KernelConfig`` with tuple
    keys) holds the weights its kernel reads and no computation of its own.
    Attributes as :class:`KernelUnavailableError`.
    """

    __module__ = "kernelpolicy.errors"

    def __init__(self, *, module_name: str | None, layer_name: str, module_class: str, reason: str) -> None:
        super().__init__(module_name=module_name, layer_name=layer_name, module_class=module_class, reason=reason)
        where = _named(module_name)
        self.args = (f"no original forward for {where} ({module_class}, kernel layer {layer_name!r}): {reason}",)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_original, (self.module_name, self.layer_name, self.module_class, self.reason))


def _rebuild_original(
    module_name: str | None, layer_name: str, module_class: str, reason: str
) -> OriginalUnavailableError:
    return OriginalUnavailableError(
        module_name=module_name, layer_name=layer_name, module_class=module_class, reason=reason
    )


def _named(module_name: str | None) -> str:
    """How a message names the module: by its name in the model, or says how to give it one."""
    return f"module {module_name!r}" if module_name else "an unnamed module (kernelpolicy.attach(model) names it)"


def unavailable_message(module_name: str | None, layer_name: str, module_class: str, reason: str) -> str:
    """The message of :class:`KernelUnavailableError` (plain function: TorchDynamo traces it)."""
    where = _named(module_name)
    return f"kernel required but unavailable for {where} ({module_class}, kernel layer {layer_name!r}): {reason}"


def _rebuild_unavailable(
    module_name: str | None, layer_name: str, module_class: str, reason: str
) -> KernelUnavailableError:
    return KernelUnavailableError(
        module_name=module_name, layer_name=layer_name, module_class=module_class, reason=reason
    )


class KernelMismatchError(AssertionError):
    """``verify`` found that a kernel's output differs from the original forward's.

    Attributes: ``module_name``, ``layer_name``, ``module_class``, ``tested`` and
    ``reference`` (what was compared: ``kernel`` or a variant, with the original
    forward or a variant), ``where`` (which output, e.g. ``output[0]``), ``max_abs`` and ``max_rel`` (largest absolute
    and relative errors), ``index`` (the first mismatching element) and
    ``detail``.
    """

    __module__ = "kernelpolicy"

    def __init__(
        self,
        *,
        module_name: str | None,
        layer_name: str,
        module_class: str,
        where: str,
        detail: str,
        max_abs: float,
        max_rel: float,
        index: tuple[int, ...] | None,
        tested: str = "kernel",
        reference: str = "the original forward",
    ) -> None:
        self.module_name = module_name
        self.layer_name = layer_name
        self.module_class = module_class
        self.where = where
        self.detail = detail
        self.max_abs = max_abs
        self.max_rel = max_rel
        self.index = index
        self.tested = tested
        self.reference = reference
        module = _named(module_name)
        numbers = f"; max abs error {max_abs:.3g}, max rel error {max_rel:.3g}" if max_abs == max_abs else ""
        at = f", first mismatch at index {index}" if index is not None else ""
        super().__init__(
            f"{tested} output differs from {reference} for {module} ({module_class}, kernel layer "
            f"{layer_name!r}) in {where}: {detail}{numbers}{at}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only constructor: pickle (multiprocessing, pytest-xdist) rebuilds from the attributes.
        return (_rebuild_mismatch, (tuple(getattr(self, name) for name in _MISMATCH_FIELDS),))


_MISMATCH_FIELDS = (
    "module_name",
    "layer_name",
    "module_class",
    "where",
    "detail",
    "max_abs",
    "max_rel",
    "index",
    "tested",
    "reference",
)


def _rebuild_mismatch(values: tuple[object, ...]) -> KernelMismatchError:
    return KernelMismatchError(**dict(zip(_MISMATCH_FIELDS, values, strict=True)))  # type: ignore[arg-type]

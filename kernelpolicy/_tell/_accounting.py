"""Call accounting: how many calls took each path, per module and kernel layer, and why.

This module owns :func:`record_calls` and :class:`CallCounts`.

Recording costs nothing when it is not in use: the forward's fast exits are
untouched. Inside ``record_calls()`` the forwards read the recording
:class:`~kernelpolicy._context._active.Active` of the policy in effect (same policy,
but mode entries the fast exits do not know), so every call takes the slow path, which
decides as usual and adds one count to every active recorder. Recorders
follow the ContextVar rules (per thread, per task); :func:`~kernelpolicy.propagate`
carries them into workers. Calls inside a ``torch.compile``d graph are not
counted: a compiled graph runs no Python. A call that raised is counted too,
with the path it took and the exception's class (column ``raised``): when a
kernel fails, that is the call to look at.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, final

from .._context._active import RECORDERS
from .._context._scope import _recording_scope
from .._values._text import table

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch import nn

__all__ = ["CallCounts", "record_calls"]


@final
class CallCounts:
    """Counts recorded by :func:`record_calls`, per module object, layer name, path, reason and raised.

    ``raised`` is the class name of the exception the call raised, or ``""``. Calls are counted per module
    object and named when reported: relative to ``root`` where a method takes one (``by_module(model)``:
    ``"blocks.0.norm"``), else by the name the module got when it was attached; two modules attached under
    the same name (two models attached separately, then composed) are told apart there as ``norm``,
    ``norm#2``. :func:`~kernelpolicy.explain` looks its rows' calls up by module, wherever the model is
    nested.
    """

    __slots__ = ("_counts", "_lock", "_modules", "_slots")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[int, str, str, str, str]] = collections.Counter()
        self._modules: list[tuple[weakref.ref[nn.Module], str]] = []  # per slot: the module, its attached name
        self._slots: dict[int, int] = {}  # id(module) -> slot

    def add(
        self, module: nn.Module, module_name: str | None, layer_name: str, path: str, reason: str, raised: str = ""
    ) -> None:
        with self._lock:
            slot = self._slots.get(id(module))
            if slot is None or self._modules[slot][0]() is not module:  # new, or another object at that address
                slot = self._slots[id(module)] = len(self._modules)
                self._modules.append((weakref.ref(module), module_name or ""))
            self._counts[(slot, layer_name, path, reason, raised)] += 1

    def for_module(self, module: nn.Module) -> dict[str, int]:
        """``{path: calls}`` of this module object (``{}`` if none was recorded)."""
        result: dict[str, int] = {}
        with self._lock:
            slot = self._slots.get(id(module))
            if slot is None or self._modules[slot][0]() is not module:
                return result
            for (found, _, path, _, _), calls in self._counts.items():
                if found == slot:
                    result[path] = result.get(path, 0) + calls
        return result

    def by_layer(self, root: nn.Module | None = None) -> dict[str, dict[str, int]]:
        """``{layer_name: {path: calls}}``, e.g. ``{"RMSNorm": {"kernel": 5}}`` (with ``root``: its modules' only)."""
        return self._by(1, root)

    def by_module(self, root: nn.Module | None = None) -> dict[str, dict[str, int]]:
        """``{module name: {path: calls}}``: names relative to ``root`` (its modules only), else as attached."""
        return self._by(0, root)

    def _by(self, field: int, root: nn.Module | None) -> dict[str, dict[str, int]]:
        result: dict[str, dict[str, int]] = {}
        for key, calls in self.items(root):
            paths = result.setdefault(key[field], {})
            paths[key[2]] = paths.get(key[2], 0) + calls
        return result

    def items(self, root: nn.Module | None = None) -> list[tuple[tuple[str, str, str, str, str], int]]:
        """Every ((module name, layer name, path, reason, raised), calls), sorted; module names as in :meth:`by_module`."""
        with self._lock:
            counts = list(self._counts.items())
            modules = list(self._modules)
        names = self._names(modules, root)
        return sorted(((names[slot], *rest), calls) for (slot, *rest), calls in counts if slot in names)  # type: ignore[misc]

    @staticmethod
    def _names(modules: list[tuple[weakref.ref[nn.Module], str]], root: nn.Module | None) -> dict[int, str]:
        """Slot -> the name its module is reported under (slots of modules outside ``root`` left out)."""
        if root is not None:
            from .._attach._attach import kernel_modules

            under = {id(module): name for name, module in kernel_modules(root)}
            return {
                slot: under[id(m)]
                for slot, (ref, _) in enumerate(modules)
                if (m := ref()) is not None and id(m) in under
            }
        names: dict[int, str] = {}
        seen: collections.Counter[str] = collections.Counter()
        for slot, (_, name) in enumerate(modules):
            seen[name] += 1
            names[slot] = name if seen[name] == 1 else f"{name}#{seen[name]}"
        return names

    def total(self, layer_name: str | None = None, path: str | None = None, *, raised: bool | None = None) -> int:
        """Calls recorded, optionally only for one layer name, one path, and those that raised (or did not)."""
        return sum(
            calls
            for (_, layer, taken, _, error), calls in self.items()
            if (layer_name is None or layer == layer_name)
            and (path is None or taken == path)
            and (raised is None or bool(error) == raised)
        )

    def __str__(self) -> str:
        items = self.items()
        with_raised = any(key[4] for key, _ in items)
        rows = [
            (module or "(root)", layer, path, reason, *((raised or "-",) if with_raised else ()), str(calls))
            for (module, layer, path, reason, raised), calls in items
        ]
        header = ("module", "layer", "path", "reason", *(("raised",) if with_raised else ()), "calls")
        return "\n".join(table(header, rows))

    def __repr__(self) -> str:
        return f"CallCounts({self.by_layer()!r})"


@contextlib.contextmanager
def record_calls() -> Iterator[CallCounts]:
    """Count, for this block, the calls of policy-aware layers by path and reason.

    >>> import torch, kernelpolicy
    >>> @kernelpolicy.use_kernel_forward_from_hub("Double")
    ... class Double(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 2 * x
    >>> layer = Double()
    >>> with kernelpolicy.record_calls() as calls:
    ...     _ = layer(torch.ones(1))
    >>> calls.by_layer()
    {'Double': {'original': 1}}

    Nested blocks each count what runs inside them.
    """
    counts = CallCounts()
    with _recording_scope(None, recording=True, recorders=(*RECORDERS.get(), counts)):
        yield counts


# The public name (kernelpolicy.types), set after the class is built: a dataclass resolves its annotations
# in the module its __module__ names, which is imported only on demand.
CallCounts.__module__ = "kernelpolicy.types"

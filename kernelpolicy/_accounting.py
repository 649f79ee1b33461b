"""Call accounting: how many calls took each path, per module and kernel layer, and why.

This module owns :func:`record_calls` and :class:`CallCounts`.

Recording costs nothing when it is not in use: the forward's fast exits are
untouched. Inside ``record_calls()`` the forwards read the recording
:class:`~kernelpolicy._active.Active` of the policy in effect (same policy,
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
from typing import TYPE_CHECKING, final

from ._active import RECORDERS
from ._scope import _recording_scope
from ._text import table

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["CallCounts", "record_calls"]


@final
class CallCounts:
    """Counts recorded by :func:`record_calls`, keyed by (module, layer name, path, reason, raised).

    ``raised`` is the class name of the exception the call raised, or ``""``.
    """

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str, str, str, str]] = collections.Counter()

    def add(self, module: str | None, layer_name: str, path: str, reason: str, raised: str = "") -> None:
        with self._lock:
            self._counts[(module or "", layer_name, path, reason, raised)] += 1

    def by_layer(self) -> dict[str, dict[str, int]]:
        """``{layer_name: {path: calls}}``, e.g. ``{"RMSNorm": {"kernel": 5}}``."""
        return self._by(1)

    def by_module(self) -> dict[str, dict[str, int]]:
        """``{module path: {path: calls}}``."""
        return self._by(0)

    def _by(self, field: int) -> dict[str, dict[str, int]]:
        result: dict[str, dict[str, int]] = {}
        for key, calls in self.items():
            paths = result.setdefault(key[field], {})
            paths[key[2]] = paths.get(key[2], 0) + calls
        return result

    def items(self) -> list[tuple[tuple[str, str, str, str, str], int]]:
        """Every ((module, layer name, path, reason, raised), calls), sorted."""
        with self._lock:
            return sorted(self._counts.items())

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

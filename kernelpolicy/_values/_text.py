"""Plain-text tables: how ``explain`` and ``record_calls`` print their rows.

>>> print("\\n".join(table(("layer", "path"), [("RMSNorm", "kernel"), ("SiLU", "original")], rule=True)))
layer    path
-------  --------
RMSNorm  kernel
SiLU     original
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["table"]


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, rule: bool = False) -> list[str]:
    """The lines of ``rows`` under ``header``, columns left-aligned two spaces apart; ``rule`` adds dashes under the header."""
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [header, *([tuple("-" * w for w in widths)] if rule else []), *rows]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]

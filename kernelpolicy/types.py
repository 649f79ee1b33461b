"""The values kernelpolicy's tools return and the literal types of its arguments.

What ``record_calls`` yields (:class:`CallCounts`), what ``explain`` returns (:class:`Explanation`, one
:class:`LayerRow` per layer), what ``warmup`` returns (:class:`WarmupReport`), the modes a policy names
(:data:`PolicyMode`) and the execution states a forward tells apart (:data:`ExecutionState`).

>>> import typing
>>> from kernelpolicy.types import PolicyMode
>>> typing.get_args(PolicyMode)
('prefer', 'disable', 'require', 'verify')
"""

from __future__ import annotations

from ._context._state import ExecutionState
from ._tell._accounting import CallCounts
from ._tell._explain import Explanation, LayerRow
from ._tell._warmup import WarmupReport
from ._values._policy import PolicyMode

__all__ = ["CallCounts", "ExecutionState", "Explanation", "LayerRow", "PolicyMode", "WarmupReport"]

"""Rarer questions about the process: which tracer runs this code, which kernel layer names are bound.

The everyday ones are top-level names: ``kernelpolicy.explain`` (which path each layer takes),
``will_use_kernel`` (whether one layer's kernel runs), ``current_policy`` (the policy in effect).

>>> from kernelpolicy.introspect import execution_state
>>> execution_state()
'eager'
"""

from __future__ import annotations

from ._context._active import known_layers
from ._context._state import execution_state

__all__ = ["execution_state", "known_layers"]

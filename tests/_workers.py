"""Functions for worker processes: importable by name in a spawned child, and without torch (cheap to start)."""

from __future__ import annotations

import kernelpolicy as kp


def policy_text() -> str:
    """The policy in effect where this runs."""
    return str(kp.current_policy())

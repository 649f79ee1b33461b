from __future__ import annotations

import kernelpolicy


def test_default_is_prefer() -> None:
    assert kernelpolicy.current_policy() == kernelpolicy.Policy("prefer")

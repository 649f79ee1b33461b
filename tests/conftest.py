"""Shared fixtures: a clean policy state around every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kernelpolicy import _policy


@pytest.fixture(autouse=True)
def _clean_policy_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no KERNELPOLICY, no explicit default and no active scope."""
    monkeypatch.delenv(_policy.ENV_VAR, raising=False)
    _policy.DEFAULTS.explicit = None
    _policy.reload_env()
    before = _policy.DEFAULTS.policy._current
    yield
    assert _policy.DEFAULTS.policy._current is before, "a test leaked a policy scope"
    _policy.DEFAULTS.explicit = None
    _policy.reload_env()

"""The guides' examples run as written: each page's ``python`` blocks, in order, in one namespace (mktestdocs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mktestdocs import check_md_file

ROOT = Path(__file__).resolve().parent.parent
#: Guides whose every ``python`` block is a complete, runnable example.
RUNNABLE = ["docs/training.md"]


@pytest.mark.parametrize("page", RUNNABLE)
def test_examples_run(page: str) -> None:
    check_md_file(ROOT / page, memory=True)

"""Every ``python`` block of the README and the docs runs as written: each page's blocks in order, in one namespace.

mktestdocs runs the pages; the pytest plugin's page is a test module, run by pytester. ``text`` blocks show
output and layouts; ``bash`` and ``toml`` blocks are commands and settings that CI itself runs
(``.ci/run``) or that the plugin's tests exercise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mktestdocs import check_md_file, grab_code_blocks

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose ``python`` blocks, in order, are one complete, runnable example.
RUNNABLE = [
    "README.md",
    "docs/index.md",
    "docs/own-kernel.md",
    "docs/compile.md",
    "docs/training.md",
    "docs/design.md",
]
#: Pages whose ``python`` blocks are run another way (below).
ELSEWHERE = ["docs/pytest.md", "docs/serving.md", "docs/vllm.md"]  # vllm.md: tests/test_vllm_switch.py


@pytest.mark.parametrize("page", RUNNABLE)
def test_examples_run(page: str) -> None:
    check_md_file(ROOT / page, memory=True)


def test_the_serving_page_runs_where_transformers_has_the_batching_seams() -> None:
    """docs/serving.md needs transformers 5.22 or newer (its continuous batching; older releases tell the user)."""
    pytest.importorskip("transformers")
    from kernelpolicy._compat import _compat

    if not all(_compat.first_present(seam) for seam in _compat.BATCHING):
        pytest.skip("this transformers has not the continuous batching of 5.22-5.25 the page shows")
    check_md_file(ROOT / "docs" / "serving.md", memory=True)


def test_every_page_with_python_is_run() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    with_python = {str(page.relative_to(ROOT)) for page in pages if grab_code_blocks(page.read_text(), lang="python")}
    assert with_python == set(RUNNABLE) | set(ELSEWHERE)


def test_the_pytest_page_is_a_passing_test_module(pytester: pytest.Pytester) -> None:
    [module] = grab_code_blocks((ROOT / "docs" / "pytest.md").read_text(), lang="python")
    pytester.makepyfile(test_from_docs=module)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=3)

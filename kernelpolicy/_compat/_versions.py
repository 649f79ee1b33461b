"""The releases of torch and kernels that kernelpolicy supports, and the check of the installed ones.

This module owns the supported release ranges (:data:`SUPPORTED`, the same
as ``pyproject.toml``'s and the CI matrix's; :data:`TRANSFORMERS_KERNELS` for
transformers, which is not a dependency), checked by :func:`check_torch` when
the layer machinery loads and by :func:`kernels` on first use of ``kernels``:
an older release is refused (:class:`UnsupportedVersionError`), a newer one
than tested warns once (:func:`check_version`) and runs, its private names
looked up by attribute (``_compat``).
"""

from __future__ import annotations

import functools
import importlib
import re
import warnings
from importlib import metadata
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["SUPPORTED", "TRANSFORMERS_KERNELS", "UnsupportedVersionError", "check_torch", "check_version", "kernels"]

#: Release ranges kernelpolicy is tested with, ``(lowest, first untested)``:
#: older releases are refused, newer ones warn once (run the doctor).
SUPPORTED: Final[dict[str, tuple[str, str]]] = {
    "torch": ("2.9", "2.16"),
    "kernels": ("0.16", "0.20"),
}

#: transformers releases tested with kernelpolicy and the kernels releases each one requires or enables its
#: hub kernels with (its own version gate, ``transformers.utils.import_utils.is_kernels_available``). The
#: README's table; transformers is not a dependency of kernelpolicy.
TRANSFORMERS_KERNELS: Final[tuple[tuple[str, str], ...]] = (
    ("5.17", "kernels>=0.16,<0.17"),
    ("5.18-5.19", "kernels>=0.17,<0.18"),
    ("5.20-5.22", "kernels>=0.17.2,<0.18"),
    ("5.23-5.24", "kernels>=0.18,<0.19"),
    ("5.25", "kernels>=0.19.1,<0.20 (a requirement, not only a gate)"),
)


class UnsupportedVersionError(ImportError):
    """An installed release older than kernelpolicy supports."""


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_version(package: str, installed: str) -> None:
    """Refuse a release older than :data:`SUPPORTED` says, warn once for one newer than tested.

    >>> check_version("kernels", "0.12.3")
    Traceback (most recent call last):
    ...
    kernelpolicy._compat._versions.UnsupportedVersionError: kernelpolicy needs kernels>=0.16,<0.20 (tested); installed: kernels 0.12.3. Install a supported release: pip install 'kernels>=0.16,<0.20'
    """
    low, high = SUPPORTED[package]
    spec = f"{package}>={low},<{high}"
    release = _release(installed)
    if release < _release(low):
        raise UnsupportedVersionError(
            f"kernelpolicy needs {spec} (tested); installed: {package} {installed}. "
            f"Install a supported release: pip install '{spec}'"
        )
    if release >= _release(high) and package not in _warned:
        _warned.add(package)
        warnings.warn(
            f"kernelpolicy is tested with {spec}; installed: {package} {installed}. "
            "Run `python -m kernelpolicy doctor` to check this release.",
            stacklevel=3,
        )


_warned: set[str] = set()


def check_torch() -> None:
    """:func:`check_version` for the imported torch."""
    import torch

    check_version("torch", str(torch.__version__))


@functools.cache
def kernels() -> ModuleType:
    """The ``kernels`` package, once its release is checked (a refused release raises at every call)."""
    module = importlib.import_module("kernels")
    check_version("kernels", metadata.version("kernels"))
    return module

"""Every exception kernelpolicy raises, in one place.

The three a user meets most are also top-level names (``kernelpolicy.PolicyError``,
``KernelUnavailableError``, ``KernelMismatchError``); each class is also where its feature lives
(``kernelpolicy.training.RecomputationError``, ...). Each names the bad value or the module, and the fix.

>>> import kernelpolicy
>>> from kernelpolicy.errors import PolicyError
>>> try:
...     kernelpolicy.kernel_policy("fast")
... except PolicyError as error:
...     print(str(error).split(";")[0])
unknown kernel policy mode 'fast' for every layer
"""

from __future__ import annotations

from ._values._errors import (
    ArtifactPolicyError,
    KernelMismatchError,
    KernelUnavailableError,
    OriginalUnavailableError,
    PolicyError,
    PolicyMismatchError,
    RecomputationError,
    ScopeError,
)

__all__ = [
    "ArtifactPolicyError",
    "KernelMismatchError",
    "KernelUnavailableError",
    "OriginalUnavailableError",
    "PolicyError",
    "PolicyMismatchError",
    "RecomputationError",
    "ScopeError",
]

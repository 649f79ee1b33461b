"""What kernelpolicy reads of its neighbours, torch, kernels and transformers: the wing every wing above reaches.

- ``_compat``: the table of the private names kernelpolicy reads (``INTERNALS``) and their lookup, the canary;
- ``_kernel_objects``: what kernelpolicy reads of the objects kernels makes, public API first;
- ``_versions``: the supported releases (``SUPPORTED``) and their check;
- ``_attributes``: the attribute names read or set on other libraries' objects.

Imports: ``_values``.
"""

from ._versions import UnsupportedVersionError  # forwarding name: pickles of earlier builds name it here

__all__ = ["UnsupportedVersionError"]

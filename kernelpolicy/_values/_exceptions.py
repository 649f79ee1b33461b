"""The exceptions a policy's ``fallback_on`` names: resolved and checked where the policy is written.

A name is a builtin exception's (``RuntimeError``) or a dotted path to a class (``torch.OutOfMemoryError``,
``package.module.Outer.InnerError``: the longest importable module prefix, then attributes). A policy that
names an exception that does not resolve, or a class its name does not find again, is a ``PolicyError``
when it is built, so the forward only ever matches against resolved classes (:func:`exception_types`).
"""

from __future__ import annotations

import builtins
import functools
import importlib

from ._errors import PolicyError
from ._errors import shown as _shown

__all__ = ["check_fallback_on", "exception_types"]


_FALLBACK_FORM = (
    "give exception classes or their names, e.g. fallback_on=RuntimeError, (RuntimeError, torch.OutOfMemoryError) "
    "or 'RuntimeError|torch.OutOfMemoryError'"
)


def check_fallback_on(value: object) -> tuple[str, ...]:
    """``fallback_on`` as sorted exception names (builtins bare, others by module and qualified name).

    Every name is resolved here, where the policy is written (a module it names is imported): a policy that
    names an exception it cannot find, or a class that its name does not find again (one defined inside a
    function), cannot be built. So the forward never meets a bad name, and ``str()`` parses back.
    """
    if isinstance(value, str):
        items: list[object] = list(value.split("|")) if value.strip() else []
    elif isinstance(value, type):
        items = [value]
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        raise PolicyError(f"fallback_on: {_FALLBACK_FORM}; got {_shown(value)}")
    names = set()
    for item in items:
        if isinstance(item, type):
            if not issubclass(item, Exception):
                raise PolicyError(f"fallback_on: {item.__name__} is not an Exception subclass; {_FALLBACK_FORM}")
            name = item.__name__ if item.__module__ == "builtins" else f"{item.__module__}.{item.__qualname__}"
            if _resolved(name) is not item:
                raise PolicyError(
                    f"fallback_on: {item.__qualname__} cannot be found again by its name {name!r} (defined inside "
                    "a function?); a policy names its exceptions: define the class at module level"
                )
        elif isinstance(item, str) and all(part.isidentifier() for part in item.strip().split(".")):
            name = item.strip()
            found = _resolved(name)
            if found is None:
                where = "a built-in exception" if "." not in name else "an importable module's attribute"
                raise PolicyError(f"fallback_on: {_shown(name)} is not {where}; {_FALLBACK_FORM}")
            if not _is_exception(found):
                raise PolicyError(f"fallback_on: {_shown(name)} is not an Exception subclass; {_FALLBACK_FORM}")
        else:
            raise PolicyError(f"fallback_on: {_shown(item)} is not an exception class or name; {_FALLBACK_FORM}")
        names.add(name)
    return tuple(sorted(names))


def _resolved(name: str) -> object | None:
    """The object ``name`` names: a builtin, or an attribute path under the longest importable module prefix."""
    parts = name.split(".")
    if len(parts) == 1:
        return getattr(builtins, name, None)
    for split in range(len(parts) - 1, 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                value = getattr(value, attribute)
        except AttributeError:
            return None
        return value
    return None


def _is_exception(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, Exception)


@functools.cache
def exception_types(names: tuple[str, ...]) -> tuple[type[Exception], ...]:
    """The classes ``fallback_on`` names (resolved and checked when the policy was written)."""
    found = [_resolved(name) for name in names]
    return tuple(value for value in found if _is_exception(value))  # type: ignore[misc]

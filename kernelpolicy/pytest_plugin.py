"""pytest plugin: run tests under a kernel policy.

Registered as the ``pytest11`` entry point ``kernelpolicy``, so it is active
wherever kernelpolicy is installed. This module owns:

- the marker ``@pytest.mark.kernel_policy(mode=None, /, **layers)``, with the
  arguments of :class:`kernelpolicy.kernel_policy`; markers of a module, a
  class and a function nest outer to inner (the marker closest to the test
  innermost; of stacked decorators, the top one is outermost, as stacked
  ``@kernel_policy`` decorators would be);
- the option ``--kernel-policy=TEXT`` and the ini option ``kernel_policy``
  (used when the command-line option is absent): the syntax of
  :meth:`kernelpolicy.Policy.parse`, read as a scope's arguments (a bare mode
  names every layer, ``Layer=mode`` entries name only themselves, the rest is
  the process default), applied to every test of the run as the outermost
  scope, outside the markers;
- the fixtures ``kernelpolicy`` (the module) and ``kernel_policy_in_effect``
  (:func:`kernelpolicy.current_policy` as the test sees it).

How a test's scopes are held: a ``pytest_runtest_setup`` wrapper enters them
before any fixture of the test is set up, and a ``pytest_runtest_teardown``
wrapper exits them after every fixture has been torn down. pytest runs setup,
call and teardown one after the other in the same thread and context, so the
test function and the setup and teardown of its fixtures all see the policy,
including fixtures that hold scopes of their own across ``yield`` (they nest
inside). Both wrappers are ``trylast``, the innermost wrappers: they enclose
every non-wrapper implementation (skip evaluation, fixture setup and
teardown), and a bad marker raising before the setup wrapper yields leaves
the outer wrappers (logging, capture) in the state their teardown expects.
Markers are read at setup, not at collection. A test with no marker and no
run-wide option gets no scope at all. The kernel variants that the run-wide
option and the markers name are checked once the fixtures have run (they may
bind them), before the test is called: a variant bound nowhere in the process
by then fails the test, naming the option or marker. Module- and session-scoped fixtures set
up (or torn down) during a test's setup (or teardown) see that test's policy;
one that holds a scope of its own across tests would be exited out of order
and is reported as a :class:`~kernelpolicy.errors.ScopeError` at teardown.
Bad marker arguments make that test error at setup with the
:class:`~kernelpolicy.PolicyError` message; a bad ``--kernel-policy`` or ini
value is a usage error (exit code 4).

Importing this module imports neither torch nor ``kernels`` (the package
loads its torch-dependent parts on first use), so a pytest run that uses no
marker or option pays nothing for it; it reads no option before
``pytest_configure``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

import pytest

import kernelpolicy as _kernelpolicy
from kernelpolicy import Policy, PolicyError, current_policy, kernel_policy
from kernelpolicy._context._scope import check_variants

if TYPE_CHECKING:
    from collections.abc import Generator, Mapping
    from types import ModuleType

    from kernelpolicy._values._policy import PolicyMode

__all__ = ["MARKER", "OPTION"]

#: The marker's name: ``@pytest.mark.kernel_policy(...)``.
MARKER = "kernel_policy"
#: The command-line option; the ini option is :data:`MARKER`'s name.
OPTION = "--kernel-policy"
_INI = "kernel_policy"

_RUN_SCOPE = pytest.StashKey["kernel_policy | None"]()
_RUN_SOURCE = pytest.StashKey[str]()  # the run-wide scope's option and text, for its variant check's error
_TEST_SCOPES = pytest.StashKey[contextlib.ExitStack]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelpolicy", "kernel policy (kernelpolicy)")
    group.addoption(
        OPTION,
        dest="kernel_policy",
        metavar="TEXT",
        default=None,
        help="Run every test under this kernel policy, e.g. 'disable' or 'prefer,RMSNorm=disable' "
        "(syntax of kernelpolicy.Policy.parse); kernel_policy markers nest inside it.",
    )
    parser.addini(
        _INI,
        f"Kernel policy for every test when {OPTION} is not given (same syntax).",
        type="string",
        default="",
    )


def scope_from_text(text: str, source: str) -> kernel_policy:
    """The scope that ``text`` (the syntax of :meth:`Policy.parse`) describes.

    ``text`` is validated by :meth:`Policy.parse` (errors name ``source``) and
    then read as the arguments of a scope: the bare mode, if any, names every
    layer; ``Layer=mode`` and option entries name only themselves.

    >>> from kernelpolicy import current_policy
    >>> with scope_from_text("RMSNorm=disable", "example"):
    ...     str(current_policy())
    'prefer,RMSNorm=disable'
    """
    Policy.parse(text, source=source)
    mode: PolicyMode | None = None
    entries: dict[str, str] = {}
    for token in text.split(","):
        name, equals, value = (part.strip() for part in token.partition("="))
        if equals:
            entries[name] = value
        else:
            mode = cast("PolicyMode", name)
    return kernel_policy(mode, **entries)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(mode=None, /, **layers): run the test (and the setup and teardown of its fixtures) "
        "under kernelpolicy.kernel_policy(mode, **layers); module and class markers enclose the function's.",
    )
    text: str | None = config.getoption("kernel_policy")
    source = OPTION
    if text is None:
        text = str(config.getini(_INI)).strip() or None
        source = f"ini option {_INI}"
    scope = None
    if text is not None:
        try:
            scope = scope_from_text(text, source)
        except PolicyError as error:
            raise pytest.UsageError(str(error)) from None
        scope._deferred = True  # as a marker's: its variants may be bound by each test's fixtures (checked at call)
        config.stash[_RUN_SOURCE] = f"{source} {text!r}"
    config.stash[_RUN_SCOPE] = scope


def _describe(args: tuple[object, ...], kwargs: Mapping[str, object]) -> str:
    return ", ".join([*map(repr, args), *(f"{name}={value!r}" for name, value in kwargs.items())])


def _scopes_for(item: pytest.Item) -> list[kernel_policy]:
    """The scopes ``item`` runs under, outermost first."""
    scopes: list[kernel_policy] = []
    run_scope = item.config.stash.get(_RUN_SCOPE, None)
    if run_scope is not None:
        scopes.append(run_scope)
    for mark in _marks_outermost_first(item):
        try:
            scope = kernel_policy(*mark.args, **mark.kwargs)
        except (PolicyError, TypeError) as error:  # TypeError: e.g. two positional modes
            problem = f"bad marker @pytest.mark.{MARKER}({_describe(mark.args, mark.kwargs)}): {error}"
            break
        scope._deferred = True  # its variants may be bound by the test's own fixtures: checked before the call
        scopes.append(scope)
    else:
        return scopes
    pytest.fail(problem, pytrace=False)  # outside the except: no chained traceback in the report


def _marks_outermost_first(item: pytest.Item) -> list[pytest.Mark]:
    """``item``'s markers of this plugin, outermost first: module, class (bases first), function.

    ``iter_markers_with_node`` yields the closest node first and, per node, its markers as listed there (the
    bottom decorator first). A class node lists those of its whole MRO, its bases' first (pytest collects
    them with ``consider_mro``): grouped by the class that declares them, a base's enclose a subclass's, so
    what a subclass names wins over its base, as a function's own marker wins over its class's.
    """
    nodes: dict[int, tuple[object, list[pytest.Mark]]] = {}
    for node, mark in item.iter_markers_with_node(MARKER):
        nodes.setdefault(id(node), (node, []))[1].append(mark)
    ordered: list[pytest.Mark] = []
    for owner, marks in reversed(nodes.values()):
        marks.reverse()  # of stacked decorators, the top one is outermost
        if isinstance(owner, pytest.Class):
            mro: tuple[type, ...] = owner.obj.__mro__
            declared = {id(m): depth for depth, cls in enumerate(reversed(mro)) for m in _own_marks(cls)}
            marks.sort(key=lambda m: declared.get(id(m), len(mro)))  # stable: bases first; ones added to the node last
        ordered += marks
    return ordered


def _own_marks(cls: type) -> list[pytest.Mark]:
    """The markers ``cls`` itself declares (``pytestmark`` in its own ``__dict__``), as pytest stores them."""
    found = cls.__dict__.get("pytestmark", [])
    return [
        m.mark if isinstance(m, pytest.MarkDecorator) else m for m in (found if isinstance(found, list) else [found])
    ]


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    scopes = _scopes_for(item)
    if scopes:
        stack = contextlib.ExitStack()
        item.stash[_TEST_SCOPES] = stack
        for scope in scopes:
            stack.enter_context(scope)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """The fixtures have run: the variants the run-wide option and the markers name must be bound now."""
    if item.stash.get(_TEST_SCOPES, None) is not None:
        policy = current_policy()
        if policy._names_variants:
            named = [
                item.config.stash.get(_RUN_SOURCE, ""),
                f"@pytest.mark.{MARKER}" if item.get_closest_marker(MARKER) else "",
            ]
            try:
                check_variants(policy, " with ".join(filter(None, named)))
            except PolicyError as error:
                problem = str(error)
            else:
                problem = ""
            if problem:
                pytest.fail(problem, pytrace=False)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        stack = item.stash.get(_TEST_SCOPES, None)
        if stack is not None:
            del item.stash[_TEST_SCOPES]
            stack.close()


@pytest.fixture(name="kernelpolicy")
def _kernelpolicy_module() -> ModuleType:
    """The ``kernelpolicy`` module, e.g. ``kernelpolicy.explain(model)`` without an import."""
    return _kernelpolicy


@pytest.fixture
def kernel_policy_in_effect() -> Policy:
    """``kernelpolicy.current_policy()`` inside the test's markers and ``--kernel-policy`` scope."""
    return current_policy()

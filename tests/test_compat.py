"""The installed torch and kernels: supported releases, and the canary for private names.

A torch release that moves a private name kernelpolicy reads fails here, with
the name, before it fails in a user's forward.
"""

from __future__ import annotations

import pathlib
import threading
import warnings

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy._compat import _attributes, _compat, _versions
from kernelpolicy._compat._compat import INTERNALS, Found, Internal, lookup, probe
from kernelpolicy._compat._versions import UnsupportedVersionError, check_version
from kernelpolicy._context import _state


def test_every_private_name_is_present_on_this_torch() -> None:
    missing = [str(f) for f in probe() if not f.present and not f.internal.names[0].startswith("transformers.")]
    assert not missing, f"torch {torch.__version__}: " + "; ".join(missing)


def test_transformers_seams_are_present_on_the_releases_they_were_seen_in() -> None:
    """The canary for transformers' seams, which fall back (and tell) where missing: on the releases of their
    ``seen`` they must be there, or the batching and serve tests would only skip."""
    transformers = pytest.importorskip("transformers")
    release = _versions._release(transformers.__version__)[:2]
    expected = {
        _compat.TRANSFORMERS_LAZY_KERNELS: (5, 17),
        _compat.TRANSFORMERS_LAZY_REPOS: (5, 17),
        _compat.BATCHING_MANAGER: (5, 22),
        **dict.fromkeys(_compat.BATCHING, (5, 22)),
        **dict.fromkeys(
            (_compat.SERVING_BUILD, _compat.SERVING_SEND, *_compat.SERVING_RUNNERS, _compat.SERVING_API), (5, 25)
        ),
    }
    assert set(expected) == {i for i in INTERNALS if i.names[0].startswith("transformers.")}
    serve_installed = pytest.importorskip("importlib.util").find_spec("fastapi") is not None
    missing = [
        str(Found(internal, None))
        for internal, since in expected.items()
        if release >= since
        and _compat.first_present(internal) is None
        and (serve_installed or "serving" not in internal.names[0])
    ]
    assert not missing, f"transformers {transformers.__version__}: " + "; ".join(missing)


def test_the_list_covers_the_call_path_canary() -> None:
    # Each name the fast call path reads from torch.nn.modules.module is listed.
    listed = {name.rsplit(".", 1)[-1] for internal in INTERNALS for name in internal.names}
    assert {"_wrapped_call_impl", "_call_impl", "_slow_forward", "_get_tracing_state"} <= listed
    assert {"_global_forward_hooks", "_global_backward_pre_hooks"} <= listed


def test_lookup_names_what_is_missing() -> None:
    assert lookup("torch.nn.Module._slow_forward") is torch.nn.Module._slow_forward
    with pytest.raises(LookupError, match=r"torch\.fx\._symbolic_trace\._no_such_flag: torch\.fx\._symbolic_trace has"):
        lookup("torch.fx._symbolic_trace._no_such_flag")
    with pytest.raises(LookupError, match="no module 'no_such_package_kp'"):
        lookup("no_such_package_kp.x")


def test_a_missing_name_reports_its_fallback() -> None:
    gone = Internal("a flag", ("torch._no_such_flag_a", "torch._no_such_flag_b"), "the public function")
    found = Found(gone, _compat.first_present(gone))
    assert not found.present
    assert str(found) == (
        "a flag: MISSING torch._no_such_flag_a or torch._no_such_flag_b; kernelpolicy falls back to the public function"
    )
    essential = Found(Internal("jit", ("torch._gone",)), None)
    assert str(essential).endswith("kernelpolicy cannot work")


def test_alternatives_take_the_first_present() -> None:
    moved = Internal("fx flag", ("torch._no_such_flag", "torch.fx._symbolic_trace.is_fx_symbolic_tracing"))
    assert _compat.first_present(moved) == "torch.fx._symbolic_trace.is_fx_symbolic_tracing"


# --- trace-state readers, chosen at import: right under the real tracers ----------------------

READER_SOURCES = [
    _state.READERS["fx"],
    "_fx.is_fx_symbolic_tracing()",  # the fallback, exercised on every torch
]


class _Seen(torch.nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.read = _state._reader(source)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(bool(self.read()))
        return x + 1


@pytest.mark.parametrize("source", READER_SOURCES)
def test_fx_reader_is_true_only_under_fx_tracing(source: str) -> None:
    probe_module = _Seen(source)
    probe_module(torch.zeros(1))
    torch.fx.symbolic_trace(probe_module)
    torch.jit.trace(probe_module, (torch.zeros(1),), check_trace=False)
    assert probe_module.seen == [False, True, False]


def test_hot_path_check_reads_what_this_torch_has() -> None:
    for reader in _state.READERS.values():
        root, *attributes = reader.split("(")[0].split(".")
        value = _state.TRACING_NAMES[root]
        for attribute in attributes:
            assert hasattr(value, attribute), (reader, attribute)
            value = getattr(value, attribute)
    assert _state.READERS["compile"] in _state.TRACING_CHECK and _state.READERS["fx"] in _state.TRACING_CHECK


@pytest.mark.skipif(
    _state.READERS["fx"] == "_fx._is_fx_tracing_flag", reason="fx tracing is process-wide on this torch (<= 2.13)"
)
def test_fx_tracing_in_one_thread_is_eager_in_another() -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[str] = []

    class Blocking(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.set()
            release.wait(30)
            return x + 1

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Blocking(),))
    tracer.start()
    assert started.wait(30)
    seen.append(kp.introspect.execution_state())
    release.set()
    tracer.join(30)
    assert seen == ["eager"]


# --- supported releases -----------------------------------------------------------------------


def test_installed_releases_are_supported() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_torch()
        assert _versions.kernels().__name__ == "kernels"


def test_older_release_is_refused_with_both_versions() -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        check_version("torch", "2.8.0+cu128")
    message = str(info.value)
    assert "torch>=2.9,<2.16" in message and "installed: torch 2.8.0+cu128" in message
    assert isinstance(info.value, ImportError)


def test_newer_release_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_versions, "_warned", set())
    with pytest.warns(UserWarning, match=r"tested with kernels>=0\.16,<0\.20; installed: kernels 0\.20\.0"):
        check_version("kernels", "0.20.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_version("kernels", "0.20.1")


@pytest.mark.parametrize("version", ["2.9.0", "2.15.0+cu132", "2.10.0a0+git1"])
def test_supported_releases_pass_silently(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_version("torch", version)


def test_pyproject_declares_the_supported_ranges() -> None:
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    for package, (low, high) in _versions.SUPPORTED.items():
        assert f'"{package}>={low},<{high}",' in pyproject


# --- every private name read outside _compat is in its table (issue 41, item 6) ------------------------------
#
# What counts as a read of a private name: a dotted path of torch, kernels, transformers or accelerate that a
# module of kernelpolicy spells (an attribute chain from an imported module, a name imported with ``from``, a
# string ``"torch...."``) and that has a component starting with ``_`` (dunders aside); and an underscore name
# given as a string to ``getattr``/``hasattr``. A prefix of the path, through its last private component at
# least, must be a name of ``_compat.INTERNALS`` (``torch._dynamo.config.x`` reads ``torch._dynamo.config``,
# ``Module._call_impl.__code__`` reads ``Module._call_impl``; ``torch._dynamo.reset`` is a name of its own); a
# table name may be read directly (the hot paths do). Attribute names must be ``_attributes``' constants.
# Not seen: ``obj._name`` on an object of unknown origin, and names held in variables.

_NEIGHBOURS = ("torch", "kernels", "transformers", "accelerate")
_TABLE = frozenset(name for internal in INTERNALS for name in internal.names)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _covered(read: str, table: frozenset[str]) -> bool:
    """Whether a prefix of ``read`` through its last private component is a table name."""
    parts = read.split(".")
    last = max(i for i, part in enumerate(parts) if _private(part))
    return any(".".join(parts[:end]) in table for end in range(last + 1, len(parts) + 1))


def _private_reads(source: str) -> list[str]:
    """The private paths of torch, kernels, transformers and accelerate that ``source`` reads, and the
    underscore names it gives to ``getattr``/``hasattr`` (as ``(attribute) name``)."""
    import ast

    tree = ast.parse(source)
    roots: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _NEIGHBOURS:
                    roots[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _NEIGHBOURS:
            for alias in node.names:
                roots[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                found.append(f"{node.module}.{alias.name}")
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in roots:
                found.append(".".join([roots[base.id], *reversed(chain)]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(".")[0] in _NEIGHBOURS:
            found.append(node.value)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr")
            and len(node.args) > 1
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append(f"(attribute) {name.value}")
    return [read for read in found if read.startswith("(attribute) ") or any(map(_private, read.split(".")))]


#: Underscore attributes kernelpolicy reads that are its own or Python's (namedtuple's), not a neighbour's.
_OWN_ATTRIBUTES = {"_kernelpolicy_aware", "_kernelpolicy_original", "_fields"}


def _uncovered(source: str, table: frozenset[str] = _TABLE) -> list[str]:
    attributes = {_attributes.ACCELERATE_WRAPPED, *_attributes.TRANSFORMERS_ATTRIBUTES, *_OWN_ATTRIBUTES}
    out = []
    for read in _private_reads(source):
        if read.startswith("(attribute) "):
            if read.removeprefix("(attribute) ") not in attributes:
                out.append(read)
        elif not _covered(read, table):
            out.append(read)
    return sorted(out)


def test_every_private_name_read_outside_compat_is_in_its_table() -> None:
    package = pathlib.Path(kp.__file__).parent
    uncovered = {
        path.name: found
        for path in sorted(package.rglob("*.py"))
        if path.name != "_compat.py" and (found := _uncovered(path.read_text()))
    }
    assert uncovered == {}


def test_the_private_name_check_finds_what_the_issue_found() -> None:
    """The reads issue 41 found outside the table, as they were written, are caught against the table without
    their entries; a public name of a private module is a name read; what follows a table name is not."""
    before = (
        "import sys, torch\n"
        "skip = getattr(sys.modules.get('torch._dynamo.eval_frame'), 'skip_code', None)\n"
        "node = torch._C._current_autograd_node()\n"
        "x = getattr(module, '_old_forward', None)\n"
        "from torch._inductor import aoti_load_package\n"
        "torch._dynamo.reset()\n"
    )
    old = _TABLE - {"torch._C._current_autograd_node", "torch._dynamo.eval_frame.skip_code", _compat.AOTI_LOAD.names[0]}
    assert _uncovered(before, old) == [
        "torch._C._current_autograd_node",
        "torch._dynamo.eval_frame",
        "torch._dynamo.reset",
        "torch._inductor.aoti_load_package",
    ]
    assert _uncovered("x = getattr(module, '_some_hook', None)\n") == ["(attribute) _some_hook"]
    fine = "import torch\nimport torch._dynamo\nc = torch._dynamo.config.caching_precompile\n"
    fine += "n = torch.nn.modules.module.Module._call_impl.__code__.co_names\n"
    assert _uncovered(fine) == []


#: kernelpolicy.batching's wrapper of each method of ``_compat.BATCHING`` (``_handle_request_error``: not
#: wrapped but called, with its parameters as positional arguments).
_WRAPPERS = {
    "_create_batch_processor": "create_batch_processor",
    "_generation_step": "generation_step",
    "warmup": "warm_up",
    "_handle_request_error": None,
}


def test_batching_wrappers_take_the_parameters_of_the_methods_they_replace() -> None:
    """Each wrapper kernelpolicy.batching installs takes the table's parameter names (after ``self``) of the
    method it replaces, in order, or ``*args``; a method it calls gets them all; on this transformers the
    methods have those names."""
    import ast
    import inspect

    package = pathlib.Path(kp.__file__).parent / "batching"
    tree = ast.Module(
        body=[n for p in sorted(package.glob("*.py")) for n in ast.parse(p.read_text()).body], type_ignores=[]
    )
    wrappers = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    calls = {
        node.func.attr: node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    for internal in _compat.BATCHING:
        assert internal.parameters is not None, internal.names[0]
        method = internal.names[0].rsplit(".", 1)[-1]
        wrapper_name = _WRAPPERS.get(method, method)
        if wrapper_name is None:
            assert len(calls[method].args) == len(internal.parameters) and not calls[method].keywords, method
            continue
        wrapper = wrappers[wrapper_name]
        taken = tuple(arg.arg for arg in wrapper.args.args if arg.arg != "self")
        without_defaults = taken[: len(taken) - len(wrapper.args.defaults)]
        assert without_defaults == internal.parameters[: len(without_defaults)], (method, taken)
        assert len(without_defaults) == len(internal.parameters) or wrapper.args.vararg is not None, (method, taken)
    transformers = pytest.importorskip("transformers")
    try:
        methods = [(internal, _compat.lookup(internal.names[0])) for internal in _compat.BATCHING]
    except LookupError:  # before 5.22: no batching seams at all (the user is told; tests/test_moved_internals.py)
        return
    changed = [
        f"{internal.names[0]}{inspect.signature(method)}"
        for internal, method in methods
        if _compat.first_present(internal) is None
    ]
    assert not changed, f"transformers {transformers.__version__}: " + "; ".join(changed)


def test_a_changed_signature_counts_as_missing_and_says_so() -> None:
    moved = Internal("a method", ("torch.nn.Module.forward",), "the fallback", parameters=("x", "y"))
    assert _compat.first_present(moved) is None
    assert str(Found(moved, None)) == (
        "a method: MISSING torch.nn.Module.forward with parameters (x, y); kernelpolicy falls back to the fallback"
    )
    with pytest.warns(UserWarning, match=r"none of torch\.nn\.Module\.forward with parameters \(x, y\)"):
        assert _compat.resolve(moved) is None

"""Calls whose rows follow several policies (``_mixing``), on plain modules with real local kernels.

The batching seam builds these steps from transformers' batches (tests/test_batching.py); here a step is built by
hand: each row's slot, the step's table, then one forward. Every row must equal the same row computed alone under
its own policy, whatever the join, also for a kernel layer with another kernel layer inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from _helpers import CountingBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import kernelpolicy as kp
from kernelpolicy._forward import _mixing
from kernelpolicy._values._tensors import tensors_in
from kernelpolicy.testing import kernelize_locally, local_mapping, write_kernel_repo

transformers_outputs = pytest.importorskip("transformers.modeling_outputs")
BaseModelOutput = transformers_outputs.BaseModelOutput

HIDDEN = 8


def _kernel(name: str, offset: float) -> str:
    return f"""
import torch
from torch import nn


class {name}(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        return self.inner(x) * 2 + {offset}
"""


@kp.use_kernel_forward_from_hub("MixInner")
class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


@kp.use_kernel_forward_from_hub("MixOuter")
class Outer(nn.Module):
    """A kernel layer with a kernel layer inside (an MLP whose activation has a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) - 1


INNER_KERNEL = """
import torch
from torch import nn


class MixInner(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        return x * 3 + 100
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("mixing")
    repos = {
        "MixOuter": write_kernel_repo(root / "outer", _kernel("MixOuter", 10.0)),
        "MixInner": write_kernel_repo(root / "inner", INNER_KERNEL),
    }
    return kernelize_locally(nn.Sequential(Outer()).eval(), repos)


POLICIES = [
    kp.Policy.parse("MixOuter=disable,MixInner=prefer"),
    kp.Policy.parse("MixOuter=disable,MixInner=disable"),
    kp.Policy.parse("prefer"),
    kp.Policy.parse("MixOuter=prefer,MixInner=disable"),
]


def mixed(model: Any, x: torch.Tensor, owners: list[int]) -> torch.Tensor:
    """``model(x)`` as one call whose row i follows ``POLICIES[owners[i]]``."""
    step = _mixing.Step(torch.device("cpu"))
    for policy in POLICIES:
        step.slot(policy)
    step.begin(torch.tensor(owners), owners, {})
    table = step.table(tuple(sorted(set(owners))), False)
    with _mixing.mixed_scope(table, ()):
        return model(x)  # type: ignore[no-any-return]


def alone(model: Any, x: torch.Tensor, owners: list[int]) -> torch.Tensor:
    """Each row computed under its own policy alone."""
    rows = []
    for i, owner in enumerate(owners):
        with kp.kernel_policy(POLICIES[owner]):
            rows.append(model(x[:, i : i + 1]))
    return torch.cat(rows, dim=1)


@pytest.mark.parametrize("join", ["select", "split"])
def test_each_row_takes_its_own_policys_path_also_inside(
    model: Any, join: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four policies that differ on the outer layer, the inner one, or both: every row as computed alone (the outer
    layer's groups run once per policy, since its inner layer may differ between policies that agree on it)."""
    monkeypatch.setitem(_mixing.ROWS, "MixOuter", _mixing.Rows("token", -2, join))  # type: ignore[arg-type]
    monkeypatch.setitem(_mixing.ROWS, "MixInner", _mixing.Rows("token", -2, join))  # type: ignore[arg-type]
    owners = [0, 1, 2, 3, 3, 2, 1, 0, 0, 2]
    x = torch.randn(1, len(owners), HIDDEN, generator=torch.Generator().manual_seed(0))
    expected = alone(model, x, owners)
    assert len({round(float(expected[0, owners.index(o)].sum()), 3) for o in range(4)}) == 4  # four paths
    torch.testing.assert_close(mixed(model, x, owners), expected)


def test_record_calls_count_each_group_on_its_path(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorders given per slot count the call of their rows' group, on its path."""
    for name in ("MixOuter", "MixInner"):
        monkeypatch.setitem(_mixing.ROWS, name, _mixing.Rows("token"))
    step = _mixing.Step(torch.device("cpu"))
    for policy in POLICIES:
        step.slot(policy)
    with kp.record_calls() as kernel_side, kp.record_calls() as original_side:
        pass
    owners = [2, 1, 2, 1]
    step.begin(torch.tensor(owners), owners, {2: (kernel_side,), 1: (original_side,)})
    table = step.table((1, 2), True)
    with _mixing.mixed_scope(table, (kernel_side, original_side)):
        model(torch.ones(1, 4, HIDDEN))
    assert kernel_side.by_layer() == {"MixOuter": {"kernel": 1}, "MixInner": {"kernel": 1}}
    assert original_side.by_layer() == {"MixOuter": {"original": 1}, "MixInner": {"original": 1}}


def test_an_error_of_one_group_names_its_policies(model: Any, tmp_path: Path) -> None:
    """``require`` on a layer without kernel fails the rows of that policy only: MixedCallError names it."""
    missing = kp.Policy.parse("MixOuter=disable,SiLU=require")

    @kp.use_kernel_forward_from_hub("SiLU")
    class Act(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x)

    act = Act()
    step = _mixing.Step(torch.device("cpu"))
    step.slot(kp.Policy.parse("prefer"))
    step.slot(missing)
    step.begin(torch.tensor([0, 1]), [0, 1], {})
    with _mixing.mixed_scope(step.table((0, 1), False), ()), pytest.raises(_mixing.MixedCallError) as raised:
        act(torch.ones(1, 2, HIDDEN))
    assert raised.value.policies == (missing,)
    assert isinstance(raised.value.error, kp.KernelUnavailableError)


MARKER_KERNEL = """
import torch
from torch import nn


class MixMarker(nn.Module):
    def forward(self, x):
        if bool((x[..., 0] == 999).any()):
            raise RuntimeError("the marker row")
        return x + 0.5
"""


@kp.use_kernel_forward_from_hub("MixMarker")
class Marked(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize("join", ["select", "split"])
def test_a_kernel_error_stays_with_the_rows_that_raise_it(
    tmp_path: Path, join: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that raises on one row: under ``fallback_on`` that row's group falls back (once, on its own rows);
    a group whose kernel ran on every row (select) and met the row runs again on its own rows and keeps the
    kernel, its calls counted once; the same row in a group without fallback fails that group only."""
    monkeypatch.setitem(_mixing.ROWS, "MixMarker", _mixing.Rows("token", -2, join))  # type: ignore[arg-type]
    layer = kernelize_locally(Marked(), {"MixMarker": write_kernel_repo(tmp_path / "marker", MARKER_KERNEL)})
    plain, falls_back, off = (
        kp.Policy.parse("prefer"),
        kp.Policy.parse("prefer,fallback_on=RuntimeError"),
        kp.Policy.parse("disable"),
    )
    step = _mixing.Step(torch.device("cpu"))
    for policy in (plain, falls_back, off):
        step.slot(policy)
    x = torch.ones(1, 4, HIDDEN)
    x[0, 1, 0] = 999  # the row of falls_back
    owners = [0, 1, 2, 0]
    with kp.record_calls() as plain_calls, kp.record_calls() as fallback_calls:
        pass
    step.begin(torch.tensor(owners), owners, {0: (plain_calls,), 1: (fallback_calls,)})
    with _mixing.mixed_scope(step.table((0, 1, 2), True), (plain_calls, fallback_calls)):
        out = layer(x)
    torch.testing.assert_close(out[0, [0, 3]], x[0, [0, 3]] + 0.5)  # the kernel: plain's rows
    torch.testing.assert_close(out[0, [1, 2]], x[0, [1, 2]] * 2)  # the original: the fallback and disable
    assert plain_calls.by_layer() == {"MixMarker": {"kernel": 1}}
    [((_, _, path, reason, _), calls)] = fallback_calls.items()  # one call: its group's own rows fell back once
    assert (path, calls) == ("original", 1) and "RuntimeError: the marker row" in reason

    owners = [1, 0, 2, 0]  # now the marker row is plain's: plain's rows fail, no others
    step.begin(torch.tensor(owners), owners, {})
    with _mixing.mixed_scope(step.table((0, 1, 2), False), ()), pytest.raises(_mixing.MixedCallError) as raised:
        layer(x)
    assert raised.value.policies == (plain,)
    assert "the marker row" in str(raised.value)


SHAPED_KERNEL = """
import torch
from torch import nn


class MixShaped(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        out = x.mul_(2).add_(1)  # in place, on whatever the call gives it
        return self.wrap(out, out.sum(dim=self.rows_axis, keepdim=True) * 0)
"""


@dataclasses.dataclass
class Pair:
    value: torch.Tensor
    other: torch.Tensor


class Named(NamedTuple):
    value: torch.Tensor
    other: torch.Tensor


WRAPS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "tensor": lambda value, other: value,
    "tuple": lambda value, other: (value, other),
    "list": lambda value, other: [value, value + 1],
    "named": lambda value, other: Named(value, other),
    "dict": lambda value, other: {"value": value, "other": other},
    "dataclass": lambda value, other: Pair(value, other),
    "model_output": lambda value, other: BaseModelOutput(last_hidden_state=value),
}


@kp.use_kernel_forward_from_hub("MixShaped")
class Shaped(nn.Module):
    """Returns its output in one of the structures of ``WRAPS``; rows on ``rows_axis`` of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.wrap: Callable[[torch.Tensor, torch.Tensor], Any] = WRAPS["tensor"]
        self.rows_axis = 0

    def forward(self, x: torch.Tensor) -> Any:
        return self.wrap(x * 3, x.sum(dim=self.rows_axis, keepdim=True) * 0)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return kernelize_locally(
        Shaped(), {"MixShaped": write_kernel_repo(tmp_path_factory.mktemp("shaped"), SHAPED_KERNEL)}
    )


def _flat(value: Any) -> list[torch.Tensor]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and not isinstance(value, dict):
        return [t for field in dataclasses.fields(value) for t in _flat(getattr(value, field.name))]
    return tensors_in(dict(value) if isinstance(value, dict) else value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    owners=st.lists(st.integers(0, 2), min_size=2, max_size=7),
    rank=st.integers(1, 3),
    data=st.data(),
    wrap=st.sampled_from(sorted(WRAPS)),
    join=st.sampled_from(["select", "split"]),
)
def test_the_join_gives_every_row_its_own_policys_output(
    shaped: Any, owners: list[int], rank: int, data: st.DataObject, wrap: str, join: str
) -> None:
    """Random rows of three policies, the rows on any axis of tensors of 2 to 4 axes, an in-place kernel, every
    output structure: each row of the joined output is that row computed alone under its policy, and the caller's
    tensor is written only as each row's path writes it alone."""
    policies = [kp.Policy.parse(text) for text in ("prefer", "disable", "MixShaped=disable,SiLU=prefer")]
    count = len(owners)
    axis = data.draw(st.integers(0, rank), label="axis")
    sizes = [data.draw(st.sampled_from([s for s in (1, 3, 8, 9) if s != count]), label="size") for _ in range(rank)]
    shape = [*sizes[:axis], count, *sizes[axis:]]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(count))
    shaped.wrap, shaped.rows_axis = WRAPS[wrap], axis
    saved = _mixing.ROWS.get("MixShaped")
    _mixing.ROWS["MixShaped"] = _mixing.Rows("token", -2, join)  # type: ignore[arg-type]
    try:
        alone_inputs, alone_outputs = [], []
        for row, owner in enumerate(owners):
            own = x.narrow(axis, row, 1).clone()
            with kp.kernel_policy(policies[owner]):
                alone_outputs.append(_flat(shaped(own)))
            alone_inputs.append(own)
        step = _mixing.Step(torch.device("cpu"))
        for policy in policies:
            step.slot(policy)
        step.begin(torch.tensor(owners), owners, {})
        given_x = x.clone()
        with _mixing.mixed_scope(step.table(tuple(sorted(set(owners))), False), ()):
            joined = _flat(shaped(given_x))
    finally:
        if saved is None:
            del _mixing.ROWS["MixShaped"]
        else:
            _mixing.ROWS["MixShaped"] = saved
    for row in range(count):
        for got, expected in zip(joined, alone_outputs[row], strict=True):
            if got.shape[axis] == count:
                torch.testing.assert_close(got.narrow(axis, row, 1), expected)
        torch.testing.assert_close(given_x.narrow(axis, row, 1), alone_inputs[row])


def test_a_call_whose_rows_cannot_be_told_apart_is_not_joined(shaped: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rows and an axis of four: no row is joined, the caller's tensor is untouched, UnsplittableCall says so."""
    monkeypatch.setitem(_mixing.ROWS, "MixShaped", _mixing.Rows("token"))
    shaped.wrap, shaped.rows_axis = WRAPS["tensor"], 0
    step = _mixing.Step(torch.device("cpu"))
    for policy in ("prefer", "disable"):
        step.slot(kp.Policy.parse(policy))
    step.begin(torch.tensor([0, 1, 0, 1]), [0, 1, 0, 1], {})
    x = torch.randn(4, 4)
    before = x.clone()
    with _mixing.mixed_scope(step.table((0, 1), False), ()), pytest.raises(_mixing.UnsplittableCall) as raised:
        shaped(x)
    assert raised.value.size == 4 and "shape (4, 4)" in str(raised.value)
    assert torch.equal(x, before)


ORIGINAL_ROWS: dict[str, int] = {}

SAME_KERNEL = """
import torch
from torch import nn


class MixCounted(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        return x * 3
"""


@kp.use_kernel_forward_from_hub("MixCounted")
class Counted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ORIGINAL_ROWS["MixCounted"] = ORIGINAL_ROWS.get("MixCounted", 0) + x.shape[-2]
        return x * 3


@kp.use_kernel_forward_from_hub("MixBare")
class Bare(nn.Module):
    """A kernel layer no kernel is bound to."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ORIGINAL_ROWS["MixBare"] = ORIGINAL_ROWS.get("MixBare", 0) + x.shape[-2]
        return x + 1


def test_a_canary_costs_its_own_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six ``prefer`` rows and one ``verify`` canary: the canary's original runs on its row only, and a layer
    without a kernel runs once for every row (was: the original on all seven rows, and the bare layer twice)."""
    for name in ("MixCounted", "MixBare"):
        monkeypatch.setitem(_mixing.ROWS, name, _mixing.Rows("token"))
    repo = write_kernel_repo(tmp_path / "same", SAME_KERNEL)
    model = kernelize_locally(nn.Sequential(Counted(), Bare()).eval(), {"MixCounted": repo})
    step = _mixing.Step(torch.device("cpu"))
    step.slot(kp.Policy.parse("prefer"))
    step.slot(kp.Policy("verify", on_mismatch="warn"))  # what serve's --verify-sample makes of a prefer request
    owners = [0, 0, 0, 1, 0, 0, 0]  # seven rows (HIDDEN is 8: eight rows would not show their axis)
    step.begin(torch.tensor(owners), owners, {})
    ORIGINAL_ROWS.clear()
    x = torch.randn(1, len(owners), HIDDEN)
    with _mixing.mixed_scope(step.table((0, 1), False), ()):
        out = model(x)
    torch.testing.assert_close(out, x * 3 + 1)
    assert {"MixCounted": 1, "MixBare": len(owners)} == ORIGINAL_ROWS


def _offset_kernel(class_name: str, offset: float) -> str:
    return f"""
import torch
from torch import nn


class {class_name}(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        return x * 3 + {offset}
"""


@kp.use_kernel_forward_from_hub("MixVariant")
class Varied(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


@kp.use_kernel_forward_from_hub("MixUnbound")
class Unbound(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - 1


def test_compiled_mixed_calls_take_each_rows_variant_and_fail_require_rows_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile a mixed call chooses per row as eager code does: the default kernel (+100), the variant
    ``fast`` (+200) or the original; a policy that requires a kernel the layer has not (MixUnbound) leaves the
    traced program to the eager frame, where only its rows fail (was: the default kernel on every kernel row, and
    the require rows served). A new mix of the same policies compiles nothing more."""
    for name in ("MixVariant", "MixUnbound"):
        monkeypatch.setitem(_mixing.ROWS, name, _mixing.Rows("token"))
    model = nn.Sequential(Varied(), Unbound()).eval()
    kernelize_locally(model, {"MixVariant": write_kernel_repo(tmp_path / "default", _offset_kernel("MixVariant", 100))})
    with local_mapping({"MixVariant": write_kernel_repo(tmp_path / "fast", _offset_kernel("MixVariant", 200))}):
        kp.kernelize(model, mode="inference", device="cpu", variant="fast")
    policies = [kp.Policy.parse(text) for text in ("prefer", "MixVariant=kernel:fast", "disable")]
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    step = _mixing.Step(torch.device("cpu"))
    for policy in policies:
        step.slot(policy)
    x = torch.zeros(1, 5, HIDDEN)
    for owners in ([0, 1, 2, 1, 0], [2, 2, 0, 1, 1]):
        step.begin(torch.tensor(owners), owners, {})
        with _mixing.mixed_scope(step.table((0, 1, 2), False), ()):
            out = compiled(x)
        assert [float(out[0, i, 0]) for i in range(5)] == [(99.0, 199.0, -1.0)[o] for o in owners]
    assert backend.compiles == 1
    required = kp.Policy.parse("MixUnbound=require")
    step.slot(required)
    owners = [0, 3, 0, 3, 1]
    step.begin(torch.tensor(owners), owners, {})
    with _mixing.mixed_scope(step.table((0, 1, 3), False), ()), pytest.raises(_mixing.MixedCallError) as raised:
        compiled(x)
    assert raised.value.policies == (required,)
    assert isinstance(raised.value.error, kp.KernelUnavailableError)


def test_a_layer_whose_rows_go_by_request_never_runs_a_kernel_on_another_policys_rows(shaped: Any) -> None:
    """Attention-like layers: a call whose groups differ raises UnsplittableCall before anything runs (the batching
    seam runs the step a policy at a time, and its scheduler keeps such policies in steps of their own), so no
    kernel meets another policy's rows; ``kept_apart`` says so for the scheduler."""
    step = _mixing.Step(torch.device("cpu"))
    for policy in ("prefer", "disable"):
        step.slot(kp.Policy.parse(policy))
    step.begin(torch.tensor([0, 1, 0]), [0, 1, 0], {})
    shaped.wrap, shaped.rows_axis = WRAPS["tensor"], 0
    x = torch.randn(3, 5)
    before = x.clone()
    with (
        _mixing.mixed_scope(step.table((0, 1), False), ()),
        pytest.raises(_mixing.UnsplittableCall, match="by request"),
    ):
        shaped(x)  # MixShaped is declared by nothing here: rows by request
    assert torch.equal(x, before)
    assert _mixing.kept_apart("MixShaped") and _mixing.kept_apart("attention") and not _mixing.kept_apart("RMSNorm")


SOMETIMES_KERNEL = """
import torch
from torch import nn

CALLS = [0]


class MixSometimes(nn.Module):
    can_torch_compile = True

    def forward(self, x):
        CALLS[0] += 1
        return x.mul_(3) if CALLS[0] >= 2 else x * 3  # in place from its second call on
"""


@kp.use_kernel_forward_from_hub("MixSometimes")
class Sometimes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_path_seen_not_to_write_its_inputs_shares_them_until_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path seen not to write its inputs in place gets the caller's tensors, not clones; when it writes them after
    all, the call raises UnsplittableCall (``again``: the batching seam runs the step a policy at a time), and that
    path gets clones from then on, so the next call is right."""
    monkeypatch.setitem(_mixing.ROWS, "MixSometimes", _mixing.Rows("token"))
    layer = kernelize_locally(
        Sometimes(), {"MixSometimes": write_kernel_repo(tmp_path / "sometimes", SOMETIMES_KERNEL)}
    )
    step = _mixing.Step(torch.device("cpu"))
    for policy in ("prefer", "disable"):
        step.slot(kp.Policy.parse(policy))
    owners = [0, 1, 0]
    step.begin(torch.tensor(owners), owners, {})
    expected = torch.tensor([[3.0], [2.0], [3.0]])
    with _mixing.mixed_scope(step.table((0, 1), False), ()):
        torch.testing.assert_close(layer(torch.ones(3, 1)), expected)  # cloned: not known yet
        with pytest.raises(_mixing.UnsplittableCall) as raised:
            layer(torch.ones(3, 1))  # shared, and written this time
        assert raised.value.again and raised.value.size is None
        x = torch.ones(3, 1)
        torch.testing.assert_close(layer(x), expected)  # cloned again
        assert torch.equal(x, torch.tensor([[3.0], [1.0], [3.0]]))  # written on its own rows only, as alone


def test_a_steps_groups_are_kept_while_its_rows_are_and_follow_a_slots_new_policy(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups of a step's calls are kept for the next step with the same rows (a decode step), and made again
    when a slot's policy, the rows, their recorders or the layer's join change."""
    monkeypatch.setitem(_mixing.ROWS, "MixOuter", _mixing.Rows("token"))
    monkeypatch.setitem(_mixing.ROWS, "MixInner", _mixing.Rows("token"))
    step = _mixing.Step(torch.device("cpu"))
    for policy in POLICIES[:2]:
        step.slot(policy)
    owners = [0, 1, 1, 0]
    x = torch.randn(1, len(owners), HIDDEN, generator=torch.Generator().manual_seed(1))

    def run(slots: list[int]) -> torch.Tensor:
        step.begin(torch.tensor(slots), list(slots), {})
        with _mixing.mixed_scope(step.table(tuple(sorted(set(slots))), False), ()):
            return model(x)  # type: ignore[no-any-return]

    torch.testing.assert_close(run(owners), alone(model, x, owners))
    kept = dict(step._plans)
    torch.testing.assert_close(run(owners), alone(model, x, owners))
    assert step._plans == kept and all(step._plans[key] is kept[key] for key in kept)  # the same rows: kept
    step.release({POLICIES[0]})
    assert step.slot(POLICIES[2]) == 1  # slot 1 now serves another policy, the rows the same
    torch.testing.assert_close(run(owners), alone(model, x, [0, 2, 2, 0]))
    other = [1, 0, 0, 1]
    torch.testing.assert_close(run(other), alone(model, x, [2, 0, 0, 2]))
    monkeypatch.setitem(_mixing.ROWS, "MixOuter", _mixing.Rows("token", join="split"))
    torch.testing.assert_close(run(other), alone(model, x, [2, 0, 0, 2]))
    assert any(group.rows is not None for groups in step._plans.values() for group in groups)  # split: own rows

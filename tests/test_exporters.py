"""Real exporters on real models whose hub kernel cannot be traced: every exported program runs the original forward.

Three kernelized models (by ``kp.kernelize`` with local kernel repositories): a tiny transformers Llama
(``LlamaRMSNorm``, kernel layer ``RMSNorm``), transformers' RT-DETR deformable cross-attention
(``MultiScaleDeformableAttention``) and kernelpolicy's own DemoModel. Their kernels add 100 to the output (the
path is visible in the numbers), count their eager calls, declare no ``can_torch_compile`` and really cannot be
traced: they copy their result through host memory (``tolist()`` then numpy), which Dynamo rejects (strict
export, compile), non-strict export cannot guard on, and ``jit.trace`` records as a constant
(``test_without_kernelpolicy_the_test_kernel_defeats_every_tracer``). Under ``prefer`` each exporter must succeed,
never call the kernel and produce a program that computes what the never-kernelized model computes, on the
example input and on another one: torch.export (strict and non-strict), torch.jit.trace, torch.onnx.export
(dynamo and TorchScript, run in onnxruntime) and coremltools (its conversion must go as it goes for the model
without kernelpolicy; prediction is macOS-only).

Last, a parent that reshapes for its child's kernel with ``kp.will_use_kernel`` (a traceable custom-op kernel
taking the 6D sampling tensor of deformable attention, the original the flattened one) exports either branch,
as the policy at export time says.

The exporter packages (onnx, onnxscript, onnxruntime, coremltools) are optional: their tests skip without them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kernels
import pytest
import torch
from torch import nn

import kernelpolicy as kp
from kernelpolicy.testing import (
    DemoModel,
    kernel_calls,
    kernelize_locally,
    local_mapping,
    tiny_llama,
    write_kernel_repo,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OFFSET = 100.0  # added by every test kernel

# --- kernel repositories -----------------------------------------------------------------------------------------

_HOST_ROUND_TRIP = '''
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

CALLS = [0]


def host_round_trip(out):
    """Through host memory, as a kernel outside torch computes: no tracer can record it."""
    return torch.from_numpy(np.asarray(out.tolist(), dtype=np.float32)).to(out.dtype)
'''

RMS_NORM_KERNEL = (
    _HOST_ROUND_TRIP
    + f"""

class RMSNorm(nn.Module):
    def forward(self, hidden_states):
        CALLS[0] += 1
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return host_round_trip(self.weight * x.to(hidden_states.dtype) + {OFFSET!r})
"""
)

DEFORMABLE_ATTENTION_KERNEL = (
    _HOST_ROUND_TRIP
    + f"""

class MultiScaleDeformableAttention(nn.Module):
    def forward(
        self,
        value,
        value_spatial_shapes,
        value_spatial_shapes_list,
        level_start_index,
        sampling_locations,
        attention_weights,
        im2col_step,
    ):
        CALLS[0] += 1
        batch, _, heads, dim = value.shape
        _, queries, _, levels, points, _ = sampling_locations.shape
        values = value.split([h * w for h, w in value_spatial_shapes_list], dim=1)
        grids = 2 * sampling_locations - 1
        sampled = []
        for level, (h, w) in enumerate(value_spatial_shapes_list):
            v = values[level].flatten(2).transpose(1, 2).reshape(batch * heads, dim, h, w)
            grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
            sampled.append(F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
        weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries, levels * points)
        out = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(batch, heads * dim, queries)
        return host_round_trip(out.transpose(1, 2).contiguous() + {OFFSET!r})
"""
)

OP = "kp_exporters::point_sum"

POINT_SUM_KERNEL = f"""
import torch
from torch import nn


@torch.library.custom_op({OP!r}, mutates_args=())
def point_sum(locations: torch.Tensor) -> torch.Tensor:
    if locations.dim() != 6:
        raise ValueError(f"point_sum takes (batch, queries, heads, levels, points, 2), got {{tuple(locations.shape)}}")
    return locations.sum(dim=(3, 4, 5)) + {OFFSET!r}


@point_sum.register_fake
def _(locations):
    return locations.new_empty(locations.shape[:3])


class KpPointSum(nn.Module):
    can_torch_compile = True

    def forward(self, locations):
        return torch.ops.kp_exporters.point_sum(locations)
"""


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exporter-kernels")
    sources = {  # layer: (kernel repository name, layers.py)
        "RMSNorm": ("exporters-rms-norm", RMS_NORM_KERNEL),
        "MultiScaleDeformableAttention": ("exporters-deformable-attention", DEFORMABLE_ATTENTION_KERNEL),
        "KpPointSum": ("exporters-point-sum", POINT_SUM_KERNEL),
    }
    return {layer: write_kernel_repo(root / name, source, name=name) for layer, (name, source) in sources.items()}


def _kernelize(model: nn.Module, repos: dict[str, Path], layer: str) -> nn.Module:
    return kernelize_locally(model, {layer: repos[layer]})


# --- models: one tensor-only forward each, for every exporter -----------------------------------------------------


class LlamaLogits(nn.Module):
    """A tiny ``LlamaForCausalLM`` (5 ``LlamaRMSNorm``): input ids to logits.

    The explicit all-ones attention mask keeps transformers off its packed-sequence detection, which calls
    ``torch.diff``: the TorchScript ONNX exporter has no ``aten::diff`` (with or without kernelpolicy).
    """

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama(hidden_size=32, intermediate_size=64, vocab_size=64, max_position_embeddings=64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
        return out.logits  # type: ignore[no-any-return]


SPATIAL_SHAPES = [(4, 4), (2, 2)]  # two feature levels: 20 memory positions


class DeformableCrossAttention(nn.Module):
    """RT-DETR's decoder cross-attention (``RTDetrMultiscaleDeformableAttention``, its ``attn`` child the
    ``MultiScaleDeformableAttention`` marked by transformers), from a small ``RTDetrConfig``, with fixed levels."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.rt_detr import modeling_rt_detr

        config = transformers.RTDetrConfig(
            d_model=32, num_feature_levels=len(SPATIAL_SHAPES), decoder_n_points=2, decoder_attention_heads=2
        )
        self.cross = modeling_rt_detr.RTDetrMultiscaleDeformableAttention(
            config, num_heads=config.decoder_attention_heads, n_points=config.decoder_n_points
        )
        self.register_buffer("spatial_shapes", torch.tensor(SPATIAL_SHAPES), persistent=False)
        starts = [0, SPATIAL_SHAPES[0][0] * SPATIAL_SHAPES[0][1]]
        self.register_buffer("level_start_index", torch.tensor(starts), persistent=False)

    def forward(self, queries: torch.Tensor, memory: torch.Tensor, reference_points: torch.Tensor) -> torch.Tensor:
        out, _ = self.cross(
            queries,
            encoder_hidden_states=memory,
            reference_points=reference_points,
            spatial_shapes=self.spatial_shapes,
            spatial_shapes_list=SPATIAL_SHAPES,
            level_start_index=self.level_start_index,
        )
        return out  # type: ignore[no-any-return]


@dataclasses.dataclass
class Case:
    name: str
    model: nn.Module  # kernelized by kernelpolicy
    reference: nn.Module  # the same weights, never kernelized
    layer: str
    names: list[str]  # the forward's parameter names: the exported programs' input names
    args: tuple[torch.Tensor, ...]
    other_args: tuple[torch.Tensor, ...]  # a second input: no program may have recorded the first as a constant


def _inputs(name: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if name == "llama":
        return (torch.randint(0, 64, (1, 8), generator=g),)
    if name == "rt_detr":
        return (
            torch.randn(1, 5, 32, generator=g),
            torch.randn(1, 20, 32, generator=g),
            torch.rand(1, 5, 2, 2, generator=g),
        )
    return (torch.randn(2, 16, generator=g),)


CASES: dict[str, tuple[Callable[[], nn.Module], str, list[str]]] = {
    "llama": (LlamaLogits, "RMSNorm", ["input_ids"]),
    "rt_detr": (DeformableCrossAttention, "MultiScaleDeformableAttention", ["queries", "memory", "reference_points"]),
    "demo": (lambda: DemoModel(16), "RMSNorm", ["x"]),
}


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, repos: dict[str, Path]) -> Case:
    build, layer, names = CASES[request.param]

    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build().eval()

    model = _kernelize(seeded(), repos, layer)
    return Case(request.param, model, seeded(), layer, names, _inputs(request.param, 1), _inputs(request.param, 2))


def _assert_original(out: torch.Tensor, case: Case, args: tuple[torch.Tensor, ...], **tolerances: float) -> None:
    with torch.no_grad():
        torch.testing.assert_close(out, case.reference(*args), **tolerances)  # type: ignore[arg-type]


@contextlib.contextmanager
def _without_the_kernel(case: Case) -> Iterator[None]:
    """The block (an export) never calls the kernel; after it the kernel is still bound and runs eagerly."""
    before = kernel_calls(case.model)
    yield
    assert kernel_calls(case.model) == before, "the kernel ran during the export"
    with torch.no_grad():
        out = case.model(*case.args)
    assert kernel_calls(case.model) > before and (out - case.reference(*case.args)).abs().max() > 1.0


# --- the exporters ------------------------------------------------------------------------------------------------


def test_eager_runs_the_kernel_and_disable_the_original(case: Case) -> None:
    rows = [row for row in kp.explain(case.model) if row.layer_name == case.layer]
    assert rows and {(row.path, row.can_torch_compile) for row in rows} == {("kernel", False)}
    before = kernel_calls(case.model)
    with torch.no_grad():
        out = case.model(*case.args)
        assert kernel_calls(case.model) == before + len(rows)
        assert (out - case.reference(*case.args)).abs().max() > 1.0  # the offset shows
        with kp.kernels_disabled():
            _assert_original(case.model(*case.args), case, case.args, rtol=0.0, atol=0.0)
    assert kernel_calls(case.model) == before + len(rows)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_torch_export_runs_the_original(case: Case, strict: bool) -> None:
    with _without_the_kernel(case):
        program = torch.export.export(case.model, case.args, strict=strict)
    for args in (case.args, case.other_args):
        _assert_original(program.module()(*args), case, args)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_torch_export_under_require_names_the_layer(case: Case, strict: bool) -> None:
    """Non-strict: KernelUnavailableError. Strict: Dynamo's Unsupported (a graph break) carrying the same message."""
    first = next(row.name for row in kp.explain(case.model) if row.layer_name == case.layer)
    error = torch._dynamo.exc.Unsupported if strict else kp.KernelUnavailableError
    with (
        kp.kernel_policy("require"),
        pytest.raises(error, match=rf"module '{re.escape(first)}' .*cannot be traced under export"),
    ):
        torch.export.export(case.model, case.args, strict=strict)


def test_jit_trace_runs_the_original(case: Case) -> None:
    with _without_the_kernel(case):
        traced: Any = torch.jit.trace(case.model, case.args, check_trace=False)  # type: ignore[no-untyped-call]
    for args in (case.args, case.other_args):
        _assert_original(traced(*args), case, args)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_onnx_export_runs_the_original_in_onnxruntime(case: Case, dynamo: bool, tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    if dynamo:
        pytest.importorskip("onnxscript")
    path = tmp_path / "model.onnx"
    with _without_the_kernel(case):
        torch.onnx.export(case.model, case.args, str(path), dynamo=dynamo, input_names=case.names, output_names=["out"])
    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for args in (case.args, case.other_args):
        (out,) = session.run(None, {name: arg.numpy() for name, arg in zip(case.names, args, strict=True)})
        _assert_original(torch.from_numpy(out), case, args, rtol=1e-4, atol=1e-5)


def _coreml(ct: Any, module: nn.Module, case: Case, source: str) -> tuple[tuple[str, ...], Any]:
    """``(("converted", *MIL op types), mlmodel)`` or ``(("failed", error type, message), None)``."""
    options = {
        "convert_to": "mlprogram",
        "minimum_deployment_target": ct.target.iOS17,
        "compute_precision": ct.precision.FLOAT32,
    }
    try:
        if source == "jit.trace":
            traced = torch.jit.trace(module, case.args, check_trace=False)  # type: ignore[no-untyped-call]
            inputs = [
                ct.TensorType(name=n, shape=tuple(a.shape), dtype=a.numpy().dtype)
                for n, a in zip(case.names, case.args, strict=True)
            ]
            mlmodel = ct.convert(traced, inputs=inputs, **options)
        else:
            mlmodel = ct.convert(torch.export.export(module, case.args).run_decompositions({}), **options)
    except Exception as error:  # noqa: BLE001 - whatever coremltools does, it must do it with and without kernelpolicy
        return ("failed", type(error).__name__, str(error)), None
    ops = tuple(op.op_type for op in mlmodel._mil_program.functions["main"].operations)
    return ("converted", *ops), mlmodel


@pytest.mark.parametrize("source", ["jit.trace", "torch.export"])
def test_coreml_converts_as_without_kernelpolicy(case: Case, source: str) -> None:
    ct = pytest.importorskip("coremltools")
    with warnings.catch_warnings(), _without_the_kernel(case):
        warnings.simplefilter("ignore")  # coremltools: "Torch version ... has not been tested", op renames
        outcome, mlmodel = _coreml(ct, case.model, case, source)
        assert outcome == _coreml(ct, case.reference, case, source)[0]
    if case.name == "demo":  # Linear, RMSNorm, SiLU: Core ML converts it (Llama: no new_ones; RT-DETR: rank 6)
        assert outcome[0] == "converted", outcome
    if mlmodel is not None and sys.platform == "darwin":  # Core ML predicts on macOS only
        feeds = {
            n: a.numpy().astype("int32" if not a.is_floating_point() else "float32")
            for n, a in zip(case.names, case.args, strict=True)
        }
        (out,) = mlmodel.predict(feeds).values()
        _assert_original(torch.from_numpy(out), case, case.args, rtol=1e-3, atol=1e-4)


def test_without_kernelpolicy_the_test_kernel_defeats_every_tracer(repos: dict[str, Path]) -> None:
    """The same kernel bound by ``kernels.kernelize`` alone: what the exporters meet without the fallback."""
    torch.manual_seed(0)
    model = DemoModel(16).eval()
    with local_mapping({"RMSNorm": repos["RMSNorm"]}):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    x, y = _inputs("demo", 1), _inputs("demo", 2)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"tolist\(\)"):
        torch.export.export(model, x, strict=True)
    with pytest.raises(RuntimeError, match="data-dependent"):
        torch.export.export(model, x, strict=False)
    with pytest.warns(torch.jit._trace.TracerWarning, match="constant"):
        traced: Any = torch.jit.trace(model, x, check_trace=False)  # type: ignore[no-untyped-call]
    assert torch.equal(traced(*y), traced(*x))  # the output is a constant: the input is not read


# --- a parent that reshapes for its child's kernel: kp.will_use_kernel ---------------------------------------------

HEADS, LEVELS, POINTS = 2, 2, 3


@kp.use_kernel_forward_from_hub("KpPointSum")
class PointSum(nn.Module):
    """Sums each head's sampling locations. The original takes ``(batch, queries, heads, levels * points * 2)``;
    the hub kernel (``point_sum``) takes the 6D ``(batch, queries, heads, levels, points, 2)`` of deformable
    attention, and rejects any other rank."""

    def forward(self, locations: torch.Tensor) -> torch.Tensor:
        return locations.sum(-1)


class SamplingHead(nn.Module):
    """Projects queries to sampling locations, in the layout its child's path takes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, HEADS * LEVELS * POINTS * 2)
        self.point_sum = PointSum()

    def forward(self, queries: torch.Tensor) -> torch.Tensor:
        batch, length, _ = queries.shape
        locations = self.proj(queries).view(batch, length, HEADS, LEVELS, POINTS, 2)
        if kp.will_use_kernel(self.point_sum):
            return self.point_sum(locations)  # type: ignore[no-any-return]
        return self.point_sum(locations.flatten(3))  # type: ignore[no-any-return]


Q = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(4))
Q2 = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(5))
PATHS = [("prefer", True), ("disable", False)]


@pytest.fixture
def head(repos: dict[str, Path]) -> SamplingHead:
    torch.manual_seed(0)
    head = SamplingHead().eval()
    _kernelize(head, repos, "KpPointSum")
    return head


def _expected(head: SamplingHead, queries: torch.Tensor, kernel: bool) -> torch.Tensor:
    with kp.kernels_disabled(), torch.no_grad():
        return head(queries) + (OFFSET if kernel else 0.0)  # type: ignore[no-any-return]


def _call_targets(graph: torch.fx.Graph) -> list[str]:
    return [str(node.target) for node in graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize(("mode", "kernel"), PATHS)
def test_head_eager_takes_the_path_of_the_policy(head: SamplingHead, mode: str, kernel: bool) -> None:
    expected = _expected(head, Q, kernel)
    with kp.kernel_policy(mode), kp.record_calls() as calls, torch.no_grad():  # type: ignore[arg-type]
        assert kp.will_use_kernel(head.point_sum) is kernel
        torch.testing.assert_close(head(Q), expected)
    assert calls.by_layer()["KpPointSum"] == {("kernel" if kernel else "original"): 1}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize(("mode", "kernel"), PATHS)
def test_head_torch_export_bakes_the_branch_of_the_policy(
    head: SamplingHead, mode: str, kernel: bool, strict: bool
) -> None:
    with kp.kernel_policy(mode):  # type: ignore[arg-type]
        program = torch.export.export(head, (Q,), strict=strict)
    targets = _call_targets(program.graph)
    assert ("kp_exporters.point_sum.default" in targets) is kernel
    assert any("flatten" in target for target in targets) is not kernel  # the original's reshape
    for queries in (Q, Q2):
        torch.testing.assert_close(program.module()(queries), _expected(head, queries, kernel))


@pytest.mark.parametrize(("mode", "kernel"), PATHS)
def test_head_jit_trace_records_the_branch_of_the_policy(head: SamplingHead, mode: str, kernel: bool) -> None:
    with kp.kernel_policy(mode):  # type: ignore[arg-type]
        traced: Any = torch.jit.trace(head, (Q,), check_trace=False)  # type: ignore[no-untyped-call]
    assert (OP in str(traced.inlined_graph)) is kernel
    for queries in (Q, Q2):
        torch.testing.assert_close(traced(queries), _expected(head, queries, kernel))


def _point_sum_onnx_dynamo(op: Any) -> Callable[[Any], Any]:
    def point_sum(locations: Any) -> Any:
        axes = op.Constant(value_ints=[3, 4, 5])
        return op.Add(op.ReduceSum(locations, axes, keepdims=0), op.Constant(value_float=OFFSET))

    return point_sum


def _point_sum_onnx_torchscript(g: Any, locations: Any) -> Any:
    axes = g.op("Constant", value_t=torch.tensor([3, 4, 5]))
    return g.op("Add", g.op("ReduceSum", locations, axes, keepdims_i=0), g.op("Constant", value_t=torch.tensor(OFFSET)))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize(("mode", "kernel"), PATHS)
def test_head_onnx_export_of_each_branch_runs_in_onnxruntime(
    head: SamplingHead, mode: str, kernel: bool, dynamo: bool, tmp_path: Path
) -> None:
    """The kernel's op needs an ONNX translation (a custom-op kernel's author gives one); the original needs none."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    onnxscript = pytest.importorskip("onnxscript") if dynamo else None
    path = str(tmp_path / "head.onnx")
    with kp.kernel_policy(mode):  # type: ignore[arg-type]
        if onnxscript is not None:
            table: dict[Callable[..., Any], Callable[..., Any]] = {
                torch.ops.kp_exporters.point_sum.default: _point_sum_onnx_dynamo(onnxscript.opset18)
            }
            torch.onnx.export(head, (Q,), path, dynamo=True, input_names=["queries"], custom_translation_table=table)
        else:
            torch.onnx.utils.register_custom_op_symbolic(OP, _point_sum_onnx_torchscript, 17)
            try:
                torch.onnx.export(head, (Q,), path, dynamo=False, input_names=["queries"], opset_version=17)
            finally:
                torch.onnx.utils.unregister_custom_op_symbolic(OP, 17)
    model = onnx.load(path)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for queries in (Q, Q2):
        (out,) = session.run(None, {"queries": queries.numpy()})
        torch.testing.assert_close(torch.from_numpy(out), _expected(head, queries, kernel), rtol=1e-4, atol=1e-5)

"""The benchmark sections. Each returns a :class:`Section` of measured groups and facts.

Timing goes through :mod:`benchmarks._timing` only. Each section also checks,
outside the timed loops, that what it times is what it claims to time (the
kernel is bound, outputs agree, compiles happened); it never checks a timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint

import kernelpolicy
from kernelpolicy import kernel_policy, kernels_disabled
from kernelpolicy.testing import kernel_calls, tiny_llama

from . import _layers
from ._timing import Group, Settings, Variant, measure, summarize

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["SECTIONS", "RunContext", "Section"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunContext:
    """What every section gets: the measurement settings and a folder for kernel repositories."""

    settings: Settings
    quick: bool
    repos: _layers.KernelRepos


@dataclass
class Section:
    name: str
    title: str
    description: str
    groups: list[Group] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "description": self.description,
            "seconds": self.seconds,
            "groups": [g.as_json() for g in self.groups],
            "info": self.info,
        }


# --- 1. eager_noop ------------------------------------------------------------------------------------


def eager_noop(ctx: RunContext) -> Section:
    section = Section(
        "eager_noop",
        "Per-call dispatch cost of a no-op kernel layer, eager",
        "`module(x)` with x = torch.zeros(1); the Noop kernel's forward returns x, so the time is dispatch only. "
        "Ratios are to kernels' own direct binding (the floor: kernels.kernelize, never attached).",
    )
    modules = _layers.noop_modules(ctx.repos)
    direct, direct_again, policy_ctc, policy_plain = (
        modules[k] for k in ("direct", "direct_again", "policy_ctc", "policy_plain")
    )
    custom_op, seed, plain = modules["custom_op"], modules["seed"], modules["plain"]
    no_backward = modules["policy_no_backward"]
    section.info["kernelpolicy forward, can_torch_compile=True"] = _layers.dispatch_variant(policy_ctc)
    section.info["kernelpolicy forward, can_torch_compile=False"] = _layers.dispatch_variant(policy_plain)
    section.info["kernelpolicy forward, has_backward=False"] = _layers.dispatch_variant(no_backward)

    x = torch.zeros(1)
    for module in (direct, policy_ctc, policy_plain, no_backward, custom_op, seed, plain):
        if module(x) is not x:
            raise RuntimeError(f"{type(module).__name__} did not return its input")

    def call(module: torch.nn.Module) -> dict[str, Any]:
        return {"m": module, "x": x}

    baseline = "(a) kernels direct binding"
    variants = [
        Variant(baseline, "m(x)", call(direct), note="kernels.kernelize: forward = MethodType(kernel.forward, m)"),
        Variant("(a') kernels direct binding, second instance (A/A control)", "m(x)", call(direct_again)),
        Variant("(b) kernelpolicy prefer, can_torch_compile=True", "m(x)", call(policy_ctc)),
        Variant("(b) kernelpolicy prefer, can_torch_compile=False", "m(x)", call(policy_plain)),
        Variant("(b) kernelpolicy prefer, has_backward=False", "m(x)", call(no_backward)),
        Variant("(b) kernelpolicy under kernels_disabled()", "m(x)", call(policy_ctc), context=kernels_disabled),
        Variant(
            "(b) kernelpolicy under kernel_policy(Other='disable')",
            "m(x)",
            call(policy_ctc),
            context=lambda: kernel_policy(Other="disable"),
        ),
        Variant("(b) kernelpolicy, 3 nested scopes active", "m(x)", call(policy_ctc), context=_layers.nested_scopes),
        Variant("(c) CustomOp-style self._forward_method(x)", "m(x)", call(custom_op)),
        Variant("(d) seed: is_compiling() or CONFIG.disabled", "m(x)", call(seed)),
        Variant("plain module, no kernels (class forward)", "m(x)", call(plain)),
    ]
    section.groups.append(
        measure("no-op layer, module(x)", variants, baseline=baseline, settings=ctx.settings, outer=torch.no_grad)
    )
    # With grad enabled a kernel without backward asks whether autograd records the call (it does not here:
    # x needs no grad, the layer has no parameters, so the kernel runs); the other variants ask nothing.
    if no_backward(x) is not x:
        raise RuntimeError("the kernel without backward did not run with grad enabled and nothing requiring grad")
    grad_variants = [
        Variant(baseline, "m(x)", call(direct)),
        Variant("(b) kernelpolicy prefer, can_torch_compile=True", "m(x)", call(policy_ctc)),
        Variant("(b) kernelpolicy prefer, has_backward=False", "m(x)", call(no_backward)),
    ]
    section.groups.append(
        measure("no-op layer, module(x), grad enabled", grad_variants, baseline=baseline, settings=ctx.settings)
    )
    # The training forward: x requires grad, so autograd records the call and the forward notes its policy for a
    # recomputation (kernelpolicy._forward._replay); inside torch's non-reentrant checkpoint it also records it per frame.
    xg = torch.zeros(1, requires_grad=True)
    training = {"checkpoint": torch.utils.checkpoint.checkpoint, "x": xg}
    training_variants = [
        Variant(baseline, "m(x)", {"m": direct, "x": xg}),
        Variant("(b) kernelpolicy prefer, can_torch_compile=True", "m(x)", {"m": policy_ctc, "x": xg}),
        Variant(
            "(a) kernels direct binding, in checkpoint(use_reentrant=False)",
            "checkpoint(m, x, use_reentrant=False)",
            {**training, "m": direct},
        ),
        Variant(
            "(b) kernelpolicy prefer, in checkpoint(use_reentrant=False)",
            "checkpoint(m, x, use_reentrant=False)",
            {**training, "m": policy_ctc},
            ratio_to="(a) kernels direct binding, in checkpoint(use_reentrant=False)",
        ),
    ]
    section.groups.append(
        measure(
            "no-op layer, training forward (x requires grad)",
            training_variants,
            baseline=baseline,
            settings=ctx.settings,
        )
    )
    return section


# --- 2. eager_rmsnorm ---------------------------------------------------------------------------------


def eager_rmsnorm(ctx: RunContext) -> Section:
    section = Section(
        "eager_rmsnorm",
        "RMSNorm (hidden 4096) with a bit-identical local kernel, eager",
        "`module(x)` with x of shape (batch, 4096), float32, under torch.no_grad(). Ratios are to kernels' "
        "direct binding; 'original forward, no kernels' is a reference row (a never-kernelized RMSNorm).",
    )
    hidden = 4096
    modules = _layers.rms_norm_modules(ctx.repos, hidden)
    direct, direct_again, policy_ctc, policy_plain, original = (
        modules[k] for k in ("direct", "direct_again", "policy_ctc", "policy_plain", "original")
    )
    section.info["kernelpolicy forward, can_torch_compile=True"] = _layers.dispatch_variant(policy_ctc)
    section.info["kernelpolicy forward, can_torch_compile=False"] = _layers.dispatch_variant(policy_plain)

    for batch in (1, 8):
        x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            expected = original(x)
            for module in (direct, direct_again, policy_ctc, policy_plain):
                if not torch.equal(module(x), expected):
                    raise RuntimeError("the RMSNorm kernel is not bit-identical to the original forward")
        baseline = "(a) kernels direct binding"
        variants = [
            Variant(baseline, "m(x)", {"m": direct, "x": x}),
            Variant("(a') kernels direct binding, second instance (A/A control)", "m(x)", {"m": direct_again, "x": x}),
            Variant("(b) kernelpolicy prefer, can_torch_compile=True", "m(x)", {"m": policy_ctc, "x": x}),
            Variant("(b) kernelpolicy prefer, can_torch_compile=False", "m(x)", {"m": policy_plain, "x": x}),
            Variant("original forward, no kernels (reference)", "m(x)", {"m": original, "x": x}),
        ]
        section.groups.append(
            measure(
                f"RMSNorm(4096), batch {batch}", variants, baseline=baseline, settings=ctx.settings, outer=torch.no_grad
            )
        )
    return section


# --- 3. llama -----------------------------------------------------------------------------------------


def llama(ctx: RunContext) -> Section:
    section = Section(
        "llama",
        "Tiny transformers Llama with a local RMSNorm kernel",
        "LlamaForCausalLM (hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads, vocab 256), 5 RMSNorm "
        "layers bound to a bit-identical local kernel. Baseline: kernels.kernelize; other rows: "
        "kernelpolicy.kernelize, on a second instance built with the same seed (under prefer, under "
        "verify, which also runs and compares the original forward, and inside record_calls()).",
    )
    import kernels
    import transformers

    section.info["transformers"] = transformers.__version__
    repo = ctx.repos.rms_norm(can_torch_compile=False)
    base: Any = ctx.repos.kernels_kernelize(tiny_llama(), "RMSNorm", repo, mode=kernels.Mode.INFERENCE)
    policy: Any = ctx.repos.policy_kernelize(tiny_llama(), "RMSNorm", repo)
    _layers.kernel_function(base.model.norm)
    section.info["kernelpolicy forward"] = _layers.dispatch_variant(policy.model.norm)

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    max_new = 16

    def generate(model: Any) -> torch.Tensor:
        out: torch.Tensor = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        return out

    with torch.no_grad():
        expected = base(ids).logits
        calls_before = kernel_calls(policy)
        if not torch.equal(policy(ids).logits, expected):
            raise RuntimeError("baseline and kernelpolicy Llama logits differ")
        if kernel_calls(policy) - calls_before != 5:
            raise RuntimeError("the kernelpolicy Llama did not run its 5 RMSNorm kernels")
        tokens = generate(base)
        if not torch.equal(tokens, generate(policy)):
            raise RuntimeError("baseline and kernelpolicy Llama generate different tokens")
    new_tokens = int(tokens.shape[1] - ids.shape[1])
    section.info["new tokens per generate"] = new_tokens

    baseline = "kernels.kernelize"
    section.groups.append(
        measure(
            "forward, input ids 1x16",
            [
                Variant(baseline, "m(ids)", {"m": base, "ids": ids}),
                Variant("kernelpolicy.kernelize", "m(ids)", {"m": policy, "ids": ids}),
                Variant(
                    "kernelpolicy under kernel_policy('verify')",
                    "m(ids)",
                    {"m": policy, "ids": ids},
                    context=lambda: kernelpolicy.kernel_policy("verify"),
                ),
                Variant(
                    "kernelpolicy inside record_calls()",
                    "m(ids)",
                    {"m": policy, "ids": ids},
                    context=kernelpolicy.record_calls,
                ),
            ],
            baseline=baseline,
            settings=ctx.settings,
            outer=torch.no_grad,
        )
    )
    group = measure(
        f"generate, max_new_tokens={max_new}, do_sample=False",
        [
            Variant(baseline, "g(m)", {"g": generate, "m": base}),
            Variant("kernelpolicy.kernelize", "g(m)", {"g": generate, "m": policy}),
        ],
        baseline=baseline,
        settings=ctx.settings,
        outer=torch.no_grad,
    )
    reference = group.variant(baseline)
    for result in group.variants:
        throughput = [ref / value for ref, value in zip(reference.samples_ns, result.samples_ns, strict=True)]
        result.extra["tokens/s"] = new_tokens / (result.median_ns / 1e9)
        result.extra["throughput ratio"] = statistics.median(throughput)
    group.extra_columns = ["tokens/s", "throughput ratio"]
    section.groups.append(group)
    return section


# --- 4. compiled --------------------------------------------------------------------------------------


def compiled(ctx: RunContext) -> Section:
    section = Section(
        "compiled",
        "torch.compile(fullgraph=True, backend='inductor') of a small kernelized model",
        "DemoModel(32) (3 RMSNorm layers) kernelized with a can_torch_compile=True local RMSNorm kernel, "
        "input (8, 32), under torch.no_grad(). Baseline: the same architecture kernelized by kernels.kernelize "
        "and compiled the same way, so the ratio is kernelpolicy's guard cost. Each model has its own copy of "
        "DemoModel.forward's code object, hence its own Dynamo cache.",
    )
    import kernels
    from torch._dynamo.utils import counters

    from kernelpolicy.testing import DemoModel

    torch._dynamo.reset()
    counters.clear()

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    repo = ctx.repos.rms_norm(can_torch_compile=True)
    mode = kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE
    torch.manual_seed(0)
    base = ctx.repos.kernels_kernelize(
        _layers.own_code(DemoModel, "BaselineDemoModel")(32).eval(), "RMSNorm", repo, mode
    )
    torch.manual_seed(0)
    policy_model: Any = ctx.repos.policy_kernelize(
        _layers.own_code(DemoModel, "PolicyDemoModel")(32).eval(), "RMSNorm", repo, "inference|torch_compile"
    )
    section.info["kernelpolicy forward"] = _layers.dispatch_variant(policy_model.norm)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    compiled_base: Any = torch.compile(base, fullgraph=True, backend="inductor")
    compiled_policy: Any = torch.compile(policy_model, fullgraph=True, backend="inductor")

    with torch.no_grad():
        with kernels_disabled():
            eager_disabled = policy_model(x)
        eager = policy_model(x)
        start, before = time.perf_counter(), graphs()
        out = compiled_base(x)
        section.info["baseline: compiles"] = graphs() - before
        section.info["baseline: first call incl. compile (s)"] = round(time.perf_counter() - start, 3)
        torch.testing.assert_close(out, eager)

        steps: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]] = [
            ("prefer", contextlib.nullcontext),
            ("kernels_disabled()", kernels_disabled),
            ("prefer", contextlib.nullcontext),
            ("kernels_disabled()", kernels_disabled),
        ]
        before = graphs()
        after_each: list[int] = []
        for label, scope in steps:
            start = time.perf_counter()
            with scope():
                out = compiled_policy(x)
            torch.testing.assert_close(out, eager_disabled if label != "prefer" else eager)
            after_each.append(graphs() - before)
            if len(after_each) == 1:
                section.info["kernelpolicy: first call incl. compile (s)"] = round(time.perf_counter() - start, 3)
        section.info["kernelpolicy: compiles over prefer -> disabled -> prefer -> disabled"] = after_each[-1]
        section.info["kernelpolicy: cumulative compiles after each step"] = after_each
        section.info["expected kernelpolicy compiles"] = 2
    for model in (base, policy_model):
        code = type(model).forward.__code__
        section.info[f"{type(model).__name__}: Dynamo cache entries"] = len(
            torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        )

    baseline = "plain kernels.kernelize, compiled"
    before = graphs()
    section.groups.append(
        measure(
            "compiled model(x), input (8, 32)",
            [
                Variant(baseline, "m(x)", {"m": compiled_base, "x": x}),
                Variant("kernelpolicy, compiled, prefer", "m(x)", {"m": compiled_policy, "x": x}),
                Variant(
                    "kernelpolicy, compiled, under kernels_disabled()",
                    "m(x)",
                    {"m": compiled_policy, "x": x},
                    context=kernels_disabled,
                ),
            ],
            baseline=baseline,
            settings=ctx.settings,
            outer=torch.no_grad,
        )
    )
    section.info["compiles during timing"] = graphs() - before
    section.info["graph breaks"] = int(sum(counters["graph_break"].values()))
    section.info["graph break reasons"] = sorted(counters["graph_break"])
    return section


# --- 5. import ----------------------------------------------------------------------------------------

_IMPORT_TORCH = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
print(json.dumps({"torch": t1 - t0}))
"""

_IMPORT_BOTH = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kernelpolicy
kernelpolicy.attach  # the layer machinery is imported on first use: count it
t2 = time.perf_counter()
print(json.dumps({
    "torch": t1 - t0,
    "kernelpolicy": t2 - t1,
    "total": t2 - t0,
    "kernels_imported": "kernels" in sys.modules,
    "huggingface_hub_imported": "huggingface_hub" in sys.modules,
}))
"""


def _run_python(code: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "KERNELPOLICY"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"import subprocess failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def import_time(ctx: RunContext) -> Section:
    runs = 3 if ctx.quick else 7
    section = Section(
        "import",
        "`import kernelpolicy` on top of `import torch`, fresh interpreters",
        f"{runs} rounds, each a fresh `{Path(sys.executable).name} -c` subprocess importing torch alone, then one "
        "importing torch then kernelpolicy (interleaved). Times are taken with perf_counter inside the "
        "subprocess; one 'call' is one import.",
    )
    torch_alone: list[float] = []
    both_total: list[float] = []
    increment: list[float] = []
    leaked: set[str] = set()
    for _ in range(runs):
        torch_alone.append(_run_python(_IMPORT_TORCH)["torch"] * 1e9)
        both = _run_python(_IMPORT_BOTH)
        both_total.append(both["total"] * 1e9)
        increment.append(both["kernelpolicy"] * 1e9)
        leaked |= {name for name in ("kernels", "huggingface_hub") if both[f"{name}_imported"]}
    baseline = "import torch"
    section.groups.append(
        Group(
            title="import time (one call = one import)",
            baseline=baseline,
            variants=[
                summarize(baseline, torch_alone, torch_alone, ratio_to=baseline),
                summarize("import torch; import kernelpolicy (+ layers)", both_total, torch_alone, ratio_to=baseline),
                summarize("import kernelpolicy, after torch (in-process)", increment, torch_alone, ratio_to=baseline),
            ],
            unit="import",
        )
    )
    diff_ms = (statistics.median(both_total) - statistics.median(torch_alone)) / 1e6
    section.info["median(torch + kernelpolicy) - median(torch) (ms)"] = round(diff_ms, 2)
    section.info["median in-process kernelpolicy import after torch (ms)"] = round(
        statistics.median(increment) / 1e6, 2
    )
    section.info["kernels imported by import kernelpolicy"] = "kernels" in leaked
    section.info["huggingface_hub imported by import kernelpolicy"] = "huggingface_hub" in leaked
    return section


# --- 6. scopes ----------------------------------------------------------------------------------------


def scopes(ctx: RunContext) -> Section:
    section = Section(
        "scopes",
        "Reading the policy and entering/leaving scopes",
        "Each row is one call or one `with` block (enter + leave, empty body). Scope objects are created once "
        "unless the row says otherwise. References: ContextVar.get() for reads, an empty "
        "`with contextlib.nullcontext():` for scopes.",
    )
    var: ContextVar[int] = ContextVar("benchmark", default=0)
    null = contextlib.nullcontext()
    disable = kernel_policy("disable")
    inner = kernel_policy(RMSNorm="disable")
    get = "ContextVar.get()"
    empty = "with nullcontext(): pass"
    variants = [
        Variant(get, "var.get()", {"var": var}),
        Variant("kernelpolicy.current_policy()", "current_policy()", {"current_policy": kernelpolicy.current_policy}),
        Variant(empty, "with null:\n    pass", {"null": null}, ratio_to=empty),
        Variant("with kernel_policy('disable'): pass", "with scope:\n    pass", {"scope": disable}, ratio_to=empty),
        Variant(
            "with kernel_policy(RMSNorm='disable'): pass, nested in kernel_policy('prefer')",
            "with scope:\n    pass",
            {"scope": inner},
            context=lambda: kernel_policy("prefer"),
            ratio_to=empty,
        ),
        Variant(
            "with kernels_disabled(): pass (called each time)",
            "with kernels_disabled():\n    pass",
            {"kernels_disabled": kernels_disabled},
            ratio_to=empty,
        ),
        Variant(
            "with kernel_policy('disable'): pass (constructed each time)",
            "with kernel_policy('disable'):\n    pass",
            {"kernel_policy": kernel_policy},
            ratio_to=empty,
        ),
    ]
    section.groups.append(measure("policy reads and scopes", variants, baseline=get, settings=ctx.settings))
    return section


SECTIONS: dict[str, Callable[[RunContext], Section]] = {
    "eager_noop": eager_noop,
    "eager_rmsnorm": eager_rmsnorm,
    "llama": llama,
    "compiled": compiled,
    "import": import_time,
    "scopes": scopes,
}

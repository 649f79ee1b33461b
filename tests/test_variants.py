"""Named kernel variants chosen per call: ``kernelize(..., variant=)`` and policy entries ``"kernel:a|b"``.

Real local kernel repositories for Llama's RMSNorm: the default kernel adds 100 to its output, the variant
``fast`` 200 and the variant ``half`` 300 (declared for bfloat16 only), so every output shows which one ran.
The model sums two RMSNorm layers applied to its input.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _helpers import CountingBackend, NormPair, graph_breaks
from torch import nn
from torch._dynamo.utils import counters

import kernelpolicy as kp
from kernelpolicy.testing import kernelize_locally, local_mapping, rms_norm_kernel_source, write_kernel_repo

X = torch.ones(2, 16)
BF16 = torch.ones(2, 16, dtype=torch.bfloat16)
#: The model's output is 2 + 2 * the offset of the kernel that ran: this is that offset.
ORIGINAL, DEFAULT, FAST, HALF = 0, 100, 200, 300


def offset(out: torch.Tensor) -> int:
    return round((out.float().mean().item() - 2) / 2)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {
        name: write_kernel_repo(
            root / name, rms_norm_kernel_source(offset=float(value), can_torch_compile=True), name=f"norm-{name}"
        )
        for name, value in (("default", DEFAULT), ("fast", FAST), ("half", HALF))
    }


@pytest.fixture
def bind(repos: dict[str, Path]) -> Callable[..., nn.Module]:
    def make(model: nn.Module, *variants: str) -> nn.Module:
        kernelize_locally(model, {"RMSNorm": repos["default"]})
        for name in variants:
            with local_mapping({"RMSNorm": repos[name]}, inherit=False):
                kp.kernelize(model, mode="inference", device="cpu", variant=name)
        return model

    return make


@pytest.fixture
def model(bind: Callable[..., nn.Module]) -> nn.Module:
    return bind(NormPair().eval(), "fast", "half")


@pytest.fixture(autouse=True)
def _no_rules() -> Iterator[None]:
    yield
    kp.kernel_accepts("RMSNorm", variant="half")


def test_the_policy_chooses_the_variant_per_call(model: nn.Module) -> None:
    assert offset(model(X)) == DEFAULT  # prefer: the kernel bound without a variant name
    expected = {
        "kernel:fast": FAST,
        "kernel:half": HALF,
        "kernel:fast|half": FAST,
        "kernel:default": DEFAULT,
        "kernel:half|default": HALF,
        "disable": ORIGINAL,
    }
    for entry, value in expected.items():
        with kp.kernel_policy(RMSNorm=entry):
            assert offset(model(X)) == value, entry
    with kp.kernel_policy("disable", RMSNorm="kernel:fast"):  # a layer entry beats the default mode
        assert offset(model(X)) == FAST


def test_the_first_variant_that_accepts_the_call_runs(model: nn.Module) -> None:
    kp.kernel_accepts("RMSNorm", dtypes=[torch.bfloat16], variant="half")
    with kp.kernel_policy(RMSNorm="kernel:half|fast"), kp.record_calls() as calls:
        assert offset(model(X)) == FAST  # float32: half refuses, fast takes it
        assert offset(model(BF16)) == HALF
    reasons = {key[3] for key, _ in calls.items()}
    assert reasons == {
        f"variant 'fast' ({model.a._kernelpolicy.variants['fast'].repository})",
        f"variant 'half' ({model.a._kernelpolicy.variants['half'].repository})",
    }
    with kp.kernel_policy(RMSNorm="kernel:half"):
        row = kp.explain(model, X).rows[0]
    assert row.mode == "kernel:half" and row.path == "original"
    assert row.reason == (
        "no variant can run ('half': kernel does not accept this call: argument 0 (hidden_states) has dtype "
        "torch.float32; the kernel accepts torch.bfloat16)"
    )


def test_a_module_without_that_variant(bind: Callable[..., nn.Module]) -> None:
    model = NormPair().eval()
    bind(model)
    bind(model.a, "fast")  # only the first norm has the variant

    def single(norm: nn.Module) -> int:
        return round(norm(X).mean().item() - 1)  # the offset of the kernel that ran in one norm

    with kp.kernel_policy(RMSNorm="kernel:fast"):
        assert (single(model.a), single(model.b)) == (FAST, ORIGINAL)
        rows = {row.name: row for row in kp.explain(model)}
    assert rows["b"].reason == "no variant can run ('fast' not bound)"
    with kp.kernel_policy(RMSNorm="kernel:fast|default"):
        assert (single(model.a), single(model.b)) == (FAST, DEFAULT)


def test_bad_names_are_errors_that_list_the_bound_ones(model: nn.Module) -> None:
    with pytest.raises(kp.PolicyError) as raised, kp.kernel_policy(RMSNorm="kernel:fsat"):
        pass
    message = str(raised.value)  # the bound names are the process's: other tests bind others
    assert message.startswith(
        "kernel_policy: no kernel variant 'fsat' is bound for kernel layer 'RMSNorm' (in RMSNorm=kernel:fsat); bound: "
    )
    assert "'fast', 'half', and 'default' (the kernel bound without a variant name). " in message
    assert message.endswith("kernelpolicy.kernelize(model, mode=..., variant='fsat') binds one")
    with pytest.raises(
        kp.PolicyError, match=r"unknown kernel policy mode 'fast' .*; a kernel variant is written 'kernel:fast'"
    ):
        kp.kernel_policy(RMSNorm="fast")
    with pytest.raises(kp.PolicyError, match="variant 'prefer' in 'kernel:prefer' for layer 'RMSNorm'"):
        kp.kernel_policy(RMSNorm="kernel:prefer")
    with pytest.raises(kp.PolicyError, match="variant 'fast' named twice"):
        kp.Policy.parse("RMSNorm=kernel:fast|fast")
    with pytest.raises(kp.PolicyError, match=r"kernelize\(variant=\.\.\.\) takes an identifier other than the modes"):
        kp.kernelize(NormPair(), mode="inference", variant="default")
    with pytest.raises(kp.PolicyError, match="no kernel variant 'nope'"):
        kp.set_default_policy(RMSNorm="kernel:nope")


def test_the_text_syntax_and_values() -> None:
    policy = kp.Policy.parse("disable, RMSNorm=kernel: fast | default")
    assert str(policy) == "disable,RMSNorm=kernel:fast|default"
    assert policy == kp.Policy("disable", RMSNorm="kernel:fast|default")
    assert policy.entry_for("RMSNorm") == "kernel:fast|default" and policy.mode_for("RMSNorm") == "prefer"
    assert policy.variant_entries == (("RMSNorm", ("fast", "default")),)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_one_program_per_choice_without_graph_breaks(model: nn.Module) -> None:
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    counters.clear()
    entries = ["prefer", "kernel:fast", "disable", "kernel:half|fast"]
    for _ in range(2):
        for entry, value in zip(entries, [DEFAULT, FAST, ORIGINAL, HALF], strict=True):
            with kp.kernel_policy(RMSNorm=entry):
                assert offset(compiled(X)) == value, entry
    assert backend.compiles == len(entries) and graph_breaks() == 0
    with kp.kernel_policy(RMSNorm="kernel: fast"):  # another spelling of one choice: its program
        assert offset(compiled(X)) == FAST
    assert backend.compiles == len(entries)


def test_warmup_covers_variant_entries(model: nn.Module) -> None:
    """After a warm-up over variant entries, serving them compiles nothing (was: the first variant call did)."""
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    entries = ["prefer", "RMSNorm=kernel:fast", "disable", "RMSNorm=kernel:half|fast"]
    kp.warmup(compiled, X, policies=entries)
    warmed = backend.compiles
    for entry, value in zip(entries, [DEFAULT, FAST, ORIGINAL, HALF], strict=True):
        with kp.kernel_policy(kp.Policy.parse(entry)):
            assert offset(compiled(X)) == value, entry
    assert backend.compiles == warmed == len(entries)


def test_an_entry_named_first_later_recompiles_no_program(model: nn.Module) -> None:
    """A variant entry no scope named before (so new to the process-wide tables) leaves the programs compiled."""
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    entries = ["prefer", "kernel:fast", "disable"]
    for entry in entries:
        with kp.kernel_policy(RMSNorm=entry):
            compiled(X)
    with kp.kernel_policy(RMSNorm="kernel:half|default|fast"), kp.record_calls():  # a new entry, recorded too
        pass
    for entry, value in zip(entries, [DEFAULT, FAST, ORIGINAL], strict=True):
        with kp.kernel_policy(RMSNorm=entry):
            assert offset(compiled(X)) == value, entry
    assert backend.compiles == len(entries)


def test_threads_and_tasks_each_get_their_variant(model: nn.Module) -> None:
    wrong: list[str] = []
    start = threading.Barrier(3)

    def run(entry: str, value: int) -> None:
        start.wait()
        with kp.kernel_policy(RMSNorm=entry):
            for _ in range(100):
                if offset(model(X)) != value:
                    wrong.append(entry)

    threads = [
        threading.Thread(target=run, args=args)
        for args in (("kernel:fast", FAST), ("kernel:half", HALF), ("prefer", DEFAULT))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    async def task(entry: str, value: int) -> None:
        with kp.kernel_policy(RMSNorm=entry):
            for _ in range(20):
                await asyncio.sleep(0)
                if offset(model(X)) != value:
                    wrong.append(entry)

    async def main() -> None:
        await asyncio.gather(task("kernel:fast", FAST), task("kernel:half", HALF), task("disable", ORIGINAL))

    asyncio.run(main())
    assert wrong == []


def test_variants_survive_rekernelizing_and_deepcopy(model: nn.Module, repos: dict[str, Path]) -> None:
    with local_mapping({"RMSNorm": repos["default"]}):
        kp.kernelize(model, mode="inference", device="cpu")  # as transformers does on train() / eval()
    copied = copy.deepcopy(model)
    for each in (model, copied):
        with kp.kernel_policy(RMSNorm="kernel:fast"):
            assert offset(each(X)) == FAST
    with local_mapping({"RMSNorm": repos["default"]}, inherit=False):
        kp.kernelize(model, mode="inference", device="cpu", variant="half")  # the mapping's kernel replaces half
    with kp.kernel_policy(RMSNorm="kernel:half"):
        assert offset(model(X)) == DEFAULT


def test_verify_compares_a_variant_with_another_or_the_original(bind: Callable[..., nn.Module]) -> None:
    model = bind(NormPair().eval(), "fast")
    with kp.kernel_policy("verify", reference="fast"), pytest.raises(kp.KernelMismatchError) as raised:
        model(X)  # the default kernel (+100) against the variant fast (+200)
    assert str(raised.value).startswith(
        "kernel output differs from variant 'fast' for module 'a' (kernelpolicy.testing.RMSNorm, kernel layer 'RMSNorm')"
    )
    assert (raised.value.tested, raised.value.reference) == ("kernel", "variant 'fast'")
    with kp.kernel_policy(RMSNorm="kernel:fast", reference="original"), pytest.raises(kp.KernelMismatchError) as raised:
        model(X)
    assert str(raised.value).startswith("variant 'fast' output differs from the original forward for module 'a'")
    with kp.kernel_policy(RMSNorm="kernel:default", reference="default"), kp.record_calls() as calls:
        assert offset(model(X)) == DEFAULT  # a kernel against itself: equal
    assert {key[3].rsplit("; ", 1)[1] for key, _ in calls.items()} == {"verified against default"}
    with (
        pytest.raises(kp.PolicyError, match="reference='nope' names no kernel variant bound in this process"),
        kp.kernel_policy("verify", reference="nope"),
    ):
        pass
    assert str(kp.Policy.parse("verify,reference=fast")) == "verify,reference=fast"
    with pytest.raises(kp.PolicyError, match="reference must be 'original' or a kernel variant name"):
        kp.Policy("verify", reference="prefer")


@pytest.mark.usefixtures("fresh_dynamo")
def test_warmup_compiles_each_variant_choice_once(model: nn.Module) -> None:
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    report = kp.warmup(compiled, X, policies=["prefer", "RMSNorm=kernel:fast", "RMSNorm=kernel: fast", "disable"])
    assert [n for _, n in report.compiles] == [1, 1, 0, 1]  # the second spelling of fast reuses its program
    assert "  prefer,RMSNorm=kernel:fast: 1 compiled" in str(report)


RAISING_KERNEL = """
import torch
from torch import nn


class RMSNorm(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states):
        raise RuntimeError("bad variant: out of resources")
"""


def test_fallback_on_gives_way_to_the_next_variant_then_the_original(
    bind: Callable[..., nn.Module], tmp_path: Path
) -> None:
    """A variant raising an error ``fallback_on`` names: the next candidate runs, then the original."""
    model = bind(NormPair().eval(), "fast")
    with local_mapping(
        {"RMSNorm": write_kernel_repo(tmp_path / "bad", RAISING_KERNEL, name="norm-bad")}, inherit=False
    ):
        kp.kernelize(model, mode="inference", device="cpu", variant="bad")
    with kp.kernel_policy(RMSNorm="kernel:bad|fast", fallback_on=RuntimeError), kp.record_calls() as calls:
        assert offset(model(X)) == FAST
    with kp.kernel_policy(RMSNorm="kernel:bad|default", fallback_on=RuntimeError):
        assert offset(model(X)) == DEFAULT
    with kp.kernel_policy(RMSNorm="kernel:bad", fallback_on=RuntimeError):
        assert offset(model(X)) == ORIGINAL
    assert calls.by_layer()["RMSNorm"] == {"kernel": 2}  # the two norms ran fast; the failed tries are not calls
    with pytest.raises(RuntimeError, match="bad variant"), kp.kernel_policy(RMSNorm="kernel:bad|fast"):
        model(X)  # without fallback_on the variant's error propagates, as the kernel's does
    named_other = kp.kernel_policy(RMSNorm="kernel:bad|fast", fallback_on=ValueError)  # not the error raised
    with pytest.raises(RuntimeError, match="bad variant"), named_other:
        model(X)

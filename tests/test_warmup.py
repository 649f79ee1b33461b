"""``kernelpolicy.warmup``: one compile per program ahead of serving, clear errors past the recompile limit."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _helpers import NAMES, CountingBackend, three_kernel_layers

import kernelpolicy as kp

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _expected(policy: kp.Policy) -> float:
    return sum(10.0**i for i, name in enumerate(NAMES) if policy.mode_for(name) != "disable")


def test_warmup_compiles_each_program_once_then_serving_compiles_nothing() -> None:
    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()), fullgraph=True)
    x = torch.zeros(1)
    texts = ["disable", "require", "verify,KpA=disable", "prefer,KpA=disable,KpB=require", "KpC=disable"]
    policies = [kp.Policy.parse(text) for text in texts]
    report = kp.warmup(compiled, x, policies=texts)
    assert [policy for policy, _ in report.compiles] == policies
    assert [n for _, n in report.compiles] == [1, 1, 1, 0, 1]  # the 4th has the 3rd's program
    assert report.total == backend.compiles == 4
    assert str(report).splitlines()[0] == "warm-up: 4 graphs for 5 policies"
    for policy in policies * 3:  # serving in the warm-up thread: nothing compiles
        with kp.kernel_policy(policy):
            assert compiled(x).item() == _expected(policy)
    assert backend.compiles == 4
    # Warm-up compiles under explicit scopes, whose guards the unscoped process default also passes.
    assert compiled(x).item() == _expected(kp.Policy())
    assert backend.compiles == 4
    # Not asserted here: serving from fresh threads after a warm-up. TorchDynamo races on this
    # frame's cache there ("runtime guards failed even though they passed"): on torch 2.14.1, ten
    # fresh threads recompiled past the limit of 8 (FailOnRecompileLimitHit with fullgraph=True).
    # test_threads_see_their_own_policy_on_one_compiled_model reports those extra compiles.


def test_warmup_past_the_recompile_limit_names_policies_and_remedy() -> None:
    compiled = torch.compile(three_kernel_layers(), backend="eager", fullgraph=True)
    with (
        torch._dynamo.config.patch(recompile_limit=2),
        pytest.raises(RuntimeError, match=r"kernelpolicy\.warmup: compiling for policy 'prefer,KpB=disable'") as info,
    ):
        kp.warmup(compiled, torch.zeros(1), policies=["require", "KpA=disable", "KpB=disable"])
    message = str(info.value)
    assert "recompile_limit = 2" in message and "['require', 'prefer,KpA=disable']" in message
    assert "These 3 policies need 3 programs of one compiled frame" in message
    assert "set torch._dynamo.config.recompile_limit = 3 (or more) before warmup" in message


def test_warmup_rejects_bad_policy_text_before_compiling() -> None:
    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()), fullgraph=True)
    with pytest.raises(kp.PolicyError, match="warmup policy='fast'"):
        kp.warmup(compiled, torch.zeros(1), policies=["prefer", "fast"])
    assert backend.compiles == 0


def test_warmup_without_fullgraph_raises_at_the_recompile_limit_with_the_limit_it_needs() -> None:
    """Without fullgraph TorchDynamo would run the frame uncompiled past its limit, silently: warm-up raises."""
    compiled = torch.compile(three_kernel_layers(), backend=(backend := CountingBackend()))
    policies = ["disable", "require", "KpA=disable", "KpB=disable"]  # four programs
    with torch._dynamo.config.patch(recompile_limit=2), pytest.raises(RuntimeError) as info:
        kp.warmup(compiled, torch.zeros(1), policies=policies)
    message = str(info.value)
    assert message.startswith("kernelpolicy.warmup: compiling for policy 'prefer,KpA=disable' hit TorchDynamo's")
    assert "torch._dynamo.config.recompile_limit = 2" in message
    assert "These 4 policies need 4 programs of one compiled frame" in message
    assert "set torch._dynamo.config.recompile_limit = 4 (or more) before warmup" in message
    assert backend.compiles == 4  # counted under a raised limit: the programs are compiled
    with torch._dynamo.config.patch(recompile_limit=4):  # the fix: every policy finds its program
        report = kp.warmup(compiled, torch.zeros(1), policies=policies)
    assert [n for _, n in report.compiles] == [0, 0, 0, 0] and backend.compiles == 4
    for text in policies:
        with kp.kernel_policy(kp.Policy.parse(text)):
            assert compiled(torch.zeros(1)).item() == _expected(kp.Policy.parse(text))

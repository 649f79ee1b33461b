"""Per-request policies in transformers' continuous batching: a real tiny Llama, real managers, real steps.

The local RMSNorm kernel adds 0.5 to its output, so every greedy token sequence shows the path its
requests took; each request's tokens are compared with the same prompt generated alone (``generate``)
under its policy.
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy import batching
from kernelpolicy._forward import _mixing
from kernelpolicy.testing import kernelize_locally, rms_norm_kernel_source, tiny_llama, write_kernel_repo

transformers = pytest.importorskip("transformers")
if not all(kp._compat._compat.first_present(seam) for seam in kp._compat._compat.BATCHING):
    pytest.skip(
        f"transformers {transformers.__version__} has not the batching seams of 5.22-5.25 (the user is told so; "
        "tests/test_moved_internals.py)",
        allow_module_level=True,
    )
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager  # noqa: E402

NEW = 6
PREFER, NORM_OFF, OFF = kp.Policy.parse("prefer"), kp.Policy.parse("RMSNorm=disable"), kp.Policy.parse("disable")


def batching_config(**fields: Any) -> Any:
    """A small KV cache (without ``num_blocks`` transformers takes most of the free memory)."""
    return ContinuousBatchingConfig(**({"num_blocks": 64, "max_batch_tokens": 256, "block_size": 4} | fields))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    repo = write_kernel_repo(
        tmp_path_factory.mktemp("batching"), rms_norm_kernel_source(offset=0.5, can_torch_compile=True)
    )
    return kernelize_locally(tiny_llama(), {"RMSNorm": repo})


@pytest.fixture(scope="module")
def config() -> Any:
    return transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator)
    return [torch.randint(1, 256, (int(n),), generator=generator).tolist() for n in lengths]


def solo(model: Any, config: Any, policy: kp.Policy, ids: list[int]) -> list[int]:
    with kp.kernel_policy(policy):
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return list(out[0, len(ids) :].tolist())


@pytest.fixture
def manager(model: Any, config: Any) -> Iterator[Any]:
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    manager.start()
    yield manager
    manager.stop(block=True, timeout=30)


def run(
    manager: Any, submissions: list[tuple[kp.Policy, list[int]]], new_tokens: int = NEW, wait: float = 30
) -> list[Any]:
    """Submit each prompt under its policy (all before the first result), then each request's final output."""
    ids = []
    for policy, prompt in submissions:
        with kp.kernel_policy(policy):
            ids.append(manager.add_request(prompt, max_new_tokens=new_tokens))
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=wait)
        assert result is not None, f"no result after {wait} s; have {sorted(results)}"
        if result.is_finished():
            results[result.request_id] = result
    return [results[i] for i in ids]


def test_mixed_policies_in_one_manager_each_get_their_solo_tokens(model: Any, config: Any, manager: Any) -> None:
    """12 requests in flight at once, in 3 policies: every request's tokens are those of its policy alone."""
    submissions = [((PREFER, NORM_OFF, OFF)[i % 3], prompt) for i, prompt in enumerate(prompts(12))]
    expected = [solo(model, config, policy, prompt) for policy, prompt in submissions]
    assert expected[0] != solo(model, config, OFF, submissions[0][1])  # the kernel changes the tokens
    outputs = run(manager, submissions)
    assert [output.generated_tokens for output in outputs] == expected
    assert all(output.error is None for output in outputs)


def test_without_the_seam_the_policy_is_lost(model: Any, config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a manager transformers made alone runs every step in its own thread's default."""
    init = ContinuousBatchingManager.__init__
    monkeypatch.setattr(ContinuousBatchingManager, "__init__", init.__wrapped__)  # type: ignore[attr-defined]
    prompt = prompts(1)[0]
    with kp.kernels_disabled():
        [output] = model.generate_batch(
            [prompt], generation_config=config, continuous_batching_config=batching_config()
        ).values()
    assert output.generated_tokens == solo(model, config, PREFER, prompt) != solo(model, config, OFF, prompt)


def test_generate_batch_follows_the_scope_it_is_called_in(model: Any, config: Any) -> None:
    chosen = prompts(3, seed=1)
    for policy in (OFF, PREFER):
        with kp.kernel_policy(policy):
            outputs = model.generate_batch(
                chosen, generation_config=config, continuous_batching_config=batching_config()
            )
        assert [o.generated_tokens for o in outputs.values()] == [solo(model, config, policy, p) for p in chosen]


def test_recorders_count_the_calls_of_their_own_requests(manager: Any) -> None:
    """Each block's recorder counts the steps that served its requests, on their path."""
    prompt = prompts(1, seed=2)[0]
    with kp.record_calls() as kernel_side, kp.kernel_policy(PREFER):
        first = manager.add_request(prompt, max_new_tokens=NEW)
    with kp.record_calls() as original_side, kp.kernel_policy(NORM_OFF):
        second = manager.add_request(prompt, max_new_tokens=NEW)
    done: set[str] = set()
    while len(done) < 2:
        result = manager.get_result(timeout=30)
        assert result is not None
        if result.is_finished():
            done.add(result.request_id)
    assert done == {first, second}
    assert set(kernel_side.by_layer()["RMSNorm"]) == {"kernel"} and kernel_side.total() > 0
    assert set(original_side.by_layer()["RMSNorm"]) == {"original"} and original_side.total() > 0


def test_a_required_kernel_that_is_missing_fails_only_its_requests(model: Any, config: Any, manager: Any) -> None:
    """``SiLU=require`` (no SiLU kernel is bound): those requests fail with the error, the others are served."""
    required = kp.Policy.parse("SiLU=require")
    submissions = [((PREFER, required, OFF)[i % 3], prompt) for i, prompt in enumerate(prompts(6, seed=3))]
    outputs = run(manager, submissions)
    for (policy, prompt), output in zip(submissions, outputs, strict=True):
        if policy == required:
            assert output.error is not None and "kernel required but unavailable" in output.error
        else:
            assert output.error is None and output.generated_tokens == solo(model, config, policy, prompt)
    assert manager.is_running()
    [after] = run(manager, [(PREFER, submissions[0][1])])  # the manager goes on serving
    assert after.generated_tokens == outputs[0].generated_tokens


def test_prefix_sharing_never_reuses_another_policys_blocks(
    model: Any, config: Any, manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One long prompt under two policies, one after the other: the second may reuse only its own blocks."""
    prompt = prompts(1, seed=4)[0] * 4  # several full 4-token blocks
    [first] = run(manager, [(PREFER, prompt)])
    [second] = run(manager, [(OFF, prompt)])
    [again] = run(manager, [(PREFER, prompt)])  # reuses the first's blocks: same tokens
    assert first.generated_tokens == again.generated_tokens == solo(model, config, PREFER, prompt)
    assert second.generated_tokens == solo(model, config, OFF, prompt)


def test_prefix_sharing_control_unsalted_blocks_leak_across_policies(
    model: Any, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: without the salt, the second policy's request reuses the first's KV blocks."""
    monkeypatch.setattr(batching._requests, "_SALT", False)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    manager.start()
    try:
        prompt = prompts(1, seed=4)[0] * 4
        run(manager, [(PREFER, prompt)])
        [second] = run(manager, [(OFF, prompt)])
    finally:
        manager.stop(block=True, timeout=30)
    assert second.generated_tokens != solo(model, config, OFF, prompt)


def run_queued(model: Any, config: Any, submissions: list[tuple[kp.Policy, list[int]]]) -> tuple[list[Any], Any]:
    """A new manager with every prompt queued under its policy before it starts: the outputs, and what the manager
    kept of its requests (a busy machine cannot run one policy's first steps before the others' requests arrive)."""
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    for policy, prompt in submissions:
        with kp.kernel_policy(policy):
            manager.add_request(prompt, max_new_tokens=NEW)
    manager.start()
    try:
        outputs = []
        while len(outputs) < len(submissions):
            result = manager.get_result(timeout=30)
            assert result is not None
            if result.is_finished():
                outputs.append(result)
    finally:
        manager.stop(block=True, timeout=30)
    return outputs, getattr(manager, batching._MARK)


def test_one_step_serves_every_policy(model: Any, config: Any) -> None:
    """Eight requests in two policies queued before the manager starts: every step serves both."""
    submissions = [((PREFER, OFF)[i % 2], prompt) for i, prompt in enumerate(prompts(8, seed=5))]
    outputs, requests = run_queued(model, config, submissions)
    assert all(output.error is None for output in outputs)
    steps = list(requests.history)
    assert steps and all(set(step) == {PREFER, OFF} for step in steps), steps
    assert requests.by_id == {}  # finished requests are forgotten


def test_an_undeclared_layer_groups_the_steps_fairly(model: Any, config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm declared by nothing: steps where its paths differ serve one policy each, the two taking turns."""
    monkeypatch.delitem(_mixing.ROWS, "RMSNorm")
    submissions = [((PREFER, OFF)[i % 2], prompt) for i, prompt in enumerate(prompts(8, seed=5))]
    outputs, requests = run_queued(model, config, submissions)
    assert all(output.error is None for output in outputs)
    steps = list(requests.history)
    assert set(steps) == {(PREFER,), (OFF,)}
    first_done = min(max(i for i, step in enumerate(steps) if step == (chosen,)) for chosen in (PREFER, OFF))
    longest = max(len(list(run)) for _, run in itertools.groupby(steps[: first_done + 1]))
    assert longest <= 2, steps
    assert requests.by_id == {}


@pytest.mark.slow
def test_compiled_steps_with_mixed_policies_get_their_solo_tokens(model: Any, config: Any) -> None:
    """The manager's compile options (torch.compile of its step, backend eager here): the warm-up compiles each
    policy's program and the mix's; the rows' policies are an input of the mix's program, so steps whose mix
    changes compile nothing more: the same prompts under another mix add no graph."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    compiled = CompileConfig(backend="eager", fullgraph=False)  # transformers' step breaks the graph itself
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=batching_config(varlen_compile_config=compiled, decode_compile_config=compiled),
    )
    batching.policy_aware(manager, policies=[NORM_OFF])
    graphs = counters["stats"]["unique_graphs"]
    manager.warmup()
    assert counters["stats"]["unique_graphs"] > graphs  # compiled ahead, for prefer, RMSNorm=disable and the mix
    manager.start()
    chosen = prompts(4, seed=6)
    try:
        first = [((PREFER, NORM_OFF)[i % 2], prompt) for i, prompt in enumerate(chosen)]
        outputs = run(manager, first, wait=300)  # a step may compile a shape the warm-up did not
        after_first = counters["stats"]["unique_graphs"]
        second = [((NORM_OFF, PREFER)[i % 2], prompt) for i, prompt in enumerate(chosen)]  # the mix swapped
        again = run(manager, second, wait=300)
        after_second = counters["stats"]["unique_graphs"]
    finally:
        manager.stop(block=True, timeout=60)
    assert [o.generated_tokens for o in outputs] == [solo(model, config, p, prompt) for p, prompt in first]
    assert [o.generated_tokens for o in again] == [solo(model, config, p, prompt) for p, prompt in second]
    assert after_second == after_first


@pytest.mark.parametrize(
    ("by", "join"),
    [("token", "select"), ("token", "split"), ("request", "select")],
)
def test_mixed_steps_for_each_kind_of_layer(
    model: Any, config: Any, manager: Any, monkeypatch: pytest.MonkeyPatch, by: str, join: str
) -> None:
    """RMSNorm declared each way, every request gets its solo tokens. By token, steps mix the three policies; by
    request, a kernel never sees another policy's rows (their inputs could make it fail or fall back for its own):
    the policies whose RMSNorm paths differ take turns (prefer's kernel apart from the two originals)."""
    monkeypatch.setitem(_mixing.ROWS, "RMSNorm", _mixing.Rows(by, -2, join))  # type: ignore[arg-type]
    requests = getattr(manager, batching._MARK)
    before = len(requests.history)
    submissions = [((PREFER, NORM_OFF, OFF)[i % 3], prompt) for i, prompt in enumerate(prompts(9, seed=7))]
    outputs = run(manager, submissions)
    assert [o.generated_tokens for o in outputs] == [solo(model, config, p, prompt) for p, prompt in submissions]
    steps = list(requests.history)[before:]
    if by == "token":
        assert any(len(step) == 3 for step in steps)
    else:
        assert all(PREFER not in step or step == (PREFER,) for step in steps), steps
        assert any(set(step) == {NORM_OFF, OFF} for step in steps)  # both take the original: they share steps


def test_declare_rows_checks_its_input() -> None:
    with pytest.raises(kp.PolicyError, match=r"by='row' is not one of 'token', 'request'"):
        batching.declare_rows("Norm", by="row")  # type: ignore[arg-type]
    with pytest.raises(kp.PolicyError, match="join='pick' is not one of 'select', 'split'"):
        batching.declare_rows("Norm", by="token", join="pick")  # type: ignore[arg-type]
    with pytest.raises(kp.PolicyError, match="dim=1 must be a negative int"):
        batching.declare_rows("Norm", by="token", dim=1)
    with pytest.raises(kp.PolicyError, match="joins by 'select'"):
        batching.declare_rows("Norm", by="request", join="split")


PRESSURE = [kp.Policy.parse(text) for text in ("prefer", "RMSNorm=disable", "disable", "RMSNorm=disable,SiLU=disable")]


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_full_kv_cache_serves_every_policy(model: Any, config: Any, count: int) -> None:
    """Three 12-token prompts decoding and a 40-token one that does not fit the free blocks (16 blocks of 4):
    transformers offloads to make room, as with one policy; every request completes with its solo tokens."""
    generator = torch.Generator().manual_seed(8)
    chosen = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (12, 12, 12, 40)]
    policies = PRESSURE[:count] if count > 1 else [NORM_OFF]  # one policy: not the process default
    submissions = [(policies[i % count], prompt) for i, prompt in enumerate(chosen)]
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=256),
    )
    manager.start()
    try:
        outputs = run(manager, submissions)
    finally:
        manager.stop(block=True, timeout=30)
    assert [o.error for o in outputs] == [None] * len(chosen)
    assert [o.generated_tokens for o in outputs] == [solo(model, config, p, prompt) for p, prompt in submissions]


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading to CPU memory pins it: a GPU only")


@pytest.mark.parametrize("offload", [pytest.param(1.0, marks=ON_GPU), 0.0], ids=["offloading on", "offloading off"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_few_blocks_as_transformers_tests_them(model: Any, count: int, offload: float) -> None:
    """The settings of transformers' ``test_continuous_batching_few_blocks`` and ``test_cpu_offloading_disabled_when_zero``
    (4 blocks of 32, block sharing, 30 new tokens, each prompt 4 times), the policies interleaved (one policy: not
    the default): every request completes with its solo tokens. Offloading off: requests are soft reset and
    queued again (on a CPU too); on: copied to pinned CPU memory (a GPU run)."""
    config = transformers.GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=-1, pad_token_id=0)
    chosen = prompts(3, seed=11) * 4
    policies = PRESSURE[:count] if count > 1 else [OFF]
    submissions = [(policies[i % count], prompt) for i, prompt in enumerate(chosen)]
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=4, page_size=32, allow_block_sharing=True, cpu_offload_space=offload
        ),
    )
    manager.start()
    try:
        outputs = run(manager, submissions, new_tokens=30)
    finally:
        manager.stop(block=True, timeout=30)
    assert [o.error for o in outputs] == [None] * len(chosen)
    assert [o.generated_tokens for o in outputs] == [solo(model, config, p, prompt) for p, prompt in submissions]


def test_an_offloaded_request_keeps_its_policy(model: Any, config: Any) -> None:
    """12 requests in 8 blocks of 4 under ``kernels_disabled()``: transformers offloads some and queues them again;
    each still finishes under ``disable`` (was: the rest of an offloaded request ran under the default)."""
    chosen = prompts(12, seed=9)
    with kp.kernels_disabled():
        outputs = model.generate_batch(
            chosen,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=8, max_batch_tokens=64),
        )
    assert len(outputs) == 12
    assert [o.generated_tokens for o in outputs.values()] == [solo(model, config, OFF, p) for p in chosen]


FAILING_KERNEL = """
import torch
from torch import nn

CALLS = [0]
FAIL_AFTER = [None]


class RMSNorm(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states):
        CALLS[0] += 1
        if FAIL_AFTER[0] is not None and CALLS[0] > FAIL_AFTER[0]:
            raise RuntimeError("the kernel failed on this step")
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        out = self.weight * (hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon))
        return out.to(hidden_states.dtype) + 0.5
"""


def test_a_kernel_that_raises_mid_step_fails_only_the_requests_that_ran_it(config: Any, tmp_path: Any) -> None:
    """The kernel raises from its 10th call on, in the middle of mixed steps: the ``prefer`` requests fail with its
    error, the ``disable`` and ``RMSNorm=disable`` ones get their solo tokens, and the manager goes on serving."""
    import sys

    failing = kernelize_locally(tiny_llama(), {"RMSNorm": write_kernel_repo(tmp_path, FAILING_KERNEL)})
    binding = failing.model.norm.__dict__["_kernelpolicy"]
    layers = sys.modules[binding.kernel.__module__]
    submissions = [((PREFER, OFF, NORM_OFF)[i % 3], prompt) for i, prompt in enumerate(prompts(6, seed=10))]
    expected = [solo(failing, config, p, prompt) for p, prompt in submissions]
    manager = failing.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    manager.start()
    try:
        layers.FAIL_AFTER[0] = layers.CALLS[0] + 10
        outputs = run(manager, submissions)
        layers.FAIL_AFTER[0] = None
        [after] = run(manager, [(PREFER, submissions[0][1])])
    finally:
        layers.FAIL_AFTER[0] = None
        manager.stop(block=True, timeout=30)
    for (policy, _), output, tokens in zip(submissions, outputs, expected, strict=True):
        if policy == PREFER:
            assert output.error is not None and "the kernel failed on this step" in output.error
        else:
            assert output.error is None and output.generated_tokens == tokens
    assert after.error is None and after.generated_tokens == expected[0]


def test_the_batching_attributes_kernelpolicy_reads_are_on_a_real_manager(model: Any, config: Any) -> None:
    """``_attributes.BATCHING_ATTRIBUTES`` on this transformers' manager, processor, scheduler and cache."""
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    processor = manager._create_batch_processor()
    assert getattr(processor, batching._MARK) is getattr(manager, batching._MARK)  # wrapped: nothing missing
    objects = {
        "ContinuousBatchingManager": manager,
        "ContinuousBatchProcessor": processor,
        "Scheduler": processor.scheduler,
        "PagedAttentionCache": processor.cache,
    }
    missing = [
        f"{owner}.{name}"
        for owner, names in kp._compat._attributes.BATCHING_ATTRIBUTES.items()
        for name in names
        if owner in objects and not hasattr(objects[owner], name)
    ]
    assert missing == [], f"transformers {transformers.__version__}"
    # Async batching's IOs need a GPU to be made: their __init__ must set what kernelpolicy reads.
    from transformers.generation.continuous_batching import input_outputs

    made = inspect.getsource(input_outputs.ContinuousBatchingAsyncIOs.__init__)
    assert all(
        f"self.{name} =" in made for name in kp._compat._attributes.BATCHING_ATTRIBUTES["ContinuousBatchingAsyncIOs"]
    )


def test_async_io_pairs_without_their_current_pair_are_told(
    model: Any, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each IO pair's rows have a buffer of their own, chosen by ``current_pair`` (was: ``getattr(ios,
    "current_pair", 0)``, so a rename made both pairs share one buffer, the next step's rows over this one's)."""
    manager = _unwrapped_manager(model, config, monkeypatch)
    create = manager._create_batch_processor

    def asynchronous() -> Any:
        processor = create()
        processor.use_async_batching = True  # with this CPU's synchronous IOs: no current_pair
        return processor

    manager._create_batch_processor = asynchronous
    batching.policy_aware(manager)
    with pytest.warns(UserWarning, match=r"ContinuousBatchingAsyncIOs\.current_pair.*leaves the manager"):
        processor = manager._create_batch_processor()
    assert not hasattr(processor, batching._MARK)


def _unwrapped_manager(model: Any, config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    init = ContinuousBatchingManager.__init__
    monkeypatch.setattr(ContinuousBatchingManager, "__init__", init.__wrapped__)  # type: ignore[attr-defined]
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    monkeypatch.setattr(ContinuousBatchingManager, "__init__", init)
    monkeypatch.setattr(kp._compat._compat, "_told", set())  # each missing name is told once per process
    return manager


def test_a_manager_without_its_input_queue_is_left_as_it_is_and_the_user_is_told(
    model: Any, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _unwrapped_manager(model, config, monkeypatch)
    manager.request_queue = manager.__dict__.pop("input_queue")  # as a release that renamed it
    create = manager._create_batch_processor
    with pytest.warns(UserWarning, match=r"the attribute ContinuousBatchingManager\.input_queue.*leaves the manager"):
        assert batching.policy_aware(manager) is manager
    assert not hasattr(manager, batching._MARK) and manager._create_batch_processor == create
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batching.policy_aware(manager) is manager  # told once


def test_a_processor_without_use_async_batching_is_left_as_it_is_and_the_user_is_told(
    model: Any, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was read with ``getattr(..., False)``: a rename silently took the synchronous error handling."""
    manager = _unwrapped_manager(model, config, monkeypatch)
    create = manager._create_batch_processor

    def renamed() -> Any:
        processor = create()
        processor.async_batching = processor.__dict__.pop("use_async_batching")
        return processor

    manager._create_batch_processor = renamed
    batching.policy_aware(manager)
    with pytest.warns(UserWarning, match=r"ContinuousBatchProcessor\.use_async_batching.*leaves the manager"):
        processor = manager._create_batch_processor()
    assert not hasattr(processor, batching._MARK) and "_generation_step" not in vars(processor)


def test_a_manager_keeps_what_the_policies_in_flight_need(model: Any, config: Any, manager: Any) -> None:
    """Twelve waves of two requests, each wave with two policies never seen before (client-chosen policies): the
    slots and tables of policies whose requests are done are reused or released (was: one slot per policy ever
    served and one table per set of policies served together, for the life of the manager)."""
    requests = getattr(manager, batching._MARK)
    for wave in range(12):
        pair = [kp.Policy.parse(f"prefer,Wave{wave}=disable"), kp.Policy.parse(f"RMSNorm=disable,Wave{wave}=disable")]
        submissions = [(pair[i % 2], prompt) for i, prompt in enumerate(prompts(2, seed=wave))]
        outputs = run(manager, submissions, new_tokens=2)
        assert all(output.error is None for output in outputs)
    step = requests.step
    assert len(step.policies) <= 4, len(step.policies)  # two in flight at a time, each wave's slots reused
    assert len(step.tables) <= 2, len(step.tables)
    assert len(step.slot_of) <= 2


def test_forked_children_keep_their_parents_policy_for_their_whole_life(model: Any, config: Any) -> None:
    """``num_return_sequences=3`` under ``disable`` in 6 blocks of 4: the children that do not fit when their parent
    forks are queued anew and decode after it finished; each keeps ``disable`` and its recorders (was: looked up
    through the parent's entry, gone once the parent finished, so they ran the manager thread's ``prefer``)."""
    forking = transformers.GenerationConfig(
        max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0, num_return_sequences=3
    )  # top_k=1: greedy tokens (transformers refuses num_return_sequences without sampling)
    chosen = prompts(2)
    with kp.kernels_disabled(), kp.record_calls() as recorded:
        outputs = model.generate_batch(
            chosen,
            generation_config=forking,
            continuous_batching_config=batching_config(num_blocks=6, max_batch_tokens=64),
        )
    expected = {
        f"req_{i}{child}": solo(model, config, OFF, prompt)
        for i, prompt in enumerate(chosen)
        for child in ("", "__child#0", "__child#1")
    }
    assert {i: o.generated_tokens for i, o in outputs.items()} == expected
    assert set(recorded.by_layer()["RMSNorm"]) == {"original"}


def test_a_kernel_that_raises_in_a_step_of_one_policy_fails_that_steps_requests_only(
    config: Any, tmp_path: Any
) -> None:
    """Only ``prefer`` requests (no mixed call): the kernel raises from its 10th call on; those requests fail with
    its error, the manager goes on serving (was: a plain RuntimeError stopped the manager, every later request
    dropped)."""
    import sys

    failing = kernelize_locally(tiny_llama(), {"RMSNorm": write_kernel_repo(tmp_path, FAILING_KERNEL)})
    layers = sys.modules[failing.model.norm.__dict__["_kernelpolicy"].kernel.__module__]
    chosen = prompts(3, seed=12)
    expected = solo(failing, config, PREFER, chosen[0])
    manager = failing.init_continuous_batching(generation_config=config, continuous_batching_config=batching_config())
    manager.start()
    try:
        layers.FAIL_AFTER[0] = layers.CALLS[0] + 10
        outputs = run(manager, [(PREFER, prompt) for prompt in chosen])
        layers.FAIL_AFTER[0] = None
        assert manager.is_running()
        [after] = run(manager, [(PREFER, chosen[0])])
    finally:
        layers.FAIL_AFTER[0] = None
        manager.stop(block=True, timeout=30)
    assert all(o.error is not None and "the kernel failed on this step" in o.error for o in outputs)
    assert after.error is None and after.generated_tokens == expected


def test_a_step_run_again_without_a_failed_policy_records_each_call_once(config: Any, tmp_path: Any) -> None:
    """The ``disable`` requests' recorder counts the same calls whether or not the ``prefer`` rows' kernel raised
    mid-step (was: the step ran again without them and the layers before the error were recorded twice)."""
    import sys

    failing = kernelize_locally(tiny_llama(), {"RMSNorm": write_kernel_repo(tmp_path, FAILING_KERNEL)})
    layers = sys.modules[failing.model.norm.__dict__["_kernelpolicy"].kernel.__module__]
    chosen = prompts(4, seed=13)
    counts = []
    for fail in (False, True):
        manager = failing.init_continuous_batching(
            generation_config=config, continuous_batching_config=batching_config()
        )
        layers.FAIL_AFTER[0] = layers.CALLS[0] + 3 if fail else None  # in the first step, after 3 RMSNorm calls
        try:
            with kp.record_calls() as recorded, kp.kernel_policy(OFF):
                kept = [manager.add_request(prompt, max_new_tokens=NEW) for prompt in chosen[:2]]
            with kp.kernel_policy(PREFER):
                failed = [manager.add_request(prompt, max_new_tokens=NEW) for prompt in chosen[2:]]
            manager.start()
            errors: dict[str, Any] = {}
            while len(errors) < 4:
                result = manager.get_result(timeout=30)
                assert result is not None
                if result.is_finished():
                    errors[result.request_id] = result.error
        finally:
            layers.FAIL_AFTER[0] = None
            manager.stop(block=True, timeout=30)
        assert [errors[i] for i in kept] == [None, None]
        assert all((errors[i] is not None) == fail for i in failed)
        counts.append(recorded.by_layer())
    assert counts[1] == counts[0]

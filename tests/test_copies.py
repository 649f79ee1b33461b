"""Copies and pickles of policy-aware modules behave as torch's do and keep the policy (issue 33, finding 2).

Parametrized modules (``register_parametrization``, ``weight_norm``, ``spectral_norm``), made policy-aware before
or after they were parametrized, deep-copy with their parametrizations and are refused by pickle as torch
refuses them; a copy computes with its own weights, also through another library's forward wrapper; a deep
copy of a kernelized tiny Llama serves as a reference model (as TRL makes one).
"""

from __future__ import annotations

import copy
import functools
import pickle
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import kernelpolicy as kp
from kernelpolicy._attach._aware import binding_of
from kernelpolicy.testing import kernelize_locally, rms_norm_kernel_source, tiny_llama, write_kernel_repo

X = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))


class _Linear(nn.Linear):
    kernel_layer_name = "KpCopiedLinear"


class _PlusHundred(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias) + 100  # type: ignore[arg-type]


class _Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(-1, -2)


PARAMETRIZE: dict[str, Callable[[nn.Module], Any]] = {
    "register_parametrization": lambda m: parametrize.register_parametrization(m, "weight", _Symmetric()),
    "weight_norm": weight_norm,
    "spectral_norm": spectral_norm,
}


def _kernelized() -> _Linear:
    torch.manual_seed(0)
    layer = _Linear(3, 3)
    layer.forward = types.MethodType(_PlusHundred.forward, layer)  # type: ignore[method-assign]  # as kernels binds
    return layer


@pytest.mark.parametrize("order", ["parametrized, then attached", "attached, then parametrized"])
@pytest.mark.parametrize("how", list(PARAMETRIZE))
def test_parametrized_modules_deep_copy_and_refuse_pickle_as_torch_does(how: str, order: str) -> None:
    layer = _kernelized()
    if order.startswith("parametrized"):
        PARAMETRIZE[how](layer)
        kp.attach(layer)
    else:
        kp.attach(layer)
        PARAMETRIZE[how](layer)
    assert parametrize.is_parametrized(layer, "weight")
    twin = copy.deepcopy(layer)  # was: an object of the plain class without 'weight'
    assert parametrize.is_parametrized(twin, "weight") and type(twin) is type(layer)
    with torch.no_grad():
        if how != "spectral_norm":  # spectral_norm's power iteration moves on with each call in train mode
            torch.testing.assert_close(twin(X), layer(X))
        with kp.kernels_disabled():
            assert twin(X).mean().item() < 50  # the copy's dispatch follows the policy
        assert twin(X).mean().item() > 50
    plain = nn.Linear(3, 3)
    PARAMETRIZE[how](plain)
    with pytest.raises(RuntimeError, match="Serialization of parametrized modules") as torch_says:
        pickle.dumps(plain)
    with pytest.raises(RuntimeError) as ours:  # was: pickled, and loaded without 'weight'
        pickle.dumps(layer)
    assert str(ours.value) == str(torch_says.value)


def test_copies_compute_with_their_own_weights_through_a_wrapper() -> None:
    layer = kp.attach(_kernelized())
    layer.forward = functools.partial(lambda module, x: module.__dict__["_old"](x) * 2, layer)  # type: ignore[method-assign]
    layer.__dict__["_old"] = binding_of(layer).dispatcher  # type: ignore[union-attr]
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.add_(1.0)
        expected = (nn.functional.linear(X, twin.weight, twin.bias) + 100) * 2
        torch.testing.assert_close(twin(X), expected)  # the copy's wrapper, the copy's dispatch, its weights
        torch.testing.assert_close(layer(X), (nn.functional.linear(X, layer.weight, layer.bias) + 100) * 2)
        with kp.kernels_disabled():
            torch.testing.assert_close(twin(X), nn.functional.linear(X, twin.weight, twin.bias) * 2)


def test_copy_copy_keeps_the_kernel_and_shares_the_parameters() -> None:
    layer = kp.attach(_kernelized())
    twin = copy.copy(layer)
    assert binding_of(twin) is not None and binding_of(twin).kernel is not None  # type: ignore[union-attr]
    assert twin.weight is layer.weight
    with torch.no_grad():
        assert twin(X).mean().item() > 50
        with kp.kernels_disabled():
            assert twin(X).mean().item() < 50


def test_a_deep_copy_of_a_kernelized_llama_is_a_reference_model(tmp_path: Path) -> None:
    """As TRL makes its reference model: same outputs under each policy, weights of its own."""
    repo = write_kernel_repo(tmp_path, rms_norm_kernel_source(can_torch_compile=True, offset=0.5))
    model = kernelize_locally(tiny_llama().eval(), {"RMSNorm": repo}, mode="inference")
    reference = copy.deepcopy(model)
    ids = torch.arange(8).reshape(1, 8) % 256
    with torch.no_grad():
        for policy in ("prefer", "disable"):
            with kp.kernel_policy(policy):
                torch.testing.assert_close(reference(ids).logits, model(ids).logits, rtol=0, atol=0)
        with kp.kernels_disabled():
            disabled = reference(ids).logits
        assert not torch.equal(reference(ids).logits, disabled)  # the copy's kernel is bound and follows the policy
        next(model.parameters()).add_(1.0)
        assert not torch.equal(reference(ids).logits, model(ids).logits)


def test_an_aware_class_pickles_by_name_wherever_its_original_does(tmp_path: Path) -> None:
    """Issue 47, item 3 (was: ``Can't pickle <class 'kernelpolicy.testing.RMSNorm'>: it's not the same object as
    kernelpolicy.testing.RMSNorm``, from pickle, ``torch.save`` and torch's graph pickler, since an aware class has
    its original's module and name). Its metaclass has a ``copyreg`` reduction: the original by name, made aware
    again where it is loaded; the class itself is what ``type(module)`` shows, as before."""
    import io
    import subprocess
    import sys

    from kernelpolicy.testing import DemoModel, RMSNorm

    model = kp.attach(DemoModel(8))
    aware = type(model.norm)
    assert aware is not RMSNorm and aware.__mro__[1] is RMSNorm
    assert (aware.__module__, aware.__qualname__, aware.__name__) == ("kernelpolicy.testing", "RMSNorm", "RMSNorm")
    assert pickle.loads(pickle.dumps(aware)) is aware
    assert pickle.loads(pickle.dumps({"classes": (aware, RMSNorm)})) == {"classes": (aware, RMSNorm)}
    saved = io.BytesIO()
    torch.save({"class": aware, "module": model}, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert loaded["class"] is aware and type(loaded["module"].norm) is aware
    assert copy.copy(aware) is aware and copy.deepcopy([aware])[0] is aware
    # in a process that has not made it: the aware class of the original there
    (tmp_path / "class.pkl").write_bytes(pickle.dumps(aware))
    check = (
        "import pickle, sys; from kernelpolicy.testing import RMSNorm; "
        "cls = pickle.loads(open(sys.argv[1], 'rb').read()); "
        "assert cls is not RMSNorm and cls._kernelpolicy_original is RMSNorm and cls._kernelpolicy_aware; "
        "norm = cls.__new__(cls); assert type(norm) is cls"
    )
    done = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path / "class.pkl")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_per_policy_programs_with_aot_eager_save_an_attached_model(tmp_path: Path) -> None:
    """docs/compile.md's example on an attached model: AOTAutograd's cache pickles the graph (torch's graph
    pickler), whose nodes name the classes of the modules they came from."""
    from kernelpolicy.artifacts import compile_per_policy, load_per_policy
    from kernelpolicy.testing import DemoModel

    model, x = kp.attach(DemoModel(16).eval()), torch.randn(2, 16)
    if not hasattr(torch.compile(len, fullgraph=True), "aot_compile"):
        pytest.skip(f"torch {torch.__version__} has no aot_compile")
    compile_per_policy(model, (x,), policies=["prefer", "disable"], directory=tmp_path, backend="aot_eager")
    programs = load_per_policy(tmp_path, model=model)
    with kp.kernels_disabled():
        torch.testing.assert_close(programs(x), model(x))

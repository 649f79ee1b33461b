"""Mistakes a user can make writing a policy: each is an error or a hint at the line that made it.

Each test shows the message a user gets (the before/after texts are in the closing note of issue 24).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelpolicy as kp


@kp.use_kernel_forward_from_hub("MistakeNorm")
class MistakeNorm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


MistakeNorm()  # known from here on: the did-you-mean hints compare against kernelpolicy.introspect.known_layers()


def test_mode_by_keyword_is_the_mode_of_every_layer() -> None:
    with kp.kernel_policy(mode="disable"):
        assert kp.current_policy() == kp.Policy("disable")
    with kp.kernel_policy(mode="require", MistakeNorm="disable"):
        assert str(kp.current_policy()) == "require,MistakeNorm=disable"
    assert kp.set_default_policy(mode="disable") == kp.Policy("prefer")
    assert kp.current_policy() == kp.Policy("disable")
    kp.set_default_policy()
    with pytest.raises(kp.PolicyError, match=r"got its mode twice: 'prefer' \(positional\) and mode='disable'"):
        kp.kernel_policy("prefer", mode="disable")


def test_a_layer_name_as_the_positional_mode_says_how_to_name_a_layer() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.kernel_policy("MistakeNorm")
    assert str(info.value) == (
        "unknown kernel policy mode 'MistakeNorm' for every layer; valid modes are 'prefer', 'disable', 'require', "
        "'verify'. A positional argument is the mode of every layer; to set one layer, name it: "
        "kernel_policy(MistakeNorm='disable')"
    )
    with pytest.raises(kp.PolicyError, match=r"valid modes are .*'verify'$"):
        kp.kernel_policy("fast!")  # not a name: the plain message


@pytest.mark.parametrize(("written", "known"), [("mistakenorm", "MistakeNorm"), ("MistakeNrom", "MistakeNorm")])
def test_a_layer_name_close_to_a_known_one_warns_at_the_users_line(written: str, known: str) -> None:
    for make in (
        lambda: kp.kernel_policy(**{written: "disable"}),
        lambda: kp.kernels_disabled(written),
        lambda: kp.set_default_policy(**{written: "disable"}),
    ):
        with pytest.warns(UserWarning, match=rf"no kernel layer is named '{written}'.*did you mean '{known}'\?") as got:
            make()
        assert got[0].filename == __file__  # the line that wrote it, not kernelpolicy's
    kp.set_default_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kp.kernel_policy(MistakeNorm="disable", SomethingElse="disable")  # known, or far from any known: silent


def test_kernels_disabled_decorates_without_parentheses() -> None:
    @kp.kernels_disabled
    def reference() -> str:
        return str(kp.current_policy())

    assert reference() == "disable" and reference.__name__ == "reference"
    assert str(kp.current_policy()) == "prefer"


def test_kernel_policy_without_parentheses_says_to_add_them() -> None:
    def forward() -> None: ...

    with pytest.raises(kp.PolicyError, match=r"as a decorator it needs its arguments, @kernel_policy\('disable'\)"):
        kp.kernel_policy(forward)  # type: ignore[arg-type]


def test_a_layer_named_twice_has_no_irrelevant_tail() -> None:
    with pytest.raises(kp.PolicyError) as info:
        kp.Policy.parse("MistakeNorm=disable,MistakeNorm=prefer")
    assert str(info.value) == "policy 'MistakeNorm=disable,MistakeNorm=prefer': layer 'MistakeNorm' named twice"


def test_an_unnamed_module_is_called_so_with_the_fix() -> None:
    layer = MistakeNorm()  # aware from construction, never attached through a model
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError) as info:
        layer(torch.ones(1))
    assert str(info.value).startswith(
        "kernel required but unavailable for an unnamed module (kernelpolicy.attach(model) names it) "
    )
    model = kp.attach(torch.nn.Sequential(layer))
    with kp.kernel_policy("require"), pytest.raises(kp.KernelUnavailableError, match="for module '0' "):
        model(torch.ones(1))


def test_explain_shows_a_dash_where_a_column_does_not_apply() -> None:
    table = str(kp.explain(kp.attach(torch.nn.Sequential(MistakeNorm()))))
    header, _, row = table.splitlines()[1:4]
    cells = dict(zip(header.split(), row.split(), strict=False))
    assert cells["kernel"] == "-" and cells["compile"] == "-" and cells["backward"] == "-"


def test_the_command_line_help_is_plain_text() -> None:
    import contextlib
    import io

    from kernelpolicy.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in out.getvalue() and "kernelpolicy: decide at every forward call" in out.getvalue()

"""Pickles made before the house in wings (issue 42) load: the modules their names carry moved into folders.

Each blob was made by the build before the move (c899ba4, torch 2.13) with ``pickle.dumps(value, protocol=4)`` of
the value its key names (``tests`` of that build: the ones below). They name ``kernelpolicy._policy._restore``,
``kernelpolicy._errors._rebuild_*``, ``kernelpolicy._propagate._propagated`` and ``kernelpolicy._aware._restore``.
"""

from __future__ import annotations

import base64
import math
import pickle
import subprocess
import sys

import pytest
import torch

import kernelpolicy as kp
from kernelpolicy import errors, processes
from kernelpolicy.testing import DemoModel

EARLIER = {
    "unsupported_version": (
        "gASVbgAAAAAAAACMFGtlcm5lbHBvbGljeS5fY29tcGF0lIwXVW5zdXBwb3J0ZWRWZXJzaW9uRXJyb3KUk5SMM2tlcm5lbHBvbGljeSBzdXBw"
        "b3J0cyB0b3JjaD49Mi45LDwyLjE2OyBmb3VuZCAyLjguMJSFlFKULg=="
    ),
    "policy": (
        "gASVcgAAAAAAAACMFGtlcm5lbHBvbGljeS5fcG9saWN5lIwIX3Jlc3RvcmWUk5SMBnZlcmlmeZSMB1JNU05vcm2UjAdyZXF1aXJl"
        "lIaUhZQoTkc/UGJN0vGp/IwFcmFpc2WUTowMUnVudGltZUVycm9ylIWUTnSUh5RSlC4="
    ),
    "unavailable": (
        "gASVYQAAAAAAAACMFGtlcm5lbHBvbGljeS5fZXJyb3JzlIwUX3JlYnVpbGRfdW5hdmFpbGFibGWUk5QojAZtLm5vcm2UjAdSTVNO"
        "b3JtlIwJeC5STVNOb3JtlIwJbm8ga2VybmVslHSUUpQu"
    ),
    "original_unavailable": (
        "gASVWQAAAAAAAACMFGtlcm5lbHBvbGljeS5fZXJyb3JzlIwRX3JlYnVpbGRfb3JpZ2luYWyUk5QojAZtLm5vcm2UjAdSTVNOb3Jt"
        "lIwJeC5STVNOb3JtlIwEZ29uZZR0lFKULg=="
    ),
    "mismatch": (
        "gASVmQAAAAAAAACMFGtlcm5lbHBvbGljeS5fZXJyb3JzlIwRX3JlYnVpbGRfbWlzbWF0Y2iUk5QojAZtLm5vcm2UjAdSTVNOb3Jt"
        "lIwJeC5STVNOb3JtlIwGb3V0cHV0lIwBZJRHP+AAAAAAAABHP9AAAAAAAABLAEsBhpSMBmtlcm5lbJSMFHRoZSBvcmlnaW5hbCBm"
        "b3J3YXJklHSUhZRSlC4="
    ),
    "propagated": (
        "gASVggAAAAAAAACMF2tlcm5lbHBvbGljeS5fcHJvcGFnYXRllIwLX3Byb3BhZ2F0ZWSUk5SMBG1hdGiUjARzcXJ0lJOUjBRrZXJu"
        "ZWxwb2xpY3kuX3BvbGljeZSMCF9yZXN0b3JllJOUjAdkaXNhYmxllCkoTk6MBXJhaXNllE4pTnSUh5RSlIaUUpQu"
    ),
    "worker_init": (
        "gASVgAAAAAAAAACMFmtlcm5lbHBvbGljeS5wcm9jZXNzZXOUjAtfV29ya2VySW5pdJSTlIwUa2VybmVscG9saWN5Ll9wb2xpY3mU"
        "jAhfcmVzdG9yZZSTlIwGcHJlZmVylCkoTk6MBXJhaXNllE4pTnSUh5RSlIwEbWF0aJSMBHNxcnSUk5SGlFKULg=="
    ),
    "aware_model": (
        "gASVCQ4AAAAAAACMFGtlcm5lbHBvbGljeS50ZXN0aW5nlIwJRGVtb01vZGVslJOUKYGUfZQojAh0cmFpbmluZ5SIjAtfcGFyYW1l"
        "dGVyc5R9lIwIX2J1ZmZlcnOUfZSMG19ub25fcGVyc2lzdGVudF9idWZmZXJzX3NldJSPlIwTX2JhY2t3YXJkX3ByZV9ob29rc5SM"
        "C2NvbGxlY3Rpb25zlIwLT3JkZXJlZERpY3SUk5QpUpSMD19iYWNrd2FyZF9ob29rc5RoDylSlIwWX2lzX2Z1bGxfYmFja3dhcmRf"
        "aG9va5ROjA5fZm9yd2FyZF9ob29rc5RoDylSlIwaX2ZvcndhcmRfaG9va3Nfd2l0aF9rd2FyZ3OUaA8pUpSMHF9mb3J3YXJkX2hv"
        "b2tzX2Fsd2F5c19jYWxsZWSUaA8pUpSMEl9mb3J3YXJkX3ByZV9ob29rc5RoDylSlIweX2ZvcndhcmRfcHJlX2hvb2tzX3dpdGhf"
        "a3dhcmdzlGgPKVKUjBFfc3RhdGVfZGljdF9ob29rc5RoDylSlIwVX3N0YXRlX2RpY3RfcHJlX2hvb2tzlGgPKVKUjBpfbG9hZF9z"
        "dGF0ZV9kaWN0X3ByZV9ob29rc5RoDylSlIwbX2xvYWRfc3RhdGVfZGljdF9wb3N0X2hvb2tzlGgPKVKUjAhfbW9kdWxlc5R9lCiM"
        "BmJsb2Nrc5SMGnRvcmNoLm5uLm1vZHVsZXMuY29udGFpbmVylIwKTW9kdWxlTGlzdJSTlCmBlH2UKGgFiGgGfZRoCH2UaAqPlGgM"
        "aA8pUpRoEWgPKVKUaBNOaBRoDylSlGgWaA8pUpRoGGgPKVKUaBpoDylSlGgcaA8pUpRoHmgPKVKUaCBoDylSlGgiaA8pUpRoJGgP"
        "KVKUaCZ9lIwBMJRoKYwKU2VxdWVudGlhbJSTlCmBlH2UKGgFiGgGfZRoCH2UaAqPlGgMaA8pUpRoEWgPKVKUaBNOaBRoDylSlGgW"
        "aA8pUpRoGGgPKVKUaBpoDylSlGgcaA8pUpRoHmgPKVKUaCBoDylSlGgiaA8pUpRoJGgPKVKUaCZ9lCiMATCUjBd0b3JjaC5ubi5t"
        "b2R1bGVzLmxpbmVhcpSMBkxpbmVhcpSTlCmBlH2UKGgFiGgGfZQojAZ3ZWlnaHSUjAx0b3JjaC5fdXRpbHOUjBJfcmVidWlsZF9w"
        "YXJhbWV0ZXKUk5RoWYwSX3JlYnVpbGRfdGVuc29yX3YylJOUKIwNdG9yY2guc3RvcmFnZZSMEF9sb2FkX2Zyb21fYnl0ZXOUk5RC"
        "CwEAAIACigps/JxG+SBqqFAZLoACTekDLoACfXEAKFgQAAAAcHJvdG9jb2xfdmVyc2lvbnEBTekDWA0AAABsaXR0bGVfZW5kaWFu"
        "cQKIWAoAAAB0eXBlX3NpemVzcQN9cQQoWAUAAABzaG9ydHEFSwJYAwAAAGludHEGSwRYBAAAAGxvbmdxB0sEdXUugAIoWAcAAABz"
        "dG9yYWdlcQBjdG9yY2gKRmxvYXRTdG9yYWdlCnEBWA4AAAA5Mzk2NzAyNTcyMDc1MnECWAMAAABjcHVxA0sETnRxBFEugAJdcQBY"
        "DgAAADkzOTY3MDI1NzIwNzUycQFhLgQAAAAAAAAAInmtu5w2wj6x/BS/HTgFv5SFlFKUSwBLAksChpRLAksBhpSJaA8pUpR0lFKU"
        "iGgPKVKUh5RSlIwEYmlhc5RoW2hdKGhgQgMBAACAAooKbPycRvkgaqhQGS6AAk3pAy6AAn1xAChYEAAAAHByb3RvY29sX3ZlcnNp"
        "b25xAU3pA1gNAAAAbGl0dGxlX2VuZGlhbnECiFgKAAAAdHlwZV9zaXplc3EDfXEEKFgFAAAAc2hvcnRxBUsCWAMAAABpbnRxBksE"
        "WAQAAABsb25ncQdLBHV1LoACKFgHAAAAc3RvcmFnZXEAY3RvcmNoCkZsb2F0U3RvcmFnZQpxAVgOAAAAOTM5NjcwMjQ3ODY2ODhx"
        "AlgDAAAAY3B1cQNLAk50cQRRLoACXXEAWA4AAAA5Mzk2NzAyNDc4NjY4OHEBYS4CAAAAAAAAANZwi76rKkI+lIWUUpRLAEsChZRL"
        "AYWUiWgPKVKUdJRSlIhoDylSlIeUUpR1aAh9lGgKj5RoDGgPKVKUaBFoDylSlGgTTmgUaA8pUpRoFmgPKVKUaBhoDylSlGgaaA8p"
        "UpRoHGgPKVKUaB5oDylSlGggaA8pUpRoImgPKVKUaCRoDylSlGgmfZSMC2luX2ZlYXR1cmVzlEsCjAxvdXRfZmVhdHVyZXOUSwJ1"
        "YowBMZSME2tlcm5lbHBvbGljeS5fYXdhcmWUjAhfcmVzdG9yZZSTlChoAIwHUk1TTm9ybZSTlH2UKGgFiGgGfZRoWGhbaF0oaGBC"
        "AwEAAIACigps/JxG+SBqqFAZLoACTekDLoACfXEAKFgQAAAAcHJvdG9jb2xfdmVyc2lvbnEBTekDWA0AAABsaXR0bGVfZW5kaWFu"
        "cQKIWAoAAAB0eXBlX3NpemVzcQN9cQQoWAUAAABzaG9ydHEFSwJYAwAAAGludHEGSwRYBAAAAGxvbmdxB0sEdXUugAIoWAcAAABz"
        "dG9yYWdlcQBjdG9yY2gKRmxvYXRTdG9yYWdlCnEBWA4AAAA5Mzk2NzAyMjE3ODAxNnECWAMAAABjcHVxA0sCTnRxBFEugAJdcQBY"
        "DgAAADkzOTY3MDIyMTc4MDE2cQFhLgIAAAAAAAAAAACAPwAAgD+UhZRSlEsASwKFlEsBhZSJaA8pUpR0lFKUiGgPKVKUh5RSlHNo"
        "CH2UaAqPlGgMaA8pUpRoEWgPKVKUaBNOaBRoDylSlGgWaA8pUpRoGGgPKVKUaBpoDylSlGgcaA8pUpRoHmgPKVKUaCBoDylSlGgi"
        "aA8pUpRoJGgPKVKUaCZ9lIwQdmFyaWFuY2VfZXBzaWxvbpRHPrDG96C17Y11TowKYmxvY2tzLjAuMZROdJRSlIwBMpSMG3RvcmNo"
        "Lm5uLm1vZHVsZXMuYWN0aXZhdGlvbpSMBFNpTFWUk5QpgZR9lChoBYhoBn2UaAh9lGgKj5RoDGgPKVKUaBFoDylSlGgTTmgUaA8p"
        "UpRoFmgPKVKUaBhoDylSlGgaaA8pUpRoHGgPKVKUaB5oDylSlGggaA8pUpRoImgPKVKUaCRoDylSlGgmfZSMB2lucGxhY2WUiXVi"
        "jAEzlGhUKYGUfZQoaAWIaAZ9lChoWGhbaF0oaGBCCwEAAIACigps/JxG+SBqqFAZLoACTekDLoACfXEAKFgQAAAAcHJvdG9jb2xf"
        "dmVyc2lvbnEBTekDWA0AAABsaXR0bGVfZW5kaWFucQKIWAoAAAB0eXBlX3NpemVzcQN9cQQoWAUAAABzaG9ydHEFSwJYAwAAAGlu"
        "dHEGSwRYBAAAAGxvbmdxB0sEdXUugAIoWAcAAABzdG9yYWdlcQBjdG9yY2gKRmxvYXRTdG9yYWdlCnEBWA4AAAA5Mzk2NzAyMTE0"
        "NTk2OHECWAMAAABjcHVxA0sETnRxBFEugAJdcQBYDgAAADkzOTY3MDIxMTQ1OTY4cQFhLgQAAAAAAAAAV4plvECHDz/eg4C9l5k/"
        "PpSFlFKUSwBLAksChpRLAksBhpSJaA8pUpR0lFKUiGgPKVKUh5RSlGhsaFtoXShoYEIDAQAAgAKKCmz8nEb5IGqoUBkugAJN6QMu"
        "gAJ9cQAoWBAAAABwcm90b2NvbF92ZXJzaW9ucQFN6QNYDQAAAGxpdHRsZV9lbmRpYW5xAohYCgAAAHR5cGVfc2l6ZXNxA31xBChY"
        "BQAAAHNob3J0cQVLAlgDAAAAaW50cQZLBFgEAAAAbG9uZ3EHSwR1dS6AAihYBwAAAHN0b3JhZ2VxAGN0b3JjaApGbG9hdFN0b3Jh"
        "Z2UKcQFYDgAAADkzOTY3MDIxMTQ3MTM2cQJYAwAAAGNwdXEDSwJOdHEEUS6AAl1xAFgOAAAAOTM5NjcwMjExNDcxMzZxAWEuAgAA"
        "AAAAAABd01q+G1QOvpSFlFKUSwBLAoWUSwGFlIloDylSlHSUUpSIaA8pUpSHlFKUdWgIfZRoCo+UaAxoDylSlGgRaA8pUpRoE05o"
        "FGgPKVKUaBZoDylSlGgYaA8pUpRoGmgPKVKUaBxoDylSlGgeaA8pUpRoIGgPKVKUaCJoDylSlGgkaA8pUpRoJn2UaIZLAmiHSwJ1"
        "YnV1YnN1YowEbm9ybZRoiyhojX2UKGgFiGgGfZRoWGhbaF0oaGBCAwEAAIACigps/JxG+SBqqFAZLoACTekDLoACfXEAKFgQAAAA"
        "cHJvdG9jb2xfdmVyc2lvbnEBTekDWA0AAABsaXR0bGVfZW5kaWFucQKIWAoAAAB0eXBlX3NpemVzcQN9cQQoWAUAAABzaG9ydHEF"
        "SwJYAwAAAGludHEGSwRYBAAAAGxvbmdxB0sEdXUugAIoWAcAAABzdG9yYWdlcQBjdG9yY2gKRmxvYXRTdG9yYWdlCnEBWA4AAAA5"
        "Mzk2NzAyMjk0MTYwMHECWAMAAABjcHVxA0sCTnRxBFEugAJdcQBYDgAAADkzOTY3MDIyOTQxNjAwcQFhLgIAAAAAAAAAAACAPwAA"
        "gD+UhZRSlEsASwKFlEsBhZSJaA8pUpR0lFKUiGgPKVKUh5RSlHNoCH2UaAqPlGgMaA8pUpRoEWgPKVKUaBNOaBRoDylSlGgWaA8p"
        "UpRoGGgPKVKUaBpoDylSlGgcaA8pUpRoHmgPKVKUaCBoDylSlGgiaA8pUpRoJGgPKVKUaCZ9lGipRz6wxvegte2NdU5o6050lFKU"
        "dXViLg=="
    ),
}


def _loaded(key: str) -> object:
    return pickle.loads(base64.b64decode("".join(EARLIER[key])))


def test_a_policy_pickled_before_the_move_loads_equal() -> None:
    assert _loaded("policy") == kp.Policy("verify", RMSNorm="require", fallback_on=RuntimeError, rtol=0.001)


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("unavailable", kp.KernelUnavailableError),
        ("original_unavailable", errors.OriginalUnavailableError),
        ("mismatch", kp.KernelMismatchError),
    ],
)
def test_errors_pickled_before_the_move_load_with_their_fields(key: str, kind: type[Exception]) -> None:
    error = _loaded(key)
    assert type(error) is kind
    assert (error.module_name, error.layer_name, error.module_class) == ("m.norm", "RMSNorm", "x.RMSNorm")  # type: ignore[attr-defined]


def test_the_version_error_pickled_before_the_move_loads() -> None:
    from kernelpolicy._compat._versions import UnsupportedVersionError

    error = _loaded("unsupported_version")
    assert type(error) is UnsupportedVersionError
    assert str(error) == "kernelpolicy supports torch>=2.9,<2.16; found 2.8.0"


def test_a_propagated_function_pickled_before_the_move_runs_under_its_policy() -> None:
    propagated = _loaded("propagated")
    assert callable(propagated)
    assert propagated(16.0) == 4.0
    with kp.kernels_disabled():
        again = kp.propagate(math.sqrt)
    assert b"kernelpolicy._context._propagate" in pickle.dumps(again)  # a pickle made now names the new place


def test_a_worker_initializer_pickled_before_the_move_loads() -> None:
    loaded = _loaded("worker_init")
    assert type(loaded) is type(processes.worker_init_fn(math.sqrt))


def test_a_policy_aware_model_pickled_before_the_move_loads_aware_with_its_weights() -> None:
    torch.manual_seed(0)
    fresh = DemoModel(hidden=2, blocks=1)
    kp.attach(fresh)
    loaded = _loaded("aware_model")
    assert isinstance(loaded, DemoModel) and getattr(type(loaded.norm), "_kernelpolicy_aware", False)
    x = torch.ones(1, 2)
    torch.testing.assert_close(loaded(x), fresh(x))
    with kp.kernels_disabled():
        torch.testing.assert_close(loaded(x), fresh(x))


def test_the_old_names_load_in_a_fresh_interpreter_and_cost_no_torch_import() -> None:
    """The old names are found on first use (a policy's pickle is the first thing a worker loads), and importing
    kernelpolicy still imports no torch: the forwarding imports a moved module only when its old name is asked."""
    code = (
        "import base64, pickle, sys\n"
        f"data = base64.b64decode({''.join(EARLIER['policy'])!r})\n"
        "policy = pickle.loads(data)\n"
        "print(policy, 'torch' in sys.modules)\n"
        "import kernelpolicy._policy as old, kernelpolicy._values._policy as new\n"
        "print(old is new)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["verify,RMSNorm=require,rtol=0.001,fallback_on=RuntimeError", "False", "True"]

"""Loading follows the plan: a pair the plan refuses on this machine is refused before anything is
downloaded, with the plan's reason and what fits instead."""

import pytest

from conftest import DATA
from specchat.core import hardware, loading
from specchat.core.hardware import HardwareProfile
from specchat.core.planning import PlanRefused


def test_a_pair_that_does_not_fit_is_refused_before_any_download(monkeypatch):
    profile = HardwareProfile.load(DATA / "profiles" / "laptop-rtx4060-8gb.json")
    monkeypatch.setattr(hardware, "load_or_probe", lambda *args, **kwargs: profile)
    monkeypatch.setattr(loading, "download_pair", lambda *args, **kwargs: pytest.fail("downloaded a refused pair"))
    monkeypatch.setenv("SPECCHAT_PRECISION", "exact")  # the bf16 KV; the 8-bit one fits this laptop's RAM
    with pytest.raises(PlanRefused, match=r"does not fit.*nearest that fits"):
        loading.load_engine("llama3.1-8b")

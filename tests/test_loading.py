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


def test_a_quantized_plan_without_bitsandbytes_says_what_to_install(tiny_model_dir, monkeypatch):
    """A CPU machine whose plan keeps the weights in 8 bits has no bitsandbytes (the installers add
    it with an NVIDIA GPU): one line naming it, not transformers' error from deep in the load."""
    import importlib.util

    from specchat.core.errors import ModelUnavailable
    from specchat.core.model import TransformersLM
    from specchat.core.placement import LoadOptions

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "bitsandbytes"
                        else real(name, *args))
    with pytest.raises(ModelUnavailable, match=r"8-bit with bitsandbytes, which is not installed: `pip install"):
        TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float32", "cpu", "int8", None))


def test_a_quantized_plan_without_bitsandbytes_is_refused_before_any_download(monkeypatch):
    import importlib.util

    from specchat.core.errors import ModelUnavailable

    profile = HardwareProfile.load(DATA / "profiles" / "laptop-rtx4060-8gb.json")
    monkeypatch.setattr(hardware, "load_or_probe", lambda *args, **kwargs: profile)
    monkeypatch.setattr(loading, "download_pair", lambda *args, **kwargs: pytest.fail("downloaded what cannot load"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "bitsandbytes"
                        else real(name, *args))
    with pytest.raises(ModelUnavailable, match="bitsandbytes, which is not installed"):
        loading.load_engine("llama3.1-8b")  # 4-bit weights on this 8 GB laptop

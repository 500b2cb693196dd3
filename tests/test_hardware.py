"""The hardware profile: probing this machine, JSON round trips, the on-disk cache, t(n) curves."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import DATA, needs_cuda, tiny_llama
from specchat.core import step_calibration
from specchat.core.hardware import (
    HardwareProfile,
    ModelCurves,
    curve_key,
    load_or_probe,
    probe,
)
from specchat.core.speculative.forward_times import ForwardTimes
from specchat.core.speculative import optimizer


def _synthetic(name: str = "rtx4090-24gb") -> HardwareProfile:
    return HardwareProfile.load(DATA / "profiles" / f"{name}.json")


def test_probe_this_machine():
    profile = probe(measure_bandwidth=False)
    assert profile.ram_total_bytes >= profile.ram_available_bytes > 0
    assert profile.cpu.logical_cores >= 1 and profile.cpu.model
    assert profile.torch_version == torch.__version__
    if not torch.cuda.is_available():
        assert profile.gpus == () and profile.cuda_version is None
    assert HardwareProfile.from_json(profile.to_json()) == profile


@needs_cuda
def test_probe_measures_each_gpu():
    profile = probe(measure_bandwidth=True)
    assert len(profile.gpus) == torch.cuda.device_count() and profile.cuda_version
    for gpu in profile.gpus:
        assert gpu.vram_total_bytes >= gpu.vram_free_bytes > 0
        assert gpu.compute_capability >= (3, 0) and gpu.bf16 == (gpu.compute_capability >= (8, 0))
        assert gpu.host_to_device_bytes_per_s > 1e8 and gpu.device_to_host_bytes_per_s > 1e8
        assert gpu.memory_bytes_per_s > gpu.host_to_device_bytes_per_s  # on-device beats PCIe


def test_round_trip_with_curves():
    times = ForwardTimes(sizes=(1, 4, 8), ratios=(1.0, 1.2, 1.5), one_token_seconds=0.01, context=1024, device="x")
    profile = _synthetic().with_curves(ModelCurves("a@b:bfloat16", (times,)))
    assert HardwareProfile.from_json(profile.to_json()) == profile
    replaced = profile.with_curves(ModelCurves("a@b:bfloat16", (dataclasses.replace(times, context=2048),)))
    assert len(replaced.curves) == 1 and replaced.curves_for("a@b:bfloat16").times[0].context == 2048


@pytest.mark.parametrize("change", [
    lambda d: d.update(version=0),
    lambda d: d.pop("cpu"),
    lambda d: d.update(ram_total_bytes=-1),
    lambda d: d["gpus"][0].update(vram_free_bytes=d["gpus"][0]["vram_total_bytes"] + 1),
    lambda d: d["gpus"][0].update(host_to_device_bytes_per_s=0),
    lambda d: d["gpus"][0].update(colour="green"),
    lambda d: d.update(os="beos"),
    lambda d: d.update(ram_total_bytes="34359738368"),  # a quoted number in a hand-written profile
    lambda d: d.update(ram_total_bytes=1e309),
    lambda d: d["gpus"][0].update(vram_total_bytes=True),
    lambda d: d["gpus"][0].update(memory_bytes_per_s=float("inf")),
    lambda d: d["gpus"][0].update(host_to_device_bytes_per_s=1e-300),
])
def test_a_broken_profile_is_refused(change):
    data = json.loads(_synthetic().to_json())
    change(data)
    with pytest.raises(ValueError, match="not a hardware profile|must be"):
        HardwareProfile.from_json(json.dumps(data))


def test_machine_key_follows_what_measurements_depend_on():
    profile = _synthetic()
    assert profile.machine_key() == _synthetic().machine_key()
    other_card = dataclasses.replace(profile, gpus=(dataclasses.replace(profile.gpus[0], name="NVIDIA RTX A6000"),))
    more_ram = dataclasses.replace(profile, ram_total_bytes=2 * profile.ram_total_bytes)
    new_torch = dataclasses.replace(profile, torch_version="9.9")
    fresh_free = dataclasses.replace(profile, ram_available_bytes=1)  # changes by the minute: not in the key
    keys = {p.machine_key() for p in (profile, other_card, more_ram, new_torch)}
    assert len(keys) == 4 and fresh_free.machine_key() == profile.machine_key()


def test_load_or_probe_caches_per_machine(tmp_path):
    first = load_or_probe(root=tmp_path)
    saved = tmp_path / first.machine_key() / "profile.json"
    assert saved.is_file()
    stale = dataclasses.replace(HardwareProfile.load(saved), measured_on="2000-01-01")
    saved.write_text(stale.to_json())
    assert load_or_probe(root=tmp_path).measured_on == "2000-01-01"  # from the cache
    assert load_or_probe(root=tmp_path, refresh=True).measured_on != "2000-01-01"
    saved.write_text("{ half a file")
    assert load_or_probe(root=tmp_path).measured_on != "2000-01-01"  # damaged: measured again
    assert HardwareProfile.load(saved).machine_key() == first.machine_key()


def test_the_profile_records_the_os_and_windows_pins_at_most_half_the_ram(tmp_path):
    assert probe(measure_bandwidth=False).os in ("linux", "windows", "darwin")
    older = json.loads(_synthetic().to_json())
    older.pop("os")  # saved before the OS was recorded: it still loads, read as Linux's rules
    profile = HardwareProfile.from_json(json.dumps(older))
    assert profile.os is None and profile.pinnable_bytes == profile.ram_total_bytes
    windows = dataclasses.replace(profile, os="windows")
    assert windows.pinnable_bytes == profile.ram_total_bytes // 2
    assert HardwareProfile.from_json(windows.to_json()) == windows
    # This machine's cached profile gets this machine's OS, whatever the file says.
    first = load_or_probe(root=tmp_path)
    saved = tmp_path / first.machine_key() / "profile.json"
    saved.write_text(dataclasses.replace(HardwareProfile.load(saved), os=None).to_json())
    assert load_or_probe(root=tmp_path).os == first.os is not None


def test_measure_curves_caps_contexts_caches_and_joins_the_profile(tmp_path, monkeypatch, undisturbed):
    # A tiny model's sub-millisecond timings, once each, on a machine running other tests.
    model = tiny_llama(0)  # 512 positions
    key = curve_key("tiny/llama", "", "float64")
    curves = step_calibration.measure_curves(model, key, contexts=[64, 16, 1000], sizes=[4, 8], root=tmp_path, repeats=1)
    assert [times.context for times in curves.times] == [16, 64]  # 1000 + 8 tokens do not fit 512 positions
    assert all(times.sizes == (1, 4, 8) and times.ratios[0] == 1.0 for times in curves.times)
    assert curves.at(40).context == 64 and curves.at(20).context == 16

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(optimizer, "measure_forward_times", no_measuring)  # step_calibration imports it when measuring
    assert step_calibration.measure_curves(model, key, contexts=[16, 64, 1000], sizes=[4, 8], root=tmp_path) == curves
    assert load_or_probe(root=tmp_path).curves_for(key) == curves


"""`--vram-limit GB` / SPECCHAT_VRAM_LIMIT: what specchat may use of each GPU. The profile sees
capped cards, so the plan follows; the allocator is held to it on CUDA (hardware.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA
from test_plan import PROFILES, REGISTRY

from specchat.app.cli import main
from specchat.app.plan_cmd import profile_facts
from specchat.core import hardware
from specchat.core.hardware import VRAM_LIMIT_ENV, capped, vram_limit_bytes
from specchat.core.planning import Overrides, make_plan

GIB = 2**30
BIG = str(DATA / "profiles" / "rtx4090-24gb.json")


@pytest.fixture
def limit(monkeypatch):
    """Sets the limit as the CLI does, and restores the environment afterwards."""
    monkeypatch.setenv(VRAM_LIMIT_ENV, "")
    return lambda text: monkeypatch.setenv(VRAM_LIMIT_ENV, text)


def test_a_24_gb_card_capped_at_8_plans_as_an_8_gb_card():
    big = PROFILES["rtx4090-24gb"]
    eight = capped(big, 8 * GIB)
    assert [(gpu.vram_total_bytes, gpu.vram_free_bytes) for gpu in eight.gpus] == [(8 * GIB, 8 * GIB)]
    assert capped(big, None) == big and capped(big, 100 * GIB) == big
    pair = REGISTRY.get("llama3.1-8b")
    exact = Overrides(precision="exact")  # the precision-first policy, whose tiers tell the cards apart
    full, small = make_plan(big, pair, 131072, exact), make_plan(eight, pair, 131072, exact)
    assert (full.weights, full.head_weights) == ("bfloat16", "bfloat16")
    # 4-bit with the bf16 output head: a chain needs no retrieval cache beside it (TriForce's needs the head in 4 bits).
    assert (small.mode, small.weights, small.head_weights, small.embedding_device) == ("chain", "nf4", "bfloat16", "cpu")
    assert sum(item.bytes for item in small.memory if item.where == "cuda:0") <= 0.9 * 8 * GIB


def test_memory_others_hold_counts_only_where_it_cuts_into_the_limit():
    gpu = PROFILES["rtx4090-24gb"].gpus[0]  # about 1.2 GB held by the desktop
    busy = capped(PROFILES["rtx4090-24gb"], gpu.vram_free_bytes - GIB).gpus[0]
    assert busy.vram_total_bytes == busy.vram_free_bytes == gpu.vram_free_bytes - GIB
    nearly_all = capped(PROFILES["rtx4090-24gb"], gpu.vram_total_bytes - 1).gpus[0]
    assert nearly_all.vram_free_bytes == gpu.vram_free_bytes


@pytest.mark.parametrize("where", ["before", "after"])
def test_the_plan_command_honours_the_switch(capsys, limit, where):
    command = ["plan", "--pair", "llama3.1-8b", "--context", "128K", "--profile", BIG, "--json"]
    argv = ["--vram-limit", "8", *command] if where == "before" else [*command, "--vram-limit", "8"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["weights"], plan["head_weights"], plan["embedding_device"]) == ("nf4", "nf4", "cpu")
    assert plan["devices"][0]["capacity_bytes"] == 8 * GIB


def test_the_environment_variable_does_the_same(capsys, limit):
    limit("8")
    assert main(["plan", "--pair", "llama3.1-8b", "--context", "128K", "--profile", BIG, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "nf4"


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_bad_limit_is_bad_input(capsys, limit, value):
    assert main(["plan", "--pair", "embedded", "--context", "8K", f"--vram-limit={value}"]) == 2
    assert "--vram-limit" in capsys.readouterr().err


def test_a_bad_environment_value_is_bad_input(capsys, limit):
    limit("eight")
    assert main(["plan", "--pair", "embedded", "--context", "8K", "--profile", BIG]) == 2
    error = capsys.readouterr().err
    assert "SPECCHAT_VRAM_LIMIT" in error and "'eight'" in error


def test_the_profile_says_the_limit(limit):
    limit("11.5")
    assert vram_limit_bytes() == int(11.5 * GIB)
    facts = dict(profile_facts(capped(PROFILES["rtx4090-24gb"], vram_limit_bytes())))
    assert facts["limit"].startswith("at most 12.3 GB of each GPU") and "12.3 GB (12.3 GB free)" in facts["GPU 0"]
    assert "limit" not in dict(profile_facts(PROFILES["cpu-only-32gb"]))  # no GPU: nothing to limit


def test_the_allocator_is_held_to_the_limit_on_every_gpu(limit, monkeypatch):
    """The fraction torch's allocator gets per card (the call itself runs on the device machine)."""
    held = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("Card", (), {"total_memory": (24, 80)[index] * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: held.__setitem__(index, fraction))
    hardware.cap_cuda_allocator()
    assert held == {}  # no limit: nothing capped
    limit("30")
    hardware.cap_cuda_allocator()
    assert held == {0: 1.0, 1: pytest.approx(30 / 80)}

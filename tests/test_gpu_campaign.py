"""`specchat bench --suite gpu`: the campaign's dry run on the CPU writes every section, a broken
section is reported without losing the others, and the int4 kernel's packing is right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specchat.app.cli import main
from specchat.benchmarks.gpu import campaign
from specchat.benchmarks.gpu.int4 import Int4Linear, dequantize, max_relative_error, quantize
from specchat.benchmarks.gpu.rig import goal

REPO = Path(__file__).resolve().parent.parent


def test_int4_codes_dequantize_to_within_half_a_step_and_the_kernel_multiplies_by_them():
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    codes, scales_and_zeros = quantize(weight)
    assert codes.min() >= 0 and codes.max() <= 15
    step = scales_and_zeros[..., 0].transpose(0, 1).repeat_interleave(128, dim=1)  # [out, in]
    assert bool(((dequantize(codes, scales_and_zeros) - weight).abs() <= step / 2 + 1e-5).all())
    linear = Int4Linear(weight)
    assert max_relative_error(linear, weight) < 0.01
    # The check can fail: the same codes with the groups' scales shuffled give another product.
    linear.scales_and_zeros = linear.scales_and_zeros.flip(0)
    assert max_relative_error(linear, weight) > 0.1


def test_goals_compare_a_figure_with_its_bound():
    assert goal("x", 1.19, "<= 1.2", "here")["met"] and not goal("x", 1.21, "<= 1.2", "here")["met"]
    assert goal("x", 0.8, ">= 0.75", "here")["met"]
    assert goal("x", 1.05, "0.9..1.1", "here")["met"] and not goal("x", 1.2, "0.9..1.1", "here")["met"]
    assert goal("x", None, "<= 1.2", "here")["met"] is None


@pytest.mark.slow
def test_the_dry_run_writes_every_section(tmp_path):
    lines = []
    paths = campaign.run_campaign(list(campaign.SECTIONS), dry_run=True, budget_s=900, out_dir=tmp_path,
                                  repo_root=REPO, progress=lines.append)
    report = json.loads(paths[0].read_text())
    sections = report["sections"]
    assert list(sections) == list(campaign.SECTIONS) and len(lines) == len(campaign.SECTIONS)
    for name, section in sections.items():
        assert section["status"] == "dry-run", (name, section["status"], section.get("traceback"))
    assert sections["tests"]["collected"] >= 10
    assert sections["selftest"]["selftest"]["passed"] is True
    steps = sections["graphs"]["steps"]
    assert [row["context"] for row in steps] == [256, 1024, 2048]
    assert all(set(row["wall_s"]) == {"1", "2", "4", "8", "16"} for row in steps)
    kinds = {row["kind"]: row for row in sections["quantized"]["kinds"]}
    assert set(kinds) == {"bf16", "nf4", "nf4-fused", "int8", "int4"}
    assert kinds["int4"]["int4_kernel_relative_error"] < 0.01 and kinds["bf16"]["steps"]
    assert all(kinds[kind]["status"] == "ran" or kinds[kind]["status"].startswith("skipped: ") for kind in kinds)
    assert {(row["context"], row["tokens"]) for row in sections["kv8"]["rows"]} >= {(2048, 1), (2048, 16)}
    assert all(row["int8_kv_fused_s"] > 0 and row["fused_efficiency"] > 0 for row in sections["kv8"]["rows"])  # interpreted
    offload = sections["offload"]
    assert [row["capacity"] for row in offload["contexts"]] == [1024, 2048]
    assert all(row["verify_s"]["16"] > 0 and row["retrieval_rebuild_s"] > 0 for row in offload["contexts"])
    assert all(0 < row["int8"]["kv_bytes"] < row["kv_bytes"] / 2 and row["int8"]["verify_s"] > 0
               for row in offload["contexts"])  # fp32 rows here: 8-bit ones are about a quarter
    assert all(0 < row["partial"]["streamed_kv_bytes"] < row["partial"]["kv_bytes"] == row["kv_bytes"]
               and row["partial"]["verify_s"] > 0 for row in offload["contexts"])
    assert offload["prefill"]["tokens_per_s"] > 0
    variants = {row["label"]: row for row in sections["modes"]["variants"]}
    exact = ("fp32, KV on the device", "fp32, 8-bit KV", "fp32, KV offloaded", "fp32, 8-bit KV offloaded",
             "fp32, KV partly offloaded")
    assert set(variants) == {"as planned", *exact}
    assert variants["fp32, 8-bit KV"]["kv_dtype"] == variants["fp32, 8-bit KV offloaded"]["kv_dtype"] == "int8"
    assert variants["fp32, KV on the device"]["graphs"]["replays"] > 0  # identical to plain through them
    assert variants["fp32, 8-bit KV"]["graphs"] is None
    sampled = variants["as planned"]["sampled"]
    assert sampled["params"]["temperature"] > 0 and set(sampled["runs"]) == {"plain", "chain", "tree", "triforce", "auto"}
    assert all(row["new_tokens"] > 0 and row["identical_to_plain"] is None for row in sampled["runs"].values())
    assert all(row["graphs"]["graph_replays"] > 0 and row["graphs_over_eager"]["1"] > 0 for row in steps)
    for label in exact:
        runs = variants[label]["runs"]
        assert set(runs) == {"plain", "chain", "tree", "triforce", "auto"}
        assert all(row["identical_to_plain"] and row["new_tokens"] > 0 for row in runs.values()), label
    projected = sections["projection"]["rows"]
    assert [row["plan"]["mode"] for row in projected] == ["plain", "chain"]
    assert all(row["status"] == "ran" and 0 < row["plan"]["kv_resident_layers"] < 8 for row in projected)
    assert all(row["plain_measured_over_projected"] > 0 for row in projected)
    assert projected[1]["chain_tokens"] >= 64 and projected[1]["measured_over_projected"] > 0
    assert [g["name"] for g in sections["projection"]["goals"]] == ["measured_over_projected"] * 3
    routes = sections["projection"]["routes"]  # the CPU keeps the paths the plan prices
    assert routes["nf4_verification"].startswith("bitsandbytes: ") and routes["int8_kv"].startswith("dequantized: ")
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"] == torch.__version__


def test_the_plot_draws_a_dry_run(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the bench extra (pip install '.[bench]')")
    paths = campaign.run_campaign(["quantized"], dry_run=True, budget_s=120, out_dir=tmp_path, repo_root=REPO,
                                  progress=lambda line: None)
    assert [path.suffix for path in paths] == [".json", ".png"] and paths[1].stat().st_size > 10_000


def test_a_broken_section_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    def broken(rig, report):
        raise RuntimeError("the kernel is missing\nsecond line")

    monkeypatch.setitem(campaign.SECTIONS, "graphs", broken)
    paths = campaign.run_campaign(["graphs", "memory"], dry_run=True, budget_s=60, out_dir=tmp_path, repo_root=REPO,
                                  progress=lambda line: None)
    sections = json.loads(paths[0].read_text())["sections"]
    assert sections["graphs"]["status"] == "fail: RuntimeError: the kernel is missing"
    assert "Traceback" in sections["graphs"]["traceback"] and sections["memory"]["status"] == "dry-run"


def test_sections_past_the_budget_are_skipped_with_the_reason(tmp_path):
    paths = campaign.run_campaign(["graphs", "offload"], dry_run=True, budget_s=1e-9, out_dir=tmp_path,
                                  repo_root=REPO, progress=lambda line: None)
    sections = json.loads(paths[0].read_text())["sections"]
    assert all(section["status"].startswith("skipped: the ") and "budget ran out" in section["status"]
               for section in sections.values())


@pytest.mark.parametrize("argv, message", [
    (["--sections", "graphs,nope"], "--sections: unknown nope"),
    (["--budget-s", "0", "--dry-run"], "--budget-s must be positive"),
    ([], "needs a CUDA GPU"),
])
def test_bad_campaign_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path):
    if not argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real campaign would run")
    assert main(["bench", "--suite", "gpu", "--out", str(tmp_path), *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_the_rig_keeps_the_contexts_a_card_and_a_host_can_hold():
    from specchat.benchmarks.gpu.rig import GPU_CONTEXTS, OFFLOADED_CONTEXTS, fitting_contexts, hosted_contexts
    from specchat.benchmarks.gpu.shapes import LLAMA_31_8B, weight_bytes

    assert weight_bytes(LLAMA_31_8B) == 16_060_522_496  # the 8B shape's 8.03 B parameters in bf16
    h100, _ = fitting_contexts(LLAMA_31_8B, GPU_CONTEXTS, 84 * 10**9)
    rtx3090, left_out = fitting_contexts(LLAMA_31_8B, GPU_CONTEXTS, 25 * 10**9)
    assert h100 == GPU_CONTEXTS and rtx3090 == (1024, 32768)
    assert left_out == ("131,072 positions on the GPU: need about 39 GB, the card has 25 GB free",)
    assert fitting_contexts(LLAMA_31_8B, GPU_CONTEXTS, 12 * 10**9)[0] == ()
    offloaded, left_out = hosted_contexts(LLAMA_31_8B, OFFLOADED_CONTEXTS, 32 * 10**9)
    assert offloaded == (32768,) and "131,072 positions offloaded" in left_out[0]

"""The automatic precision (issue 37): every placement that fits, 4-bit weights and an 8-bit KV in
VRAM included, scored by the predicted time to an answer, on synthetic cards; the cost model's
efficiencies against the H100 campaign they come from; `specchat plan --precision` and its JSON.
Pure arithmetic: no model is loaded."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import DATA
from test_cli import assert_bad_input, specchat
from test_plan import PROFILES, REGISTRY, _parse
from specchat.app.plan_cmd import run_plan
from specchat.core.errors import InputError
from specchat.core.hardware import CpuInfo, GpuInfo, HardwareProfile
from specchat.core.planning import (
    ANSWER_TOKENS,
    PRECISION_ENV,
    Overrides,
    PlanRefused,
    candidates,
    kv8_bytes_per_token,
    make_plan,
    precision_setting,
    ranking_seconds,
    time_to_answer,
)
from specchat.core.planning import efficiency
from specchat.core.planning.candidates import PRECISION_MARGIN, coarseness
from specchat.core.planning.cost import prefill_seconds, step_seconds, verification_seconds
from specchat.core.planning.memory import Layout

LLAMA = REGISTRY.get("llama3.1-8b")
EXACT = Overrides(precision="exact")
CAMPAIGN = json.loads((DATA.parent.parent / "bench" / "2026-11-26-h100-campaign.json").read_text())["sections"]


def test_the_time_to_an_answer_reads_a_prompt_then_writes_a_typical_answer():
    plan = make_plan(PROFILES["rtx4090-24gb"], LLAMA, 32768)
    assert ANSWER_TOKENS == 512
    assert time_to_answer(plan) == pytest.approx(plan.predicted_prefill_seconds + 512 / plan.predicted_tokens_per_second)
    short = dataclasses.replace(plan, context=600)  # at most half the context is answer
    assert time_to_answer(short) == pytest.approx(plan.predicted_prefill_seconds + 300 / plan.predicted_tokens_per_second)
    assert time_to_answer(dataclasses.replace(plan, predicted_tokens_per_second=None)) is None


# ---- what the cards get ----------------------------------------------------------------


def test_a_24_gb_3090_at_128k_keeps_4_bit_weights_and_most_of_the_kv_in_vram():
    profile = PROFILES["rtx3090-24gb-32gb"]
    plan, exact = make_plan(profile, LLAMA, 131072), make_plan(profile, LLAMA, 131072, EXACT)
    # The mode with the placement: a chain over nf4 weights, 29 of the 32 layers' bf16 KV on the GPU
    # beside them and the other 3 streamed (a partial offload), ahead of TriForce.
    assert (plan.precision, plan.mode, plan.weights, plan.head_weights, plan.kv_dtype, plan.kv_device,
            plan.kv_resident_layers) == ("auto", "chain", "nf4", "bfloat16", "bfloat16", "cpu-pinned", 29)
    assert plan.reasons["mode"].startswith("chain: predicted 31.0 tok/s against 26.3 for TriForce with these weights")
    assert plan.reasons["kv"] == (
        "full KV (17.2 GB) split: 29 of 32 layers' (15.6 GB) on cuda:0 with their weights, what fits; the other 3 "
        "layers' (1.6 GB) offloaded to pinned CPU memory and streamed layer by layer, about 0.06 s per full "
        "verification at the measured 25.0 GB/s")
    # --precision exact keeps the model's own weights and KV: bf16, the KV streamed from pinned RAM
    # but for the 2 layers' that fit beside the weights, TriForce.
    assert (exact.precision, exact.mode, exact.weights, exact.kv_dtype, exact.kv_device, exact.kv_resident_layers) == (
        "exact", "triforce", "bfloat16", "bfloat16", "cpu-pinned", 2)
    assert exact.reasons["mode"].startswith("triforce: predicted 10.4 tok/s against 7.0 for a chain with these weights")
    assert plan.exact_tokens_per_second == exact.predicted_tokens_per_second
    assert plan.predicted_tokens_per_second > 1.5 * exact.predicted_tokens_per_second
    assert ranking_seconds(plan) * 1.15 <= ranking_seconds(exact)  # the precision margin
    assert plan.reasons["precision"] == (
        "auto: nf4 weights with 29 of 32 layers' KV on the GPU, the rest streamed from RAM, about 31 tok/s, against "
        "about 10 tok/s for bfloat16 weights with 2 of 32 layers' KV on the GPU, the rest streamed from RAM "
        "(--precision exact); the bfloat16 output head kept: nf4 weights (the output head too) with the KV on the GPU "
        "(chain, about 39 tok/s) would read the document and write 4 answers only 6% sooner, under the 1.15x a "
        "coarser precision must gain")
    assert plan.reasons["answers"] == ("4-bit weights: answers are exactly what this quantized model would "
                                       "write; --precision exact for the bfloat16 model, about 10 tok/s")
    assert exact.reasons["answers"] == "bfloat16 weights and KV: answers are exactly what the bfloat16 model would write"
    # TriForce asked for: 4-bit weights (the head too) with 28 layers' KV on the GPU, which streams
    # 2.1 GB per full verification where the exact placement streams 16.1 GB.
    triforce = make_plan(profile, LLAMA, 131072, Overrides(mode="triforce"))
    assert (triforce.mode, triforce.weights, triforce.head_weights, triforce.kv_dtype, triforce.kv_device,
            triforce.kv_resident_layers) == ("triforce", "nf4", "nf4", "bfloat16", "cpu-pinned", 28)
    assert "streams 2.1 GB of KV at 25.0 GB/s, 28 layers' kept on the GPU" in triforce.reasons["gammas"]
    assert "streams 16.1 GB of KV at 25.0 GB/s, 2 layers' kept on the GPU" in exact.reasons["gammas"]


def test_a_coarser_precision_must_answer_the_margin_sooner():
    """The 4090 at 32K: nf4 weights in a chain would answer little sooner than bf16 ones, so bf16 is
    kept; the 3090 at 128K keeps the bf16 output head for a 6% gain (the test above); the 8 GB 4060 Ti
    at 32K quantizes it too for more than 15%."""
    assert PRECISION_MARGIN == 1.15
    plan = make_plan(PROFILES["rtx4090-24gb"], LLAMA, 32768)
    assert (plan.mode, plan.weights, plan.kv_dtype, plan.kv_device) == ("chain", "bfloat16", "bfloat16", "cuda:0")
    nf4 = make_plan(PROFILES["rtx4090-24gb"], LLAMA, 32768, Overrides(quantization="nf4"))
    assert ranking_seconds(nf4) * PRECISION_MARGIN > ranking_seconds(plan)
    small = make_plan(PROFILES["rtx4060ti-8gb-32gb"], LLAMA, 32768)
    assert (small.weights, small.head_weights) == ("nf4", "nf4")
    finer = make_plan(PROFILES["rtx4060ti-8gb-32gb"], LLAMA, 32768, EXACT)
    assert (finer.weights, finer.head_weights) == ("nf4", "bfloat16")
    assert ranking_seconds(small) * PRECISION_MARGIN <= ranking_seconds(finer)
    assert small.reasons["precision"] == (
        "auto: nf4 weights (the output head too) with 14 of 32 layers' KV on the GPU, the rest streamed from RAM, "
        "about 10 tok/s, the fastest that fits, against about 8.3 tok/s for nf4 weights with 1 of 32 layers' KV on "
        "the GPU, the rest streamed from RAM (--precision exact)")


def test_an_8_gb_4060_ti_at_32k_fits_and_says_why_in_plain_words():
    profile = PROFILES["rtx4060ti-8gb-32gb"]
    plan = make_plan(profile, LLAMA, 32768)
    assert all(device.headroom_bytes >= 0 for device in plan.devices)
    assert (plan.weights, plan.kv_device, plan.kv_resident_layers) == ("nf4", "cpu-pinned", 14)
    assert plan.mode == "chain" and plan.reasons["mode"].startswith(
        "chain: predicted 10.4 tok/s against 9.6 for TriForce with these weights; ")
    assert plan.reasons["precision"].startswith("auto: nf4 weights (the output head too) with 14 of 32 layers' KV on "
                                                "the GPU, the rest streamed from RAM, about 10 tok/s")
    assert plan.reasons["answers"] == (
        "4-bit weights: answers are exactly what this quantized model would write; the bfloat16 model does not fit "
        "this machine at 32,768 tokens; --precision exact for nf4 weights with 1 of 32 layers' KV on the GPU, the "
        "rest streamed from RAM, about 8.3 tok/s")


def _llama_cpp_speed(profile, context):
    """What llama.cpp's 4-bit weights (4.9 GB) and an 8-bit KV reach, all in VRAM: 0.7 x the card's
    memory rate over the bytes a token reads (the issue's done-when)."""
    return 0.7 * profile.gpus[0].memory_bytes_per_s / (4.9e9 + context * kv8_bytes_per_token(LLAMA.target))


@pytest.mark.parametrize("profile_name, context", [
    pytest.param("rtx3090-24gb-32gb", 131072, marks=pytest.mark.xfail(strict=True, reason=(
        "measured kernels and the precision margin: the plan (a chain over nf4 weights, the bf16 head and 29 of 32 "
        "layers' bf16 KV in VRAM) predicts 31 tok/s against 41 (39 with the head in nf4 too and the whole KV in "
        "VRAM, 6% sooner, under the margin); bitsandbytes nf4 reads 0.36x (a step) or 0.18x (a verification) as "
        "fast as bf16 (campaign quantized)"))),
    pytest.param("rtx4060ti-8gb-32gb", 32768, marks=pytest.mark.xfail(strict=True, reason=(
        "memory: an 8-bit KV does not fit beside 4-bit weights under the plan's margins (10% of the card, 1 GiB of "
        "CUDA context), so 18 of 32 layers' KV streams over PCIe: 10.4 tok/s against 24"))),
])
def test_the_default_plan_decodes_as_fast_as_llama_cpp(profile_name, context):
    profile = PROFILES[profile_name]
    assert make_plan(profile, LLAMA, context).predicted_tokens_per_second > _llama_cpp_speed(profile, context)


def test_with_kernels_at_the_cards_rate_the_3090_plan_would_reach_llama_cpp(monkeypatch):
    """The 3090's gap is the kernels, not the choice: were 4-bit weights and the 8-bit KV read at the
    card's rate (a fused 4-bit GEMV, attention reading int8 in registers), the same plan reaches it."""
    for table, key in ((efficiency.WEIGHTS, "nf4"), (efficiency.KV, "int8")):
        monkeypatch.setitem(table, key, efficiency.Efficiency(1.0, 1.0))
    profile = PROFILES["rtx3090-24gb-32gb"]
    plan = make_plan(profile, LLAMA, 131072)
    assert (plan.weights, plan.kv_dtype) == ("nf4", "int8")
    assert plan.predicted_tokens_per_second > _llama_cpp_speed(profile, 131072)


def test_llm_int8_weights_only_when_asked_for():
    profile = PROFILES["rtx3060-12gb"]
    assert make_plan(profile, LLAMA, 32768, EXACT).weights == "int8"  # the exact walk's 8-bit tier
    auto = make_plan(profile, LLAMA, 32768)
    assert auto.weights == "nf4" and all(plan.weights != "int8" for plan in candidates(profile, LLAMA, 32768))
    asked = make_plan(profile, LLAMA, 32768, Overrides(quantization="int8"))
    assert asked.weights == "int8" and asked.reasons["weights"].startswith("int8: as requested")


def test_without_measured_bandwidths_auto_is_precision_first():
    profile = PROFILES["rtx3090-24gb-32gb"]
    unmeasured = dataclasses.replace(profile, gpus=tuple(dataclasses.replace(gpu, memory_bytes_per_s=None)
                                                         for gpu in profile.gpus))
    plan = make_plan(unmeasured, LLAMA, 131072)
    assert (plan.weights, plan.kv_device, plan.predicted_tokens_per_second) == ("bfloat16", "cpu-pinned", None)
    assert "bandwidths are not measured" in plan.reasons["precision"]
    cpu = make_plan(PROFILES["cpu-only-32gb"], REGISTRY.get("embedded"), 8192)
    assert cpu.predicted_tokens_per_second is cpu.predicted_prefill_seconds is cpu.plain_tokens_per_second is None
    assert cpu.reasons["precision"] == "auto, precision first: no GPU" and candidates(PROFILES["cpu-only-32gb"],
                                                                                      REGISTRY.get("embedded"), 8192) == ()


# ---- the grid: no plan slower than a candidate that fits ---------------------------------------

# (bandwidth on the box, compute capability, host-to-device) of a card of each size
CARDS = {8: (288e9, (8, 9), 12.6e9), 12: (360e9, (8, 6), 25e9), 16: (717e9, (8, 9), 25e9), 24: (936e9, (8, 6), 25e9)}


def _machine(vram_gb: int, ram_gb: int) -> HardwareProfile:
    """A synthetic machine: a measured-like 85% of the card's bandwidth, a desktop holding 3% of it."""
    rate, capability, link = CARDS[vram_gb]
    vram = vram_gb * 2**30
    gpu = GpuInfo(0, f"synthetic {vram_gb} GB", vram, int(0.97 * vram), capability, True, link, link, 0.85 * rate)
    return HardwareProfile(gpus=(gpu,), cpu=CpuInfo("synthetic", 16, 8), ram_total_bytes=ram_gb * 10**9,
                           ram_available_bytes=int(0.85 * ram_gb * 10**9), torch_version="2.6.0+cu124",
                           cuda_version="12.4", measured_on="2026-11-27")


def _finer_or_same(one, other) -> bool:
    """Whether `one`'s storage is at most as coarse as `other`'s in every part (weights, head, KV)."""
    return all(a <= b for a, b in zip(coarseness(one), coarseness(other)))


@pytest.mark.parametrize("ram_gb", [16, 32, 64])
@pytest.mark.parametrize("vram_gb", sorted(CARDS))
def test_no_plan_is_slower_than_a_candidate_that_fits(vram_gb, ram_gb):
    """No fitting candidate at the same or a finer precision is faster than the plan; no coarser one is
    faster by more than the precision margin; the plan answers the margin sooner than every finer one."""
    profile = _machine(vram_gb, ram_gb)
    slack = 1 + 1e-12
    for context in (8192, 16384, 32768, 65536, 131072):
        found = candidates(profile, LLAMA, context)
        try:
            plan = make_plan(profile, LLAMA, context)
        except PlanRefused:
            assert found == ()
            continue
        best = ranking_seconds(plan)
        assert best is not None
        for other in found:
            seconds = ranking_seconds(other)
            if _finer_or_same(other, plan):
                assert best <= seconds * slack, (context, _placement(other))
                if coarseness(other) != coarseness(plan):  # strictly finer: the plan gains the margin on it
                    assert best * PRECISION_MARGIN <= seconds * slack, (context, _placement(other))
            elif _finer_or_same(plan, other):  # strictly coarser
                assert seconds * PRECISION_MARGIN * slack >= best, (context, _placement(other))
        same = [other for other in found if _placement(other) == _placement(plan)]
        assert same and ranking_seconds(same[0]) == best  # the plan is one of the candidates
        # Each candidate is its placement's faster mode: TriForce and a chain both considered past 8K.
        assert all(other.mode in ("chain", "triforce") for other in found)
        try:
            exact = make_plan(profile, LLAMA, context, EXACT)
        except PlanRefused:  # a bf16 KV too large for the RAM, an 8-bit one in VRAM
            assert plan.kv_dtype == "int8"
            continue
        if exact.weights != "int8":  # LLM.int8 is no candidate: every other exact placement is one
            assert best <= ranking_seconds(exact) * (PRECISION_MARGIN if coarseness(exact) != coarseness(plan) else 1) \
                * slack


def _placement(plan):
    return (plan.weights, plan.head_weights, plan.kv_dtype, plan.kv_device, plan.draft_device, plan.prefill_chunk,
            plan.embedding_device, plan.mode)


# ---- the efficiencies reproduce the measurements they came from --------------------------------

H100 = HardwareProfile(
    gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", 85017493504, 84000000000, (9, 0), True, 54.7e9, 54.7e9, 2.819e12),),
    cpu=CpuInfo("synthetic", 32, 16), ram_total_bytes=400 * 10**9, ram_available_bytes=380 * 10**9,
    torch_version="2.11.0+cu130", cuda_version="13.0", measured_on="2026-11-26")


def _h100_layout(context, quantization="none", kv_int8=False):
    return Layout(H100, LLAMA, context, "plain", 4096, Overrides(), quantization, True, False, 2048,
                  kv_int8=kv_int8)


def _busy(kind, context, tokens):
    kinds = {entry["kind"]: entry for entry in CAMPAIGN["quantized"]["kinds"]}
    step = next(step for step in kinds[kind]["steps"] if step["context"] == context)
    return step["gpu_busy_s"][str(tokens)]


@pytest.mark.parametrize("quantization, kind", [("nf4", "nf4"), ("int8", "int8")])
@pytest.mark.parametrize("context", [1024, 32768])
def test_quantized_forwards_cost_what_the_campaign_measured_against_bf16(quantization, kind, context):
    bf16, quantized = _h100_layout(context), _h100_layout(context, quantization)
    step = step_seconds(quantized) / step_seconds(bf16)
    verification = verification_seconds(quantized) / verification_seconds(bf16)
    assert step == pytest.approx(_busy(kind, context, 1) / _busy("bf16", context, 1), rel=0.1)
    assert verification == pytest.approx(_busy(kind, context, 16) / _busy("bf16", context, 16), rel=0.15)


def test_the_8_bit_kv_costs_what_its_dequantizing_attention_measured():
    for row in CAMPAIGN["kv8"]["rows"]:
        if row["tokens"] == 1 and row["context"] >= 32768:
            modeled = row["kv_bytes_int8"] / efficiency.KV["int8"].step / row["kv_bytes_bf16"]
            assert modeled == pytest.approx(row["int8_over_bf16"], rel=0.1)
    bf16, int8 = _h100_layout(131072), _h100_layout(131072, kv_int8=True)
    assert int8.full_kv == 131072 * 32 * 8 * 2 * (128 + 4) and step_seconds(int8) > 4 * step_seconds(bf16)


@pytest.mark.parametrize("context", [32768, 131072])
def test_the_prefill_estimate_matches_the_h100s(context):
    measured = next(step["prefill_s"] for step in CAMPAIGN["graphs"]["steps"] if step["context"] == context)
    assert prefill_seconds(_h100_layout(context)) == pytest.approx(measured, rel=0.1)


def test_an_offloaded_kv_makes_every_prefill_chunk_restream_what_came_before():
    profile = PROFILES["rtx4090-24gb"]
    on_chip, offloaded = (Layout(profile, LLAMA, 32768, "plain", 4096, Overrides(), "nf4", kv, False, 2048)
                          for kv in (True, False))
    link = profile.gpus[0].host_to_device_bytes_per_s
    restreamed = sum(range(0, 32768 - 512, 2048)) * on_chip.kv_per_token / link
    assert prefill_seconds(offloaded) - prefill_seconds(on_chip) == pytest.approx(restreamed)


# ---- the setting and the command line ----------------------------------------------------------


def test_the_precision_setting(monkeypatch):
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    assert precision_setting() == "auto" and precision_setting("exact") == "exact"
    monkeypatch.setenv(PRECISION_ENV, "Exact")
    assert precision_setting() == "exact" and precision_setting("auto") == "auto"  # the option wins
    monkeypatch.setenv(PRECISION_ENV, "fast")
    with pytest.raises(InputError, match=PRECISION_ENV):
        precision_setting()
    with pytest.raises(InputError, match="--precision"):
        precision_setting("lossless")


def test_plan_text_shows_the_prediction_and_what_the_answers_are(capsys):
    profile = str(DATA / "profiles" / "rtx3090-24gb-32gb.json")
    assert run_plan(_parse(["plan", "--pair", "llama3.1-8b", "--context", "128K", "--profile", profile])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("llama3.1-8b at 131,072 tokens: chain (gamma 16), nf4 weights on cuda:0, draft none, "
                        "full KV on cuda:0 for 29 of 32 layers, the rest on cpu-pinned")
    assert lines[1].startswith("predicted: about 31 tok/s at this context; plain decoding of these weights about "
                               "16 tok/s; a 130,560-token prompt read in ")
    assert lines[2] == ("4-bit weights: answers are exactly what this quantized model would write; "
                        "--precision exact for the bfloat16 model, about 10 tok/s")


def test_plan_json_carries_the_predictions_and_the_precision(monkeypatch):
    profile = DATA / "profiles" / "rtx3090-24gb-32gb.json"
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    command = ["plan", "--pair", "llama3.1-8b", "--context", "128K", "--profile", profile, "--json"]
    completed = specchat(*command, timeout=120)
    assert completed.returncode == 0, completed.stderr
    data = json.loads(completed.stdout)
    assert (data["precision"], data["weights"], data["kv_dtype"]) == ("auto", "nf4", "bfloat16")
    for field in ("predicted_tokens_per_second", "plain_tokens_per_second", "predicted_prefill_seconds",
                  "exact_tokens_per_second"):
        assert isinstance(data[field], float) and data[field] > 0, field
    assert data["predicted_tokens_per_second"] > data["exact_tokens_per_second"]
    monkeypatch.setenv(PRECISION_ENV, "exact")
    exact = json.loads(specchat(*command, timeout=120).stdout)
    assert (exact["precision"], exact["weights"], exact["kv_device"]) == ("exact", "bfloat16", "cpu-pinned")
    assert_bad_input(specchat(*command, "--precision", "fast", timeout=120), "--precision 'fast'")


def test_every_command_takes_the_precision_and_a_bad_setting_stops_it_before_loading(monkeypatch):
    from specchat.app.models_cmd import plan_fit

    monkeypatch.setenv("SPECCHAT_PRECISION", "fastest")
    assert_bad_input(specchat("generate", "--prompt", "Hi", timeout=120), "SPECCHAT_PRECISION")
    monkeypatch.delenv("SPECCHAT_PRECISION")
    completed = specchat("generate", "--prompt", "Hi", "--precision", "fastest", timeout=120)
    assert completed.returncode == 2 and "invalid choice" in completed.stderr
    # The Models tab's fit and loading plan as the setting says, as `specchat plan` does.
    pair, profile = LLAMA, PROFILES["rtx3090-24gb-32gb"]
    monkeypatch.setenv("SPECCHAT_PRECISION", "exact")
    exact = plan_fit(pair, profile, REGISTRY)
    monkeypatch.setenv("SPECCHAT_PRECISION", "auto")
    assert plan_fit(pair, profile, REGISTRY) != exact


def test_a_windows_3090_never_plans_to_pin_more_than_half_its_ram():
    """Issue 38: CUDA on Windows page-locks at most about half the RAM. With 28 GB, Linux's exact
    plan pins 16.1 GB, which would fail there; Windows' keeps more layers' KV on the GPU instead, the
    weights still bf16. A placement that would pin too much says so."""
    linux = dataclasses.replace(PROFILES["rtx3090-24gb-32gb"],
                                ram_total_bytes=PROFILES["rtx3090-24gb-32gb"].ram_total_bytes * 28 // 32)
    windows = dataclasses.replace(linux, os="windows")

    def pinned(plan):
        return sum(item.bytes for item in plan.memory if item.where == "cpu" and "pinned" in item.what)

    assert pinned(make_plan(linux, LLAMA, 131072, Overrides(precision="exact"))) > windows.pinnable_bytes
    for precision in ("auto", "exact"):
        plan = make_plan(windows, LLAMA, 131072, Overrides(precision=precision))
        assert pinned(plan) <= windows.pinnable_bytes == windows.ram_total_bytes // 2, precision
    exact = make_plan(windows, LLAMA, 131072, Overrides(precision="exact"))
    assert (exact.weights, exact.kv_dtype, exact.kv_resident_layers) == ("bfloat16", "bfloat16", 6)
    all_streamed = Layout(windows, LLAMA, 131072, "plain", 4096, EXACT, "none", False, False, 4096)
    assert not all_streamed.fits and all_streamed.shortfall() == (
        "its offloaded KV would pin 17.2 GB of RAM, and windows lets CUDA pin at most 14.7 GB (half the RAM)")


def test_an_offloaded_kv_goes_with_a_target_on_one_gpu():
    """The streamer stages layers on the GPU a forward starts on (kv/offload.py), so no plan splits
    a target over GPUs with its KV offloaded: on two 12 GB cards at 128K, bf16 weights need both and
    their KV fits on neither, so the exact plan takes 8-bit weights on one card and says why."""
    one = PROFILES["rtx3060-12gb"]
    two = dataclasses.replace(one, gpus=(one.gpus[0], dataclasses.replace(one.gpus[0], index=1)))
    for precision in ("exact", "auto"):
        plan = make_plan(two, LLAMA, 131072, Overrides(precision=precision))
        assert plan.kv_device != "cpu-pinned" or len(plan.target_devices) == 1, precision
    exact = make_plan(two, LLAMA, 131072, EXACT)
    assert (exact.weights, exact.kv_device, len(exact.target_devices)) == ("int8", "cpu-pinned", 1)
    assert ("bfloat16 weights need 2 GPUs, and an offloaded KV is streamed to one; its 17.2 GB do not fit beside "
            "them on the GPUs") in exact.reasons["weights"]

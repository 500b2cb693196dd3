"""The planner against synthetic machines (tests/data/profiles) and every pair of models.toml,
and `specchat plan` through app.plan_cmd. All pure arithmetic: no model is loaded. The exact
precision's policy is held here; the automatic precision's choice in test_plan_candidates.py."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from conftest import DATA
from specchat.app.plan_cmd import add_parsers, parse_context, plan_markdown, run_plan
from specchat.core.errors import InputError
from specchat.core.hardware import HardwareProfile, ModelCurves, curve_key
from specchat.core.kv.slabs import pinned_bytes
from specchat.core.placement import target_options
from specchat.core.planning import (
    DSI_MARGIN,
    NF4_BITS,
    RAM_MARGIN_SHARE,
    VRAM_MARGIN_SHARE,
    Overrides,
    Plan,
    PlanRefused,
    kv8_bytes_per_token,
    make_plan,
)
from specchat.core.registry import DTYPE_BYTES, load_registry
from specchat.core.speculative.dsi.cost import dsi_lookahead
from specchat.core.speculative.lookahead import MAX_DRAFT
from specchat.core.speculative.forward_times import ForwardTimes
from specchat.core.speculative.optimizer import choose_tree

PROFILES = {path.stem: HardwareProfile.load(path) for path in sorted((DATA / "profiles").glob("*.json"))}
REGISTRY = load_registry()
CONTEXTS = (32 * 1024, 128 * 1024)
EXACT = Overrides(precision="exact")


def test_the_synthetic_machines_are_the_issues():
    assert set(PROFILES) == {"laptop-rtx4060-8gb", "rtx4060ti-8gb-32gb", "rtx3060-12gb", "rtx4080-16gb",
                             "rtx3090-24gb-32gb", "rtx4090-24gb", "2x-rtx4090", "cpu-only-32gb"}
    assert [len(profile.gpus) for profile in PROFILES.values()] == [2, 0, 1, 1, 1, 1, 1, 1]


def _plan_or_refusal(profile, pair_id, context, overrides=None):
    try:
        return make_plan(profile, REGISTRY.get(pair_id), context, overrides, registry=REGISTRY)
    except PlanRefused as refusal:
        return refusal


@pytest.mark.parametrize("precision", ["exact", "auto"])
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("pair_id", sorted(REGISTRY.pairs))
@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_every_pair_on_every_machine(profile_name, pair_id, context, precision):
    profile, pair = PROFILES[profile_name], REGISTRY.get(pair_id)
    overrides = Overrides(precision=precision)
    result = _plan_or_refusal(profile, pair_id, context, overrides)
    if isinstance(result, PlanRefused):
        _check_refusal(profile, result, precision)
        return
    plan = result
    assert plan.precision == precision
    _check_memory(profile, plan)
    _check_reasons(plan, pair)
    _check_dsi(profile, plan)
    if precision == "exact":
        # The weights: 4-bit only where neither bf16 nor 8-bit fits, 8-bit only where bf16 does not;
        # the KV in the compute dtype.
        finer = {"nf4": ("none", "int8"), "int8": ("none",)}.get(plan.weights, ())
        for quantization in finer:
            with pytest.raises(PlanRefused):
                make_plan(profile, pair, context, Overrides(quantization=quantization, precision="exact"))
        assert plan.kv_dtype != "int8"
    else:  # LLM.int8 only when asked for; an 8-bit KV only with a GPU (on it, or streamed to it)
        assert plan.weights != "int8" and (plan.kv_dtype != "int8" or bool(profile.gpus))
    # The full KV: the registry's shapes, every token, wherever it lives (DSI: one per instance).
    dtype_bytes = 2 if profile.gpus else DTYPE_BYTES[pair.target.dtype]
    target = pair.target
    per_token = kv8_bytes_per_token(target) if plan.kv_dtype == "int8" else \
        2 * target.layers * target.kv_heads * target.head_dim * dtype_bytes
    copies = len(plan.dsi_devices) or 1
    # Pinned, the streamed layers' keys and values are packed into power-of-two blocks (kv/slabs.py).
    pinned = [item for item in plan.memory if "full KV" in item.what and "pinned" in item.what]
    streamed = target.layers - plan.kv_resident_layers
    per_tensor = context * per_token // target.layers // 2
    assert all(item.bytes == pinned_bytes(per_tensor, 2 * streamed) for item in pinned)
    held = sum(item.bytes for item in plan.memory if "full KV" in item.what and item not in pinned)
    assert held + len(pinned) * 2 * streamed * per_tensor == pytest.approx(copies * context * per_token, abs=64)
    _check_weights(plan, pair, dtype_bytes, copies)
    # Predictions wherever the GPUs' bandwidths are measured (all synthetic GPUs are), none on a CPU;
    # beside them, the exact placement's.
    predicted = (plan.predicted_tokens_per_second, plan.plain_tokens_per_second, plan.predicted_prefill_seconds)
    assert all(value is not None and value > 0 for value in predicted) if profile.gpus else \
        predicted == (None, None, None)
    exact = _plan_or_refusal(profile, pair_id, context, EXACT)
    assert plan.exact_tokens_per_second == (None if isinstance(exact, PlanRefused) else
                                            exact.predicted_tokens_per_second)


def _check_memory(profile, plan):
    """Each device's total is the sum of its items and stays under its capacity by the margin."""
    names = {device.device for device in plan.devices}
    assert {item.where for item in plan.memory} <= names
    for device in plan.devices:
        assert device.used_bytes == sum(item.bytes for item in plan.memory if item.where == device.device)
        assert device.used_bytes + device.margin_bytes <= device.capacity_bytes
        assert device.headroom_bytes >= 0
        share = RAM_MARGIN_SHARE if device.device == "cpu" else VRAM_MARGIN_SHARE
        assert device.margin_bytes >= int(share * device.capacity_bytes)
    gpu_capacity = {f"cuda:{gpu.index}": gpu.vram_total_bytes for gpu in profile.gpus}
    for name, total in gpu_capacity.items():
        used = sum(item.bytes for item in plan.memory if item.where == name)
        assert used <= (1 - VRAM_MARGIN_SHARE) * total
    assert sum(plan.target_layers) == REGISTRY.get(plan.pair_id).target.layers


def _check_weights(plan, pair, dtype_bytes, copies):
    """The target's weights recomputed from params, vocabulary and hidden size, per copy."""
    target = pair.target
    matrix = target.vocab_size * target.hidden_size
    bits = {"nf4": NF4_BITS, "int8": 8 + 32 / target.hidden_size}.get(plan.weights, 8 * dtype_bytes)
    head_bits = bits if plan.head_weights == plan.weights else 8 * dtype_bytes
    expected = copies * (matrix * dtype_bytes + int(matrix * head_bits / 8)
                         + max(0.0, target.params_b * 1e9 - 2 * matrix) * bits / 8)
    items = [item for item in plan.memory if item.what.startswith(("target weights", "target embedding",
                                                                   "target output head"))
             or item.what.startswith("target layers") and "weights" in item.what]
    assert sum(item.bytes for item in items) == pytest.approx(expected, rel=1e-6)
    if plan.weights in ("bfloat16", "float32"):  # unquantized: exactly params x dtype bytes
        assert sum(item.bytes for item in items) == pytest.approx(copies * target.params_b * 1e9 * dtype_bytes,
                                                                  rel=1e-6)


def _check_reasons(plan, pair):
    needed = {"mode", "weights", "placement", "kv", "tree", "prefill_chunk", "precision", "answers"}
    needed |= {"gammas"} if plan.mode in ("chain", "triforce") else set()
    needed |= {"retrieval"} if plan.mode == "triforce" else set()
    needed |= {"draft_cache"} if plan.draft_device else set()
    assert needed <= set(plan.reasons)
    assert all(reason.strip() and "\n" not in reason for reason in plan.reasons.values())
    assert plan.reasons["mode"].startswith(plan.mode)
    assert plan.reasons["weights"].startswith(plan.weights)


def _check_dsi(profile, plan):
    """DSI only over two or more GPUs, each with a whole target; the engine's own is the first.
    With two GPUs the plan always says why it chose DSI or not; with one it never mentions it."""
    if plan.mode == "dsi":
        assert len(plan.dsi_devices) >= 2 and plan.target_devices == plan.dsi_devices[:1]
        assert plan.reasons["mode"].startswith(f"dsi over {len(plan.dsi_devices)} GPUs") and "dsi" not in plan.reasons
        target_layers = REGISTRY.get(plan.pair_id).target.layers
        for device in plan.dsi_devices:
            assert any(item.where == device and item.what.startswith(f"target layers 0-{target_layers - 1}: weights")
                       for item in plan.memory)
    else:
        assert plan.dsi_devices == () and plan.dsi_lookahead is None
        assert ("dsi" in plan.reasons) == (len(profile.gpus) >= 2)


def _check_refusal(profile, refusal, precision="auto"):
    message = str(refusal)
    assert "\n" not in message and refusal.alternatives
    assert f"nearest that fits: {refusal.alternatives[0].summary}" in message
    for alternative in refusal.alternatives:  # each alternative plans
        plan = make_plan(profile, REGISTRY.get(alternative.pair_id), alternative.context,
                         Overrides(quantization=alternative.quantization, precision=alternative.precision or precision))
        _check_memory(profile, plan)


def test_an_exact_refusal_offers_the_automatic_precision_first_where_it_fits():
    """A user who asked for the model's own precision learns that the quantized placement fits
    the context asked, before being offered a shorter one."""
    refusal = _plan_or_refusal(PROFILES["laptop-rtx4060-8gb"], "llama3.1-8b", 131072, EXACT)
    first = refusal.alternatives[0]
    assert (first.pair_id, first.context, first.precision) == ("llama3.1-8b", 131072, "auto")
    assert "nearest that fits: llama3.1-8b at 131,072 tokens with --precision auto" in str(refusal)
    assert all(alternative.precision is None for alternative in refusal.alternatives[1:])
    assert isinstance(_plan_or_refusal(PROFILES["laptop-rtx4060-8gb"], "llama3.1-8b", 131072), Plan)


def test_what_each_machine_gets():
    """The exact precision's headline outcomes, stated so a change of policy shows up here (the
    automatic precision's: test_plan_candidates.py)."""
    big = make_plan(PROFILES["rtx4090-24gb"], REGISTRY.get("llama3.1-8b"), 131072, EXACT)
    assert (big.weights, big.kv_device, big.mode, big.draft_device) == ("bfloat16", "cpu-pinned", "triforce", "cuda:0")
    two = make_plan(PROFILES["2x-rtx4090"], REGISTRY.get("llama3.1-8b"), 131072, EXACT)
    assert two.kv_device == "cuda:0+cuda:1" and two.target_devices == ("cuda:0", "cuda:1")
    assert "split in layer order" in two.reasons["placement"] and two.draft_device == "cuda:1"
    short = make_plan(PROFILES["2x-rtx4090"], REGISTRY.get("qwen2.5-7b"), 32768, EXACT)
    assert short.mode == "dsi" and short.dsi_devices == ("cuda:0", "cuda:1") and short.draft_device == "cuda:1"
    alone = make_plan(PROFILES["2x-rtx4090"], REGISTRY.get("qwen3-8b"), 32768, EXACT)
    assert alone.target_devices == ("cuda:0",) and "keeps the other GPU" in alone.reasons["placement"]
    # 12 GB: 8-bit rather than 4-bit, with the embedding table in RAM (precision before a big prefill chunk).
    small = make_plan(PROFILES["rtx3060-12gb"], REGISTRY.get("llama3.1-8b"), 131072, EXACT)
    assert (small.weights, small.head_weights, small.embedding_device) == ("int8", "bfloat16", "cpu")
    assert "bfloat16 weights need" in small.reasons["weights"] and "embedding table" in small.reasons["placement"]
    # 8 GB and 32 GB of RAM: 4-bit, the KV offloaded; a chain keeps the output head unquantized, as
    # TriForce's retrieval cache does not fit beside it (precision first).
    eight = make_plan(PROFILES["rtx4060ti-8gb-32gb"], REGISTRY.get("llama3.1-8b"), 131072, EXACT)
    assert (eight.weights, eight.head_weights, eight.kv_device, eight.mode) == \
        ("nf4", "bfloat16", "cpu-pinned", "chain")
    assert eight.reasons["mode"].startswith("chain: TriForce's retrieval cache does not fit beside these weights and KV")
    # TriForce asked for: 4-bit, the output head too, the embedding in RAM, the KV offloaded.
    eight = make_plan(PROFILES["rtx4060ti-8gb-32gb"], REGISTRY.get("llama3.1-8b"), 131072,
                      Overrides(mode="triforce", precision="exact"))
    assert (eight.weights, eight.head_weights, eight.embedding_device, eight.kv_device, eight.mode) == \
        ("nf4", "nf4", "cpu", "cpu-pinned", "triforce")
    assert "the output head quantized too" in eight.reasons["weights"]
    cpu = make_plan(PROFILES["cpu-only-32gb"], REGISTRY.get("embedded"), 8192, EXACT)
    assert (cpu.weights, cpu.mode, cpu.kv_device, cpu.target_devices) == ("float32", "chain", "cpu", ("cpu",))
    with pytest.raises(PlanRefused, match="nearest that fits"):
        make_plan(PROFILES["laptop-rtx4060-8gb"], REGISTRY.get("llama3.1-8b"), 131072, EXACT, registry=REGISTRY)


def test_a_context_past_the_pair_is_refused_with_its_limit():
    refusal = _plan_or_refusal(PROFILES["cpu-only-32gb"], "embedded", 32768)
    assert isinstance(refusal, PlanRefused) and "at most 8,192 tokens" in str(refusal)
    assert (refusal.alternatives[0].pair_id, refusal.alternatives[0].context) == ("embedded", 8192)


def test_a_forced_precision_that_does_not_fit_suggests_4_bit_first():
    refusal = _plan_or_refusal(PROFILES["rtx3060-12gb"], "llama3.1-8b", 32768, Overrides(quantization="none"))
    assert isinstance(refusal, PlanRefused)
    assert refusal.alternatives[0].quantization == "nf4" and refusal.alternatives[0].context == 32768
    forced = make_plan(PROFILES["rtx4090-24gb"], REGISTRY.get("llama3.1-8b"), 32768, Overrides(quantization="nf4"))
    assert forced.weights == "nf4" and "as requested" in forced.reasons["weights"]


def test_gamma2_grows_as_the_offloaded_verification_gets_dearer():
    profile, pair = PROFILES["rtx4090-24gb"], REGISTRY.get("qwen2.5-7b")
    triforce = Overrides(mode="triforce", precision="exact")
    offloaded = make_plan(profile, pair, 131072, triforce)
    on_chip = make_plan(PROFILES["2x-rtx4090"], pair, 131072, triforce)
    assert offloaded.kv_device == "cpu-pinned" and on_chip.kv_device.startswith("cuda")
    assert offloaded.gamma2 > on_chip.gamma2
    slow_link = dataclasses.replace(profile, gpus=tuple(
        dataclasses.replace(gpu, host_to_device_bytes_per_s=gpu.host_to_device_bytes_per_s / 4) for gpu in profile.gpus))
    assert make_plan(slow_link, pair, 131072, triforce).gamma2 > offloaded.gamma2
    unmeasured = dataclasses.replace(profile, gpus=tuple(
        dataclasses.replace(gpu, host_to_device_bytes_per_s=None) for gpu in profile.gpus))
    default = make_plan(unmeasured, pair, 131072, EXACT)  # not predicted: TriForce, the first mode
    assert default.mode == "triforce" and default.gamma2 == 6 and "not measured" in default.reasons["gammas"]


def test_the_tree_comes_from_the_optimizer_when_t_n_and_acceptance_are_known():
    profile, pair = PROFILES["cpu-only-32gb"], REGISTRY.get("embedded")
    times = ForwardTimes(sizes=(1, 8, 16, 32), ratios=(1.0, 1.1, 1.3, 1.8), one_token_seconds=0.05, context=2048,
                         device="cpu (synthetic)")
    key = curve_key(pair.target.repo, pair.target.revision, "float32")
    measured = profile.with_curves(ModelCurves(key, (times,)))
    acceptance = (0.6, 0.2, 0.1, 0.05)
    plan = make_plan(measured, pair, 4096, Overrides(acceptance=acceptance, draft_cost=0.1))
    expected = choose_tree(list(acceptance), times, 0.1, 32, 12)
    assert (plan.mode, plan.tree_size, plan.tree_depth) == ("tree", expected.size, expected.depth)
    assert "beats the best chain" in plan.reasons["mode"]
    default = make_plan(profile, pair, 4096)
    assert (default.mode, default.tree_size, default.tree_depth) == ("chain", 16, 4)
    assert "stated default" in default.reasons["tree"]


def test_overrides_and_bad_requests():
    profile, pair = PROFILES["rtx4090-24gb"], REGISTRY.get("qwen2.5-7b")
    plain = make_plan(profile, pair, 32768, Overrides(mode="plain"))
    assert plain.mode == "plain" and plain.draft_device is None and plain.gamma1 is None and plain.gamma2 is None
    narrow = make_plan(profile, pair, 131072, Overrides(retrieval_budget=2048, mode="triforce"))
    assert narrow.retrieval_budget == 2048
    for bad in (Overrides(quantization="int3"), Overrides(mode="fast"), Overrides(retrieval_budget=0),
                Overrides(retrieval_acceptance=1.5), Overrides(precision="fast")):
        with pytest.raises(InputError):
            make_plan(profile, pair, 32768, bad)
    with pytest.raises(InputError):
        make_plan(profile, pair, 0)
    assert make_plan(profile, pair, 32768) == make_plan(profile, pair, 32768)  # pure


# ---- DSI: several GPUs that each hold the target ---------------------------------------------


def _cards(name, count=2):
    """A synthetic machine with `count` copies of the named profile's GPU."""
    profile = PROFILES[name]
    gpus = tuple(dataclasses.replace(profile.gpus[0], index=index) for index in range(count))
    return dataclasses.replace(profile, gpus=gpus)


def test_two_cards_that_each_hold_the_target_run_dsi_where_its_cost_model_wins():
    profile, pair = _cards("rtx4090-24gb"), REGISTRY.get("llama3.1-8b")
    plan = make_plan(profile, pair, 8192)
    assert (plan.mode, plan.dsi_devices, plan.target_devices, plan.draft_device, plan.kv_device) == (
        "dsi", ("cuda:0", "cuda:1"), ("cuda:0",), "cuda:1", "cuda:0")
    _check_memory(profile, plan)
    _check_dsi(profile, plan)
    reason = plan.reasons["mode"]
    assert reason.startswith("dsi over 2 GPUs (cuda:0, cuda:1) that each hold a whole target: predicted ")
    assert float(reason.split("predicted ")[1].split("x")[0]) >= DSI_MARGIN
    assert "x a chain on cuda:0 (" in reason and "draft acceptance 0.80" in reason
    # The lookahead: the paper's inequality with the plan's own step times (memory-bound reads).
    target, draft, rate = pair.target, pair.draft, profile.gpus[0].memory_bytes_per_s
    weights = (target.params_b * 1e9 - target.vocab_size * target.hidden_size) * 2  # bf16, all but the embedding
    verification = (weights + 8192 * target.kv_bytes_per_token(2)) / rate
    assert plan.dsi_lookahead == dsi_lookahead(verification, draft.params_b * 1e9 * 2 / rate, 2, MAX_DRAFT) == 4
    assert f"lookahead {plan.dsi_lookahead}, a draft step 15.4% of a verification" in reason
    assert plan.reasons["placement"].startswith("a whole target (16.1 GB) on each of cuda:0, cuda:1")
    # A third card: one more instance, and a lookahead no longer than with two.
    three = make_plan(_cards("rtx4090-24gb", 3), pair, 8192)
    assert three.dsi_devices == ("cuda:0", "cuda:1", "cuda:2") and three.dsi_lookahead <= plan.dsi_lookahead
    assert three.reasons["mode"].startswith("dsi over 3 GPUs")


def test_dsi_loses_to_one_card_with_a_slow_inaccurate_draft():
    profile, pair = _cards("rtx4090-24gb"), REGISTRY.get("llama3.1-8b")
    slow = make_plan(profile, pair, 8192, Overrides(acceptance=(0.1,), draft_cost=0.6, precision="exact"))
    assert (slow.mode, slow.dsi_devices, slow.target_devices) == ("chain", (), ("cuda:0",))
    reason = slow.reasons["dsi"]
    assert reason.startswith("not chosen: DSI over 2 GPUs (cuda:0, cuda:1) that each hold a whole target is "
                             "predicted 1.04x a chain on cuda:0, under the 1.10x it needs (")
    assert "lookahead 1, a draft step 60.0% of a verification, draft acceptance 0.10" in reason
    # The same slow draft accepted more often: DSI hides its drafting behind the verifications.
    assert make_plan(profile, pair, 8192, Overrides(acceptance=(0.3,), draft_cost=0.6, precision="exact")).mode == "dsi"


def test_a_target_that_fits_only_split_is_split_and_the_plan_says_why_not_dsi():
    plan = make_plan(_cards("rtx3060-12gb"), REGISTRY.get("llama3.1-8b"), 8192)
    assert (plan.mode, plan.weights, plan.target_devices, plan.dsi_devices) == (
        "chain", "bfloat16", ("cuda:0", "cuda:1"), ())
    assert plan.reasons["dsi"] == ("not chosen: no two GPUs each hold a whole target (bfloat16 weights, 16.1 GB) even "
                                   "with its KV offloaded, so its layers are split across them")
    big, small = PROFILES["rtx4090-24gb"], PROFILES["laptop-rtx4060-8gb"]
    mixed = dataclasses.replace(big, gpus=(big.gpus[0], dataclasses.replace(small.gpus[0], index=1)))
    plan = make_plan(mixed, REGISTRY.get("llama3.1-8b"), 8192)
    assert (plan.mode, plan.target_devices, plan.draft_device) == ("chain", ("cuda:0",), "cuda:1")
    assert plan.reasons["dsi"].endswith("even with its KV offloaded; only cuda:0 does")


def test_a_split_that_keeps_the_kv_on_chip_beats_dsi_streaming_it_over_each_link():
    """128K tokens: each card holds a target only with its KV offloaded, while the split keeps
    the KV with its layers; each instance would stream 16 GB over its own link per verification."""
    plan = make_plan(PROFILES["2x-rtx4090"], REGISTRY.get("llama3.1-8b"), 131072)
    assert plan.mode == "chain" and plan.kv_device == "cuda:0+cuda:1"  # a chain beats TriForce on the split
    assert plan.reasons["mode"].startswith("chain: predicted 76.0 tok/s against 57.2 for TriForce with these weights")
    reason = plan.reasons["dsi"]
    assert reason.startswith("not chosen: DSI over 2 GPUs (cuda:0, cuda:1) that each hold a whole target is "
                             "predicted 0.")
    assert "on cuda:0+cuda:1, under the 1.10x it needs" in reason
    assert reason.endswith("a verification 698.4 ms, each instance streaming its KV over its own link)")


def test_one_card_never_runs_dsi():
    for name in ("laptop-rtx4060-8gb", "rtx3060-12gb", "rtx4080-16gb", "rtx4090-24gb", "cpu-only-32gb"):
        for pair_id in ("embedded", "qwen2.5-7b"):
            plan = _plan_or_refusal(PROFILES[name], pair_id, 8192)
            if isinstance(plan, PlanRefused):
                continue
            assert plan.mode != "dsi" and plan.dsi_devices == () and "dsi" not in plan.reasons


def test_dsi_asked_for_or_another_mode_asked_for():
    profile, pair = _cards("rtx4090-24gb"), REGISTRY.get("llama3.1-8b")
    forced = make_plan(profile, pair, 131072, Overrides(mode="dsi", precision="exact"))  # the cost model would say no
    assert (forced.mode, forced.dsi_devices, forced.kv_device) == ("dsi", ("cuda:0", "cuda:1"), "cpu-pinned")
    assert forced.reasons["mode"] == "dsi: as requested" and "its own link" in forced.reasons["dsi"]
    assert "each instance over its own link" in forced.reasons["kv_attention"]
    # The automatic precision's fastest DSI keeps each instance's KV on its card: 4-bit weights make the room.
    fast = make_plan(profile, pair, 131072, Overrides(mode="dsi"))
    assert (fast.mode, fast.dsi_devices, fast.weights, fast.kv_device) == ("dsi", ("cuda:0", "cuda:1"), "nf4", "cuda:0")
    assert fast.predicted_tokens_per_second > forced.predicted_tokens_per_second
    alone = make_plan(PROFILES["rtx4090-24gb"], pair, 8192, Overrides(mode="dsi"))
    assert (alone.mode, alone.dsi_devices) == ("dsi", ()) and "CPU worker processes" in alone.reasons["dsi"]
    chain = make_plan(profile, pair, 8192, Overrides(mode="chain"))
    assert chain.mode == "chain" and "dsi" not in chain.reasons


def test_dsi_needs_measured_bandwidths():
    profile = _cards("rtx4090-24gb")
    unmeasured = dataclasses.replace(profile, gpus=tuple(dataclasses.replace(gpu, memory_bytes_per_s=None)
                                                         for gpu in profile.gpus))
    plan = make_plan(unmeasured, REGISTRY.get("llama3.1-8b"), 8192)
    assert plan.mode == "chain" and "bandwidths measured" in plan.reasons["dsi"]


# ---- the command line ------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(prog="specchat")
    commands = parser.add_subparsers(dest="command")
    add_parsers(commands, lambda sub: sub.add_argument("--models-file", default=argparse.SUPPRESS))
    return parser.parse_args(argv)


@pytest.mark.parametrize("text, tokens", [("32768", 32768), ("32K", 32768), ("128k", 131072), ("1M", 1048576)])
def test_parse_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["", "0", "12Q", "-5", "32 KB", "1.5K"])
def test_parse_context_rejects(text):
    with pytest.raises(InputError, match="--context"):
        parse_context(text)


@pytest.mark.parametrize("precision, weights, kv_dtype", [("exact", "bfloat16", "bfloat16"), ("auto", "nf4", "bfloat16")])
def test_plan_command_json(capsys, precision, weights, kv_dtype):
    profile = str(DATA / "profiles" / "rtx4090-24gb.json")
    args = _parse(["plan", "--pair", "llama3.1-8b", "--context", "128K", "--profile", profile, "--json",
                   "--precision", precision])
    assert run_plan(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"pair_id", "context", "mode", "weights", "target_devices", "kv_device", "gamma1", "gamma2", "tree_size",
            "tree_depth", "prefill_chunk", "memory", "devices", "reasons", "kv_dtype", "precision"} <= set(data)
    assert (data["context"], data["weights"], data["kv_dtype"], data["precision"]) == (131072, weights, kv_dtype,
                                                                                     precision)
    assert all({"what", "where", "bytes"} == set(item) for item in data["memory"])
    assert all(device["headroom_bytes"] >= 0 for device in data["devices"])


def test_plan_command_text(capsys):
    profile = str(DATA / "profiles" / "2x-rtx4090.json")
    argv = ["plan", "--pair", "qwen3-8b", "--context", "32768", "--profile", profile, "--precision", "exact"]
    assert run_plan(_parse(argv)) == 0
    out = capsys.readouterr().out
    assert out.startswith("qwen3-8b at 32,768 tokens: chain")
    assert any(line.startswith("  mode ") and "for TriForce with these weights" in line for line in out.splitlines())
    assert "MEMORY" in out and "total on cuda:0" in out and "margin" in out and "weights " in out
    assert any(line.startswith("  dsi ") and "not chosen: " in line for line in out.splitlines())  # why not DSI


def test_plan_command_shows_dsi_and_why(capsys):
    profile = str(DATA / "profiles" / "2x-rtx4090.json")
    assert run_plan(_parse(["plan", "--pair", "llama3.1-8b", "--context", "8K", "--profile", profile])) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3.1-8b at 8,192 tokens: dsi (lookahead 4, 2 instances), bfloat16 weights on each of "
                          "cuda:0, cuda:1, draft bfloat16 on cuda:1, full KV on each instance's GPU\n")
    assert "dsi over 2 GPUs (cuda:0, cuda:1) that each hold a whole target: predicted 1.31x a chain on cuda:0" in out
    assert out.count("target layers 0-31: weights (bfloat16)") == 2  # one target per card
    plan = make_plan(PROFILES["2x-rtx4090"], REGISTRY.get("llama3.1-8b"), 8192)
    assert "| mode | dsi over 2 GPUs (cuda:0, cuda:1) that each hold a whole target: predicted" in plan_markdown(plan)
    args = _parse(["plan", "--pair", "llama3.1-8b", "--context", "8K", "--profile", profile, "--json"])
    assert run_plan(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "dsi" and data["dsi_devices"] == ["cuda:0", "cuda:1"] and data["dsi_lookahead"] == 4


def test_plan_command_refusal_json_exits_2(capsys):
    """The exact model's KV (the 8-bit one fits this laptop's RAM)."""
    profile = str(DATA / "profiles" / "laptop-rtx4060-8gb.json")
    args = _parse(["plan", "--pair", "qwen3-8b", "--context", "128K", "--profile", profile, "--json",
                   "--precision", "exact"])
    assert run_plan(args) == 2
    data = json.loads(capsys.readouterr().out)
    assert "does not fit" in data["refused"]
    assert [(alternative["pair_id"], alternative["context"] < 131072, alternative["precision"])
            for alternative in data["alternatives"]] == \
        [("qwen3-8b", False, "auto"), ("qwen3-8b", True, None), ("qwen2.5-7b", False, None)]
    # the automatic precision at this context, a shorter context, or a smaller pair


def test_a_pair_whose_weights_never_fit_is_not_searched_for_a_shorter_context(monkeypatch):
    """A refusal on a small machine took 0.7 s (a binary search over every context for each pair
    whose weights alone do not fit); the shortest context is tried first."""
    from specchat.core.planning import plan as planning

    profile = PROFILES["laptop-rtx4060-8gb"]
    tiny = dataclasses.replace(profile, ram_total_bytes=4 * 2**30, ram_available_bytes=3 * 2**30, gpus=tuple(
        dataclasses.replace(gpu, vram_total_bytes=2 * 2**30, vram_free_bytes=2 * 2**30) for gpu in profile.gpus))
    tried = []
    real = planning._plans
    monkeypatch.setattr(planning, "_plans", lambda profile, pair, context, overrides:
                        tried.append(context) or real(profile, pair, context, overrides))
    assert planning._longest_context(tiny, REGISTRY.get("llama3.1-8b"), 131071, Overrides()) is None
    assert tried == [1024]


def test_precision_before_the_subcommand_reaches_the_plan(capsys, monkeypatch):
    """`specchat --precision exact plan ...` planned with auto: plan's own option overwrote it."""
    monkeypatch.delenv("SPECCHAT_PRECISION", raising=False)
    from specchat.app.cli import build_parser

    profile = str(DATA / "profiles" / "laptop-rtx4060-8gb.json")
    args = build_parser().parse_args(["--precision", "exact", "plan", "--pair", "qwen3-8b", "--context", "128K",
                                      "--profile", profile, "--json"])
    assert args.precision == "exact" and run_plan(args) == 2


def test_plan_command_bad_input_is_an_input_error(tmp_path):
    good = str(DATA / "profiles" / "rtx3060-12gb.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1, "gpus": []}')
    for argv in (["plan", "--pair", "nope", "--context", "32K", "--profile", good],
                 ["plan", "--pair", "qwen3-8b", "--context", "lots", "--profile", good],
                 ["plan", "--pair", "qwen3-8b", "--context", "32K", "--profile", str(broken)],
                 ["plan", "--pair", "qwen3-8b", "--context", "32K", "--profile", str(tmp_path / "missing.json")],
                 ["plan", "--pair", "embedded", "--context", "32K", "--profile", good]):  # refused, no --json
        with pytest.raises(InputError) as error:
            run_plan(_parse(argv))
        assert "\n" not in str(error.value)


def test_an_offloaded_kv_is_streamed_to_the_gpu_the_one_path_measured_end_to_end():
    profile = PROFILES["rtx4090-24gb"]
    plan = make_plan(profile, REGISTRY.get("llama3.1-8b"), 128 * 1024, EXACT)
    assert plan.kv_device == "cpu-pinned" and "17.8x slower end to end" in plan.reasons["kv_attention"]
    assert target_options(plan, REGISTRY.get("llama3.1-8b").target).offload_capacity == 128 * 1024
    on_chip = make_plan(profile, REGISTRY.get("qwen2.5-7b"), 32 * 1024)
    assert on_chip.kv_device.startswith("cuda") and "kv_attention" not in on_chip.reasons


def test_a_profile_saved_before_the_cpu_attention_field_was_dropped_still_loads():
    text = PROFILES["rtx4090-24gb"].to_json()
    old = json.dumps({**json.loads(text), "cpu_attention_bytes_per_s": 3.0e10})
    assert HardwareProfile.from_json(old) == PROFILES["rtx4090-24gb"]


def test_triforce_verifies_a_tree_where_the_optimizer_says_it_beats_the_chain():
    """With t(n) measured, TriForce's final verification becomes the optimizer's Sequoia tree
    where it beats the gamma2 chain (a GPU's flat t(n)), smaller where verification is dear;
    unmeasured, a chain with the reason why."""
    profile, pair = PROFILES["2x-rtx4090"], REGISTRY.get("llama3.1-8b")
    triforce = Overrides(mode="triforce")
    unmeasured = make_plan(profile, pair, 131072, triforce)
    assert unmeasured.mode == "triforce" and unmeasured.triforce_verify == "chain"
    assert "measured" in unmeasured.reasons["triforce_verify"]
    key = curve_key(pair.target.repo, pair.target.revision, unmeasured.weights, unmeasured.kv_label())

    def with_t(ratios):
        times = ForwardTimes(sizes=(1, 8, 16, 32, 64), ratios=ratios, one_token_seconds=0.03, context=131072,
                             device="synthetic")
        return make_plan(profile.with_curves(ModelCurves(key, (times,))), pair, 131072, triforce)

    flat = with_t((1.0, 1.01, 1.02, 1.05, 1.1))
    assert flat.triforce_verify == "tree" and flat.tree_size > flat.gamma2 + 1
    assert "beats the chain" in flat.reasons["triforce_verify"]
    from specchat.core.runtime import settings_from_plan
    assert settings_from_plan(flat).triforce.tree.size == flat.tree_size
    steep = with_t((1.0, 4.0, 8.0, 16.0, 32.0))  # dear verification: a smaller tree, if any
    assert steep.triforce_verify == "chain" or steep.tree_size < flat.tree_size
    assert settings_from_plan(unmeasured).triforce.tree is None


def test_the_curves_of_an_8bit_or_offloaded_kv_are_their_own():
    """t(n) with an 8-bit or an offloaded KV is another curve than with the model's own KV on the
    GPU: the planner and the loader name it alike, and a CPU plan's name is what it was."""
    profile, pair = PROFILES["rtx3090-24gb-32gb"], REGISTRY.get("llama3.1-8b")
    on_chip = make_plan(PROFILES["rtx4090-24gb"], pair, 32768)
    offloaded = make_plan(profile, pair, 131072, Overrides(precision="exact"))
    assert on_chip.kv_device == "cuda:0" and on_chip.kv_label() == ""
    # A partial offload's t(n) depends on how many layers' KV it keeps on the GPU.
    assert offloaded.kv_device == "cpu-pinned" and offloaded.kv_label() == "kv-offloaded-2-resident"
    all_streamed = dataclasses.replace(offloaded, kv_resident_layers=0)
    assert all_streamed.kv_label() == "kv-offloaded"
    assert dataclasses.replace(on_chip, kv_dtype="int8").kv_label() == "kv-int8"
    assert dataclasses.replace(all_streamed, kv_dtype="int8").kv_label() == "kv-int8+kv-offloaded"
    times = (ForwardTimes(sizes=(1, 2), ratios=(1.0, 1.1), one_token_seconds=0.5, context=131072, device="synthetic"),)

    def missing_t(kv: str) -> bool:
        key = curve_key(pair.target.repo, pair.target.revision, offloaded.weights, kv)
        plan = make_plan(profile.with_curves(ModelCurves(key, times)), pair, 131072, Overrides(precision="exact"))
        return "the target's t(n)" in plan.reasons["tree"]

    assert missing_t("") and not missing_t(offloaded.kv_label())  # curves of the KV on the GPU are not these
    cpu = make_plan(PROFILES["cpu-only-32gb"], REGISTRY.get("embedded"), 8192)
    assert cpu.kv_label() == "" and curve_key("r", "", "float32", cpu.kv_label()) == curve_key("r", "", "float32")

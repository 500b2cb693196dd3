"""models.toml: the shipped pairs, merging a user file over them, and errors that name file,
line and field; plus whether a pair fits, as `specchat models list` and the app's Models tab show
it: the plan's verdict on the synthetic machines of tests/data/profiles."""

from __future__ import annotations

import json

import pytest
from conftest import DATA

from specchat.app.models_cmd import pair_row, plan_fit
from specchat.core.hardware import HardwareProfile
from specchat.core.planning import PlanRefused, make_plan
from specchat.core.registry import COMMIT, RegistryError, UnknownPair, load_registry, shipped_file

PROFILES = {path.stem: HardwareProfile.load(path) for path in sorted((DATA / "profiles").glob("*.json"))}


def test_shipped_pairs_are_complete_and_consistent():
    registry = load_registry()
    assert set(registry.pairs) == {"embedded", "llama3.1-8b", "qwen2.5-7b", "qwen3-8b"}
    for pair in registry.pairs.values():
        if pair.source != "hub":
            continue
        assert pair.context_length == 131072 and pair.draft is not None
        for model in pair.models:
            assert COMMIT.fullmatch(model.revision) and model.download_bytes > model.weight_bytes() * 0.99
        assert pair.draft.vocab_size <= pair.target.vocab_size
    assert registry.get("llama3.1-8b").gated and not registry.get("qwen3-8b").gated
    # KV bytes per token in bf16 = 2 (K and V) x layers x KV heads x head dim x 2 bytes.
    assert registry.get("llama3.1-8b").target.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert registry.get("qwen2.5-7b").target.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2
    assert registry.get("qwen2.5-7b").target.rope_scaling["factor"] == 4.0


def test_a_user_file_overrides_fields_and_adds_pairs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # where platformdirs looks on Linux
    (tmp_path / "specchat").mkdir()
    (tmp_path / "specchat" / "models.toml").write_text(
        '[pairs."qwen3-8b".target]\nrevision = "' + "a" * 40 + '"\n\n'
        '[pairs.mine]\nname = "Mine"\nsource = "hub"\ncontext_length = 4096\nlicense = "MIT"\n'
        '[pairs.mine.target]\nrepo = "me/model"\nrevision = "' + "b" * 40 + '"\nparams_b = 1\n'
        'download_bytes = 2000000000\nlayers = 16\nhidden_size = 2048\nattention_heads = 32\nkv_heads = 8\n'
        'head_dim = 64\nvocab_size = 1000\nmax_position_embeddings = 4096\ndtype = "bfloat16"\n')
    registry = load_registry()
    qwen3 = registry.get("qwen3-8b")
    assert qwen3.target.revision == "a" * 40 and qwen3.target.layers == 36  # the rest stays shipped
    assert registry.get("mine").draft is None and len(registry.files) == 2
    # --models-file replaces the user config file as the overlay.
    other = tmp_path / "other.toml"
    other.write_text('[pairs.embedded]\nname = "Renamed"\n')
    registry = load_registry(other)
    assert registry.get("embedded").name == "Renamed" and "mine" not in registry.pairs
    assert registry.files == (shipped_file(), other)


@pytest.mark.parametrize("text, fragments", [
    ("[pairs.embedded\n", (":1:", "not valid TOML")),
    ('\n\n[pairs.embedded.target]\nlayers = "many"\n', (":4:", "pairs.embedded.target.layers", "must be int")),
    ('[pairs."qwen3-8b".draft]\nrevision = "main"\n', (":2:", "40-character commit hash")),
    ('[pairs."qwen3-8b".target]\nrepo = "no-owner"\n', (":2:", "Hub repo id")),
    ('[pairs.embedded]\nsource = "ftp"\n', (":2:", "must be one of hub, embedded")),
    ('[pairs.embedded]\ncontext_length = 100000\n', (":2:", "exceeds what the target reaches")),
    ('[pairs."qwen3-8b".draft]\nvocab_size = 200000\n', ("not a speculation pair",)),
    ('[pairs.Bad_ID]\nname = "x"\n', (":1:", "pair id")),
    ('[pairs.new]\nname = "x"\nsource = "hub"\ncontext_length = 10\nlicense = "MIT"\n', ("missing table [pairs.new.target]",)),
    ('[pairs.new]\nsource = "hub"\n', (":1:", "missing field 'name'")),
    ("pairs = 3\n", ("pairs",)),
    # Numbers: finite and in range, or the memory arithmetic overflows or lets an absurd pair fit.
    ("[pairs.embedded.target]\nparams_b = inf\n",
     (":2:", "pairs.embedded.target.params_b", "must be a finite number, got inf")),
    ("[pairs.embedded.target]\nparams_b = nan\n", (":2:", "params_b", "must be a finite number, got nan")),
    ("[pairs.embedded.target]\nparams_b = -0.5\n", (":2:", "params_b", "must be positive")),
    ("[pairs.embedded]\nrecommended_vram_gb = -1\n", (":2:", "recommended_vram_gb", "cannot be negative")),
    ("[pairs.embedded.target]\nlayers = 1_000_000_000\n", (":2:", "layers", "1,000,000,000 is past any real model")),
    ('[pairs."qwen3-8b"]\ncontext_length = 999_999_999\n', (":2:", "context_length", "past any real model")),
    ('\n[pairs."qwen3-8b".target]\nrope_scaling = { factor = nan }\n',
     (":3:", "pairs.qwen3-8b.target.rope_scaling.factor", "must be a finite number, got nan")),
    ('[pairs."qwen3-8b".target]\nrope_scaling = { factor = 1e9 }\n', (":2:", "factor", "must be between 1 and 64")),
    ('[pairs."qwen3-8b".target]\nrope_scaling = { factor = 4.0, original_max_position_embeddings = -1 }\n',
     (":2:", "original_max_position_embeddings", "must be positive")),
    ('[pairs."qwen3-8b".target]\nrope_scaling = { factor = 4.0, beta_fast = inf }\n', (":2:", "beta_fast", "finite")),
    # The reach is the original positions times the factor, as the loader sets it (not 40,960 x 4).
    ('[pairs."qwen3-8b"]\ncontext_length = 163840\n', (":2:", "exceeds what the target reaches (131072)")),
    # Unknown keys are typos until proven otherwise.
    ("[pairs.embedded]\ncontxt_length = 4096\n",
     (":2:", "pairs.embedded.contxt_length", "did you mean `context_length`?")),
    ("[pairs.embedded.target]\nparams = 1\n", (":2:", "pairs.embedded.target.params", "did you mean `params_b`?")),
    ("[pairs.embedded.target]\ncolour = 1\n", (":2:", "colour: unknown key: known keys are repo, revision")),
    ("pair = 1\n[pairs.embedded]\nname = 'x'\n", (":1:", "pair: unknown key: did you mean `pairs`?")),
])
def test_errors_name_the_file_the_line_and_the_field(tmp_path, text, fragments):
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(RegistryError) as caught:
        load_registry(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_unknown_pairs_list_the_known_ones():
    with pytest.raises(UnknownPair, match="known pairs are embedded, llama3.1-8b, qwen2.5-7b, qwen3-8b"):
        load_registry().get("llama-70b")


@pytest.mark.parametrize("profile_name, pair_id, verdict", [
    ("cpu-only-32gb", "embedded", "fits (CPU only)"),
    ("cpu-only-32gb", "qwen2.5-7b", "fits (CPU only, slow)"),
    ("cpu-only-32gb", "llama3.1-8b", "fits (4-bit, CPU only, slow)"),
    ("cpu-only-32gb", "qwen3-8b", "does not fit (up to 127K tokens)"),
    ("2x-rtx4090", "qwen3-8b", "fits"),
    ("rtx4090-24gb", "llama3.1-8b", "fits (4-bit, output head too, no draft model)"),  # the automatic precision's fastest
    ("rtx4080-16gb", "qwen2.5-7b", "fits (4-bit)"),  # a chain needs no retrieval cache
    ("rtx3060-12gb", "llama3.1-8b", "fits (4-bit, KV partly offloaded to RAM, no draft model)"),
    ("laptop-rtx4060-8gb", "qwen2.5-7b", "fits (4-bit, KV in 8 bits offloaded to RAM)"),
    ("rtx4060ti-8gb-32gb", "llama3.1-8b", "fits (4-bit, output head too, KV in 8 bits offloaded to RAM, no draft model)"),
    # 16 GB of RAM: the KV in 8 bits fits where the bf16 one (up to 87K tokens) does not
    ("laptop-rtx4060-8gb", "qwen3-8b", "fits (4-bit, KV in 8 bits offloaded to RAM, no draft model)"),
])
def test_the_fit_verdict(profile_name, pair_id, verdict):
    registry = load_registry()
    fit = plan_fit(registry.get(pair_id), PROFILES[profile_name], registry)
    assert (fit.verdict, fit.fits) == (verdict, verdict.startswith("fits"))
    if "CPU only" in verdict:
        assert fit.reason.startswith("runs on the CPU" + (", slowly" if "slow" in verdict else " ("))
    if "bit" in verdict:  # why these weights, in the plan's words: what does not fit, and what is fastest
        assert "weights it needs" in fit.reason or "weights need" in fit.reason or "fastest" in fit.reason


@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_the_fit_is_the_plan_at_the_full_context(profile_name):
    """One answer to "does this pair fit": a pair fits exactly when `make_plan` plans it at its
    full context (as `specchat plan`, "Use this pair" and loading do), and a refusal says what
    the planner says, naming what fits instead."""
    registry, profile = load_registry(), PROFILES[profile_name]
    for pair in registry.pairs.values():
        fit = plan_fit(pair, profile, registry)
        try:
            plan = make_plan(profile, pair, pair.context_length, registry=registry)
        except PlanRefused as refusal:
            assert not fit.fits and fit.reason == str(refusal) and fit.alternatives == refusal.alternatives
            continue
        assert fit.fits and not fit.alternatives and f"at {pair.context_length:,} tokens it uses" in fit.reason
        assert ("4-bit" in fit.verdict) == (plan.weights == "nf4")
        assert ("8-bit" in fit.verdict) == (plan.weights == "int8")
        assert ("KV in 8 bits" in fit.verdict) == (plan.kv_dtype == "int8")
        assert ("offloaded to RAM" in fit.verdict) == (plan.kv_device == "cpu-pinned")
        assert ("CPU only" in fit.verdict) == (plan.target_devices == ("cpu",))


def test_a_pair_row_keeps_the_listing_keys():
    """`specchat models list --json` is a public contract: its keys stay, new ones are added."""
    registry = load_registry()
    row = pair_row(registry.get("qwen3-8b"), PROFILES["cpu-only-32gb"], registry)
    assert {"id", "name", "source", "context_length", "license", "gated", "download_bytes", "download", "fits",
            "fit", "fit_reason", "downloaded", "present_bytes", "status"} <= set(row)
    assert row["fits"] is False and row["fit_reason"].startswith("qwen3-8b at 131,072 tokens does not fit")
    nearest = row["fit_alternatives"][0]
    assert (nearest["pair_id"], nearest["context"]) == ("qwen3-8b", 130048)
    assert json.loads(json.dumps(row)) == row


def test_a_bad_models_file_exits_2_with_its_line(tmp_path):
    """Through the CLI: one line naming the file and line, exit 2 (inf used to crash with exit 1)."""
    import subprocess
    import sys

    path = tmp_path / "bad.toml"
    path.write_text("[pairs.embedded.target]\nparams_b = inf\n")
    completed = subprocess.run(
        [sys.executable, "-c", "from specchat.app.cli import main; raise SystemExit(main())",
         "models", "list", "--models-file", str(path)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr == (f"specchat: error: {path}:2: pairs.embedded.target.params_b: "
                                "must be a finite number, got inf\n")

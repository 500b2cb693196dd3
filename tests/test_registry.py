"""models.toml: the shipped pairs, merging a user file over them, and errors that name file,
line and field; plus the stated fit estimate that `specchat models list` shows."""

from __future__ import annotations

import pytest

from specchat.core.fit import Machine, estimate_fit, gpu_bytes_needed
from specchat.core.registry import COMMIT, RegistryError, UnknownPair, load_registry, shipped_file

GB = 10**9


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


@pytest.mark.parametrize("machine, pair_id, verdict", [
    (Machine(0, 32 * GB), "embedded", "fits (CPU)"),
    (Machine(0, 32 * GB), "qwen3-8b", "no GPU"),
    (Machine(24 * GB, 64 * GB), "llama3.1-8b", "fits (bf16)"),  # RTX 4090
    (Machine(12 * GB, 32 * GB), "llama3.1-8b", "fits (4-bit)"),  # RTX 3060
    (Machine(8 * GB, 16 * GB), "qwen3-8b", "fits (4-bit) up to 84K tokens"),  # laptop 4060, 16 GB RAM
    (Machine(4 * GB, 64 * GB), "qwen3-8b", "too big (GPU)"),
    (Machine(24 * GB, GB // 2), "qwen2.5-7b", "too big (RAM)"),
])
def test_fit_estimate(machine, pair_id, verdict):
    pair = load_registry().get(pair_id)
    fit = estimate_fit(pair, machine)
    assert fit.verdict == verdict and fit.fits == verdict.startswith("fits")
    if fit.fits and pair.source == "hub":
        bits = 4 if "4-bit" in verdict else None
        assert gpu_bytes_needed(pair, bits) <= machine.gpu_bytes
        if bits == 4:
            assert gpu_bytes_needed(pair) > machine.gpu_bytes  # 4-bit only where bf16 does not fit

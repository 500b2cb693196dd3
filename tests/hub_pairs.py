"""A tiny draft/target pair published on the stand-in hub, and the models.toml that names it.

The target pads its embeddings past the tokenizer (as Qwen2.5-7B does) and the draft does not,
so loading the pair exercises the logits padding; a pickle and a README sit beside the weights
to show they are never fetched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from standin_hub import HubRepo

TARGET_REPO = "specchat-test/tiny-target"
DRAFT_REPO = "specchat-test/tiny-draft"
UNWANTED = ("original/consolidated.00.pth", "pytorch_model.bin", "README.md")


@dataclass(frozen=True)
class TinyPair:
    target: HubRepo
    draft: HubRepo

    @property
    def repos(self) -> list[HubRepo]:
        return [self.target, self.draft]

    def wanted(self, repo: HubRepo) -> dict[str, bytes]:
        return {name: data for name, data in repo.files.items() if name not in UNWANTED}

    def models_toml(self, pair_id: str = "tiny") -> str:
        return f"""
[pairs.{pair_id}]
name = "Tiny test pair"
source = "hub"
context_length = 256
license = "Apache-2.0"
gated = {str(self.target.gated).lower()}

[pairs.{pair_id}.target]
{_model_fields(self.target, self.wanted(self.target), hidden=64, layers=2)}

[pairs.{pair_id}.draft]
{_model_fields(self.draft, self.wanted(self.draft), hidden=32, layers=1)}
"""


def _model_fields(repo: HubRepo, files: dict[str, bytes], hidden: int, layers: int) -> str:
    import json

    config = json.loads(files["config.json"])
    return f"""repo = "{repo.repo_id}"
revision = "{repo.sha}"
params_b = 0.003
download_bytes = {sum(len(data) for data in files.values())}
layers = {layers}
hidden_size = {hidden}
attention_heads = 4
kv_heads = 2
head_dim = {hidden // 4}
vocab_size = {config["vocab_size"]}
max_position_embeddings = 256
dtype = "float32\""""


def build_tiny_pair(tokenizer_dir: Path, work: Path, gated: bool = False) -> TinyPair:
    """Save two random Llamas with the embedded tokenizer and read their files back as bytes."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    repos = []
    for repo_id, hidden, layers, pad, seed in ((TARGET_REPO, 64, 2, 64, 0), (DRAFT_REPO, 32, 1, 0, 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer) + pad, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                             tie_word_embeddings=pad == 0)
        folder = work / repo_id.split("/")[1]
        LlamaForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        files = {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}
        files.update({name: f"not for specchat: {name}".encode() for name in UNWANTED})
        repos.append(HubRepo(repo_id, files, gated=gated))
    return TinyPair(*repos)

"""Each model drafter draws its tokens from exactly the Q rows its proposal reports, and a verified
stage reports its own P: verification (Leviathan's rule, Sequoia's) is lossless only against the
Q the tokens were drawn from. A draft sampled with top-p but reported without it moved the
answers' law by a TV of 0.02-0.08, which the end-to-end chi-square tests at 2,000 samples could
not resolve (a mutation audit)."""

import torch

from conftest import tiny_llama
from test_decoding import prompts
from test_tree_decoding import noisy_copy
from specchat.core.sampling import SamplingParams, make_generator, warp
from specchat.core.speculative import hierarchy, tree_drafters
from specchat.core.speculative.hierarchy import ModelDrafter, VerifiedStage
from specchat.core.speculative.token_cache import TokenCache
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.tree_drafters import ModelTreeDrafter
from specchat.core.speculative.types import DecodeState


def test_a_model_drafter_reports_the_distribution_it_sampled_from(monkeypatch):
    target = tiny_llama(0)
    draft = noisy_copy(0, 0.3)
    prompt = torch.tensor(prompts(0)["n-gram hits"])
    real_sample = hierarchy.sample
    for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=20),
                   SamplingParams(temperature=0.7, top_p=0.8, repetition_penalty=1.3, seed=1)):
        state = DecodeState(target, target.new_cache(), prompt, params, make_generator(0), answer_start=30)
        drawn = []
        monkeypatch.setattr(hierarchy, "sample", lambda probs, g: drawn.append(probs) or real_sample(probs, g))
        drafter = ModelDrafter(draft, 2, 16, False, "pair", 16)
        proposal = drafter.draft(state, state.ids, 4)
        assert len(drawn) == len(proposal) == 4
        for row, probs in zip(proposal.q, drawn):
            assert torch.equal(row, probs)


def test_a_model_tree_drafter_reports_the_distribution_each_node_s_children_were_drawn_from(monkeypatch):
    target, draft = tiny_llama(0), noisy_copy(0, 0.3)
    prompt = torch.tensor(prompts(0)["n-gram hits"])
    template = Tree((-1, 0, 0, 0, 1, 1, 2, 4))
    real = tree_drafters.sample_without_replacement
    for params in (SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.2, top_k=10),
                   SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=1.0)):
        drawn = []
        monkeypatch.setattr(tree_drafters, "sample_without_replacement",
                            lambda probs, k, g: drawn.append(probs) or real(probs, k, g))
        state = DecodeState(target, target.new_cache(), prompt, params, make_generator(0), answer_start=30)
        proposal = ModelTreeDrafter(draft, template).propose_tree(state, 16)
        parents = [node for node in range(proposal.tree.size) if proposal.tree.children[node]]
        assert len(drawn) == len(parents)
        for node, probs in zip(parents, drawn):
            assert torch.equal(proposal.q[node], probs)


def test_a_verified_stage_reports_its_own_p_at_each_position_it_hands_on():
    """TriForce's middle stage emits each token distributed exactly as its own P there (accepted
    draft or recovered), so that P is the Q the next stage must verify against. A mutation audit
    found that handing on the drafter's Q for the accepted tokens survived every fast test. Each
    row is checked against the stage's model run over the text handed on."""
    target, draft = tiny_llama(0), noisy_copy(0, 0.3)
    prompt = torch.tensor(prompts(0)["n-gram hits"])
    for params in (SamplingParams(temperature=0.7, top_p=0.8),
                   SamplingParams(temperature=0.7, top_p=0.8, repetition_penalty=1.3, seed=1)):
        state = DecodeState(target, target.new_cache(), prompt, params, make_generator(0), answer_start=30)
        drafter = ModelDrafter(draft, 2, 16, False, "pair", 16)
        stage = VerifiedStage(drafter, TokenCache(target, target.new_cache()), 2, "middle")
        proposal = stage.draft(state, prompt, 12)
        assert 0 < stage.accepted < stage.drafted  # the rows of accepted and of recovered tokens
        text = torch.cat([prompt, proposal.tokens])
        logits = target.forward(text, torch.arange(text.shape[0]), target.new_cache())[prompt.shape[0] - 1:-1]
        own_p = warp(logits, params, state.chain_counts(proposal.tokens[:-1]))
        assert torch.allclose(proposal.q, own_p, atol=1e-9, rtol=0)

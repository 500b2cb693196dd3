"""Tree decoding (Sequoia) end to end on tiny random models: lossless against plain decoding."""

import pytest
import torch

from specchat.core.exact_outcomes import chi_square_p_value
from conftest import tiny_llama
from test_decoding import assert_greedy_identity, exact_sequence_probs, prompts, run
from specchat.core.decoding import TreeDecoder
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.suffix_drafter import SuffixDrafter
from specchat.core.speculative.tree_drafters import ModelTreeDrafter

# Root with 3 children; the first has 2 children, the second 1; depth 3 on the first branch.
TEMPLATE = Tree((-1, 0, 0, 0, 1, 1, 2, 4))


def model_tree_decoder(draft, template=TEMPLATE):
    return TreeDecoder(ModelTreeDrafter(draft, template))


def noisy_copy(seed, noise, **kwargs):
    """A draft close to the target but not equal: the target's weights plus noise."""
    draft = tiny_llama(seed, **kwargs)
    with torch.no_grad():
        for parameter in draft.hf.parameters():
            parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    return draft


def test_greedy_tree_equals_greedy_plain_with_a_draft_model():
    assert_greedy_identity([(seed, tiny_llama(seed, weight_scale=8.0)) for seed in range(3)],
                           lambda seed, model: model_tree_decoder(noisy_copy(seed, 0.3, weight_scale=8.0)), 40)


def test_greedy_tree_equals_greedy_plain_with_suffix_tree_branches():
    assert_greedy_identity(
        [(seed, tiny_llama(seed)) for seed in range(3)],
        lambda seed, model: TreeDecoder(SuffixDrafter()),
        50)


def test_draft_equal_to_target_accepts_whole_paths():
    model = tiny_llama(1, weight_scale=8.0)
    params = SamplingParams(temperature=1.0, seed=0)
    _, steps = run(model, prompts(1)["no n-gram hits"], "tree", params, 30, model_tree_decoder(model))
    # Every step after the first accepts a full root-to-leaf path (depth 3 or 2 or 1 on its branch).
    assert all(s.accepted >= 1 for s in steps[1:-1])


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.9)])
def test_sampled_tree_speculation_samples_from_the_target(params):
    """Through the draft model, tree attention, verification and cache compaction: the first
    four tokens follow the target's exact sequence distribution."""
    target = tiny_llama(7, vocab_size=5, weight_scale=20.0)
    draft = noisy_copy(7, 0.5, vocab_size=5, weight_scale=20.0)
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    exact = exact_sequence_probs(target, prompt, params, 4)
    counts = torch.zeros_like(exact)
    drafted = accepted = deeper = 0
    for sample in range(2000):
        run_params = SamplingParams(params.temperature, params.top_k, params.top_p, seed=sample)
        tokens, steps = run(target, prompt, "tree", run_params, 4, model_tree_decoder(draft))
        counts[tuple(tokens)] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
        deeper += sum(s.accepted >= 2 for s in steps)
    assert 0.1 * drafted < accepted < 0.9 * drafted and deeper > 100
    assert chi_square_p_value(counts, exact) > 1e-3

"""TriForce's hierarchy on tiny random models: lossless against plain decoding at every stage."""

import pytest
import torch

from specchat.core.exact_outcomes import chi_square_p_value
from conftest import tiny_llama
from test_decoding import exact_sequence_probs, prompts, run
from test_tree_decoding import noisy_copy
from specchat.core.decoding import TriforceSettings, decode, prefill_all, triforce_decoder
from specchat.core.sampling import SamplingParams, make_generator
from specchat.core.speculative.types import DecodeState
from specchat.core.speculative.tree import Tree
from specchat.core.runtime import EngineSettings

PREFILL_CHUNK = EngineSettings().prefill_chunk  # the engine's, where a test builds a decoder itself

# Prompts of about 40 tokens against a 24-position retrieval cache: the middle stage really
# reads less than the target, and rebuilds every 8 committed tokens.
SMALL = dict(budget=24, chunk_size=4, recent=8, stride=8, sinks=2, window=16)


@pytest.mark.parametrize("first_stage", ["lookup", "skip1", "pair", ""])
def test_greedy_triforce_equals_greedy_plain(first_stage):
    final_drafted = final_accepted = 0
    stages: dict[str, dict[str, int]] = {}
    for seed in range(3):
        target = tiny_llama(seed, weight_scale=8.0)
        pair = noisy_copy(seed, 0.3, weight_scale=8.0)
        for name, prompt in prompts(seed).items():
            plain, _ = run(target, prompt, "plain", SamplingParams(), 40)
            # A separate draft reads the prompt in chunks (16 tokens: several per prompt).
            decoder = triforce_decoder(target, TriforceSettings(draft=first_stage, **SMALL), pair, prefill_chunk=16)
            speculative, steps = run(target, prompt, "triforce", SamplingParams(), 40, decoder)
            assert speculative == plain, (first_stage, seed, name)
            final_drafted += sum(s.drafted for s in steps)
            final_accepted += sum(s.accepted for s in steps)
            for stage, counts in decoder.stage_counts().items():
                for key, value in counts.items():
                    stages.setdefault(stage, {}).setdefault(key, 0)
                    stages[stage][key] += value
    assert 0 < final_accepted < final_drafted  # the full stage accepted and rejected
    assert stages["retrieval"]["builds"] >= 6 * 3  # rebuilt as the text moved on
    if first_stage in ("skip1", "pair"):
        assert 0 < stages["retrieval"]["accepted"] < stages["retrieval"]["drafted"]
        assert stages[first_stage]["forwards"] > 0


def sampled_hierarchy():
    """A 5-token vocabulary, sharp distributions, a noisy draft over a 7-position streaming cache
    and the target over a 10-position retrieval cache of a 24-token prompt: (target, draft,
    prompt, settings)."""
    target = tiny_llama(7, vocab_size=5, weight_scale=20.0)
    draft = noisy_copy(7, 0.5, vocab_size=5, weight_scale=20.0)
    prompt = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 0, 2, 4, 1, 3, 1, 1, 0, 3, 3, 2, 4, 0, 1]
    settings = TriforceSettings(draft="pair", gamma1=2, gamma2=3, budget=10, chunk_size=2, recent=4,
                                stride=2, sinks=1, window=6)
    return target, draft, prompt, settings


@pytest.mark.slow
def test_sampled_triforce_samples_from_the_target(params=SamplingParams(temperature=0.7, top_p=0.9)):
    """Three different models in the chain (a noisy draft over a streaming cache, the target over
    a 10-position retrieval cache of a 24-token prompt, the target over everything): the first
    four tokens follow the target's exact sequence distribution."""
    target, draft, prompt, settings = sampled_hierarchy()
    exact = exact_sequence_probs(target, prompt, params, 4)
    counts = torch.zeros_like(exact)
    totals = {"final drafted": 0, "final accepted": 0, "middle drafted": 0, "middle accepted": 0}
    for sample in range(2000):
        run_params = SamplingParams(params.temperature, params.top_k, params.top_p, seed=sample)
        decoder = triforce_decoder(target, settings, draft, prefill_chunk=PREFILL_CHUNK)
        tokens, steps = run(target, prompt, "triforce", run_params, 4, decoder)
        counts[tuple(tokens)] += 1
        totals["final drafted"] += sum(s.drafted for s in steps)
        totals["final accepted"] += sum(s.accepted for s in steps)
        middle = decoder.stage_counts()["retrieval"]
        totals["middle drafted"] += middle["drafted"]
        totals["middle accepted"] += middle["accepted"]
    # Both verifications rejected often enough for their residual paths to matter.
    assert 0.1 * totals["final drafted"] < totals["final accepted"] < 0.95 * totals["final drafted"], totals
    assert 0.1 * totals["middle drafted"] < totals["middle accepted"] < 0.9 * totals["middle drafted"], totals
    assert chi_square_p_value(counts, exact) > 1e-3


# Root with 3 children; the first has 2 children, the second 1; depth 3 on the first branch.
TREE = Tree((-1, 0, 0, 0, 1, 1, 2, 4))


def test_greedy_triforce_with_a_final_tree_equals_greedy_plain():
    final_drafted = final_accepted = deeper = 0
    for seed in range(3):
        target = tiny_llama(seed, weight_scale=8.0)
        for name, prompt in prompts(seed).items():
            plain, _ = run(target, prompt, "plain", SamplingParams(), 40)
            decoder = triforce_decoder(target, TriforceSettings(tree=TREE, **SMALL), prefill_chunk=PREFILL_CHUNK)
            speculative, steps = run(target, prompt, "triforce", SamplingParams(), 40, decoder)
            assert speculative == plain, (seed, name)
            final_drafted += sum(s.drafted for s in steps)
            final_accepted += sum(s.accepted for s in steps)
            deeper += sum(s.accepted >= 2 for s in steps)
            assert decoder.stage_counts()["retrieval"]["builds"] == len(steps) - 1  # every step after the prefill
    assert 0 < final_accepted < final_drafted and deeper > 0


@pytest.mark.slow
def test_sampled_triforce_with_a_final_tree_samples_from_the_target():
    """The retrieval stage (10 of 24 positions) grows the tree by sampling without replacement;
    the full cache verifies it: the first four tokens follow the target's exact distribution."""
    params = SamplingParams(temperature=0.8)
    target = tiny_llama(7, vocab_size=5, weight_scale=20.0)
    prompt = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 0, 2, 4, 1, 3, 1, 1, 0, 3, 3, 2, 4, 0, 1]
    settings = TriforceSettings(tree=TREE, budget=10, chunk_size=2, recent=4)
    exact = exact_sequence_probs(target, prompt, params, 4)
    counts = torch.zeros_like(exact)
    drafted = accepted = 0
    for sample in range(1500):
        tokens, steps = run(target, prompt, "triforce", SamplingParams(0.8, seed=sample), 4,
                            triforce_decoder(target, settings, prefill_chunk=PREFILL_CHUNK))
        counts[tuple(tokens)] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert 0.1 * drafted < accepted < 0.9 * drafted
    assert chi_square_p_value(counts, exact) > 1e-3


def test_a_pair_draft_reads_the_prompt_in_the_prefill_and_a_follow_up_only_its_new_tokens():
    """Issue 38: the pair draft read a 128K prompt at the first draft (6-8 s counted as decode)
    and again at every follow-up. It now reads beside the target's prefill chunks, and keeps its
    reading (`KeptReading`) for the next answer, whose prompt extends the conversation: greedy
    output stays plain's, and the follow-up's draft reads only the tokens after the first turn."""
    from specchat.core.speculative.hierarchy import KeptReading

    target, pair = tiny_llama(3, weight_scale=8.0), noisy_copy(3, 0.3, weight_scale=8.0)
    read = []  # tokens per draft forward
    forward = pair.forward
    pair.forward = lambda ids, *args, **kwargs: read.append(len(ids)) or forward(ids, *args, **kwargs)
    kept = KeptReading()

    def answer(prompt):
        """(the greedy answer, the tokens the draft read in the prefill, the decoder)."""
        read.clear()
        decoder = triforce_decoder(target, TriforceSettings(draft="pair", **SMALL), pair, prefill_chunk=16, kept=kept)
        ids = torch.tensor(prompt)
        state = DecodeState(target, target.new_cache(), ids, SamplingParams(), make_generator(None))
        first_logits = prefill_all(target, state.cache, ids, 16, decoder)
        in_prefill = list(read)
        return [t for s in decode(state, decoder, first_logits, 24) for t in s.tokens], in_prefill, decoder

    first = prompts(3)["n-gram hits"]
    answered, in_prefill, decoder = answer(first)
    assert answered == run(target, first, "plain", SamplingParams(), 24)[0]
    assert sum(in_prefill) == len(first) - 1 and max(in_prefill) == 16  # in the prefill's chunks
    assert decoder.stage_counts()["pair"]["forwards"] == len(read) - len(in_prefill)  # the drafts only
    follow_up = first + answered + prompts(4)["no n-gram hits"][:20]
    answered_again, in_prefill, _ = answer(follow_up)
    assert answered_again == run(target, follow_up, "plain", SamplingParams(), 24)[0]
    assert 20 <= sum(in_prefill) <= len(answered) + 19  # the new turn and the answer's last drafted-over tokens


def test_a_retrieval_stage_behind_the_full_cache_drafts_nothing_instead_of_failing():
    """DSI drafts from its own thread while plain steps extend the full cache: the retrieval stage
    was built past the text it drafted from and failed ("a retrieval cache built at 25 cannot roll
    back to 24", one clean-clone CI run). It now drafts nothing until the text catches up."""
    target = tiny_llama(0, weight_scale=8.0)
    prompt = torch.tensor(prompts(0)["n-gram hits"])
    decoder = triforce_decoder(target, TriforceSettings(draft="lookup", **SMALL), None, prefill_chunk=16)
    state = DecodeState(target, target.new_cache(), prompt, SamplingParams(), make_generator(None))
    prefill_all(target, state.cache, prompt, chunk_size=16, decoder=decoder)  # the prompt's KV, all of it
    stage = decoder.drafter
    # The text the drafting thread read before a step committed a token whose KV is now in the
    # full cache (which holds every committed token but the last).
    assert stage.draft(state, prompt, 4) is None
    caught_up = torch.cat([prompt, prompt[:1]])
    assert stage.draft(state, caught_up, 4) is not None

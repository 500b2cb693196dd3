"""Decoding on tiny random models: chain speculation is lossless against plain decoding."""

import itertools

import pytest
import torch

from specchat.core.exact_outcomes import chi_square_p_value
from conftest import tiny_llama
from specchat.core.decoding import ChainDecoder, decode, make_decoder, prefill_all
from specchat.core.speculative.types import DecodeState
from specchat.core.speculative.drafters import PromptLookupDrafter
from specchat.core.speculative.lookahead import CostModelLookahead, FixedLookahead
from specchat.core.sampling import SamplingParams, make_generator, warp


def run(model, prompt, mode, params, max_new_tokens, decoder=None):
    """Token ids generated and the steps that produced them."""
    ids = torch.tensor(prompt)
    state = DecodeState(model, model.new_cache(), ids, params, make_generator(params.seed))
    decoder = decoder or make_decoder(mode)
    first_logits = prefill_all(model, state.cache, ids, chunk_size=16, decoder=decoder)
    steps = list(decode(state, decoder, first_logits, max_new_tokens))
    assert state.cache.length == state.ids.shape[0] - 1  # the cache holds all but the last token
    return [t for s in steps for t in s.tokens], steps


def prompts(seed):
    generator = torch.Generator().manual_seed(seed)
    no_repeats = torch.randperm(97, generator=generator)[:40].tolist()
    phrase = torch.randint(0, 97, (12,), generator=generator).tolist()
    noise = torch.randint(0, 97, (30,), generator=generator).tolist()
    with_repeats = phrase + noise + phrase + noise[:10] + phrase[:6]
    return {"no n-gram hits": no_repeats, "n-gram hits": with_repeats}


def assert_greedy_identity(models, make_decoder, max_new_tokens):
    """For each (seed, target) and each test prompt, speculative greedy output == plain greedy
    output, token for token; and both verification branches ran (some drafts accepted, some
    rejected), so the test exercised rollback."""
    drafted = accepted = 0
    for seed, model in models:
        for name, prompt in prompts(seed).items():
            plain, _ = run(model, prompt, "plain", SamplingParams(), max_new_tokens)
            speculative, steps = run(model, prompt, "speculative", SamplingParams(), max_new_tokens,
                                     make_decoder(seed, model))
            assert speculative == plain, (seed, name)
            drafted += sum(s.drafted for s in steps)
            accepted += sum(s.accepted for s in steps)
    assert 0 < accepted < drafted


def test_greedy_chain_equals_greedy_plain():
    assert_greedy_identity([(seed, tiny_llama(seed)) for seed in range(4)],
                           lambda seed, model: make_decoder("chain"), 60)


def test_plain_commits_one_token_per_forward():
    model = tiny_llama(0)
    tokens, steps = run(model, prompts(0)["n-gram hits"], "plain", SamplingParams(), 20)
    assert len(tokens) == len(steps) == 20


def test_chain_never_exceeds_the_token_budget():
    model = tiny_llama(1)
    for budget in (1, 2, 3, 7):
        tokens, _ = run(model, prompts(1)["n-gram hits"], "chain", SamplingParams(), budget)
        assert len(tokens) == budget


def exact_sequence_probs(model, prompt, params, length):
    """P(y_1..y_length | prompt) for every sequence, by running the model on each prefix."""
    vocab = model.vocab_size
    probs = torch.zeros((vocab,) * length, dtype=torch.float64)
    for prefix in itertools.product(range(vocab), repeat=length - 1):
        cache = model.new_cache()
        ids = torch.tensor(prompt + list(prefix))
        logits = model.forward(ids, torch.arange(len(ids)), cache)
        rows = warp(logits[len(prompt) - 1:], params).double()  # [length, vocab]
        head = torch.prod(torch.stack([rows[i, t] for i, t in enumerate(prefix)])) if prefix else 1.0
        probs[prefix] = head * rows[-1]
    return probs


def adaptive_lookahead():
    """The cost model with a verification cost that makes its choice move with acceptance."""
    return CostModelLookahead(lambda n, context: 1 + 0.1 * (n - 1), cap=3)


@pytest.mark.slow
@pytest.mark.parametrize("params, lookahead", [
    (SamplingParams(temperature=1.0), lambda: FixedLookahead(3)),
    (SamplingParams(temperature=0.6, top_p=0.9), lambda: FixedLookahead(3)),
    (SamplingParams(temperature=1.0), adaptive_lookahead)], ids=["T1", "T0.6-p0.9", "T1-adaptive"])
def test_sampled_chain_speculation_samples_from_the_target(params, lookahead):
    """End to end through the model, cache rollback and verification: the first four tokens
    of sampled chain decoding follow the target's exact sequence distribution. The prompt
    repeats and unigram matches are allowed, so prompt lookup drafts at every step after the
    first, and drafts are both accepted and rejected. With the cost model the draft length
    follows acceptance from step to step: only proposals change, so the law must not."""
    model = tiny_llama(7, vocab_size=5, weight_scale=20.0)
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    exact = exact_sequence_probs(model, prompt, params, 4)
    counts = torch.zeros_like(exact)
    partial = 0  # steps that drafted several tokens and accepted some but not all: a real rollback
    lengths = set()  # draft lengths verified
    drafted = accepted = 0
    samples = 2500
    for sample in range(samples):
        run_params = SamplingParams(params.temperature, params.top_k, params.top_p, seed=sample)
        decoder = ChainDecoder(PromptLookupDrafter(max_ngram=2, min_ngram=1), lookahead())
        tokens, steps = run(model, prompt, "chain", run_params, 4, decoder)
        counts[tuple(tokens)] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
        partial += sum(0 < s.accepted < s.drafted for s in steps)
        lengths.update(s.drafted for s in steps if s.drafted)
    assert drafted >= samples and 0.1 * drafted < accepted < 0.9 * drafted
    assert partial > 100 or len(lengths) >= 3  # rollbacks, or (cost model) lengths moving with acceptance
    assert chi_square_p_value(counts, exact) > 1e-3


def test_chain_verification_keeps_the_users_top_p():
    """One ChainDecoder step after the prompt, then another until two tokens are committed: the
    two follow the target's exact law at temperature 0.6 and top-p 0.7. Verifying against P
    without top-p emits tokens outside the nucleus (a mutation audit: only the slow tests caught
    it). Prompt lookup drafts two tokens a step; some are accepted, most rejected."""
    params = SamplingParams(temperature=0.6, top_p=0.7)
    model = tiny_llama(0, vocab_size=4, weight_scale=4.0)
    prompt = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    exact = exact_sequence_probs(model, prompt.tolist(), params, 2)
    read = model.new_cache()
    prefill_all(model, read, prompt[:-1], chunk_size=16)  # a step's cache: all but the last token
    generator = make_generator(0)
    counts = torch.zeros_like(exact)
    drafted = accepted = 0
    # 500 pairs: without top-p the first token leaves the nucleus with probability 0.23, and all
    # 500 stay in it with probability < 1e-57 (an impossible outcome gives a p-value of 0); a
    # correct decoder's p-value falls below 1e-6 with probability 1e-6.
    for _ in range(500):
        state = DecodeState(model, read.clone_prefix(read.length), prompt, params, generator)
        decoder = ChainDecoder(PromptLookupDrafter(max_ngram=2, min_ngram=1), FixedLookahead(2))
        while state.ids.shape[0] < prompt.shape[0] + 2:
            step = decoder.step(state, 3)
            drafted += step.drafted
            accepted += step.accepted
        counts[tuple(state.ids[prompt.shape[0]:prompt.shape[0] + 2].tolist())] += 1
    assert 0.1 * drafted < accepted < 0.9 * drafted
    assert chi_square_p_value(counts, exact) > 1e-6

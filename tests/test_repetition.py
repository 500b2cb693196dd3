"""Repetition controls: penalties that are part of the target's distribution at every position
(so every decoding mode stays exact with them on), and the guard that ends a looping answer."""

import itertools
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from conftest import tiny_llama
from specchat.app.api import ApiError, _parse
from specchat.app.chat_view import Settings
from specchat.app.conversation import ending_mark
from specchat.app.presets import PRESETS
from specchat.app.session import cut_off_note, sampling_params
from specchat.core.acceptance import calibration_sequences, measure_acceptance
from specchat.core.decoding import (ChainDecoder, TreeDecoder, TriforceSettings, decode, make_decoder, prefill_all,
                                   triforce_decoder)
from specchat.core.engine import Engine, Finished
from specchat.core.repeats import RepeatGuard, repeat_end
from specchat.core.request import Request
from specchat.core.sampling import (SamplingParams, apply_penalties, chain_counts, make_generator, path_counts,
                                    token_counts, warp)
from specchat.core.exact_outcomes import chi_square_p_value
from specchat.core.speculative.drafters import PromptLookupDrafter
from specchat.core.speculative.dsi.orchestrator import DsiDecoder
from specchat.core.speculative.hierarchy import ModelDrafter
from specchat.core.speculative.lookahead import FixedLookahead
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.suffix_drafter import SuffixDrafter
from specchat.core.speculative.tree_drafters import ModelTreeDrafter
from specchat.core.speculative.types import DecodeState
from test_decoding import prompts, run
from test_dsi import PREFILL_CHUNK, instances, run_dsi
from test_hierarchy import SMALL
from test_tree_decoding import TEMPLATE, noisy_copy

# All three at once, strong enough to change a tiny model's greedy text.
PENALIZED = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
# Milder, for prompt-lookup trees: the tiny models' text then still repeats enough to be drafted.
MILD = SamplingParams(repetition_penalty=1.1)


def reference_penalties(logits, counts, params):
    """The penalties one element at a time, as HF (repetition) and OpenAI (the other two) word them."""
    out = logits.clone()
    for index in itertools.product(*map(range, logits.shape)):
        value, count = float(logits[index]), float(counts[index])
        if count > 0:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        out[index] = value - params.frequency_penalty * count - params.presence_penalty * (count > 0)
    return out


def test_penalties_match_the_reference_and_neutral_values_change_nothing():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=generator) * 3
    counts = torch.randint(0, 3, (4, 30), generator=generator).float()
    for params in (PENALIZED, SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0),
                   SamplingParams(frequency_penalty=2.0)):
        assert torch.allclose(apply_penalties(logits, counts, params), reference_penalties(logits, counts, params))
    neutral = SamplingParams(temperature=0.7, top_p=0.9)
    assert torch.equal(apply_penalties(logits, counts, neutral), logits)
    assert torch.equal(warp(logits, neutral, counts), warp(logits, neutral))  # counts unused: the same bits
    with pytest.raises(ValueError, match="counts"):
        warp(logits, PENALIZED)  # a place that forgot the counts fails loudly, never silently unpenalized


def test_counts_give_each_row_its_own_prefix():
    vocab, answer = 9, torch.tensor([3, 3, 5])
    base = token_counts(answer, vocab)
    assert base.tolist() == [0, 0, 0, 2, 0, 1, 0, 0, 0]
    draft = torch.tensor([5, 1, 5])
    expected = [token_counts(torch.cat([answer, draft[:i]]), vocab) for i in range(4)]
    assert torch.equal(chain_counts(base, draft), torch.stack(expected))
    tree = Tree((-1, 0, 0, 1, 3))  # the root (committed), two children, a chain of two below the first
    tokens = torch.tensor([3, 7, 8, 7, 2])  # a path may repeat a token: node 3 repeats node 1
    rows = path_counts(base, tokens, tree.ancestors)
    for node in range(tree.size):
        path = tokens[tree.path_to(node)]
        assert torch.equal(rows[node], token_counts(torch.cat([answer, path]), vocab)), node
    assert torch.equal(path_counts(base, tokens, tree.ancestors[[2, 4]]), rows[[2, 4]])


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
                                    dict(repetition_penalty=2.5), dict(repetition_penalty=float("nan")),
                                    dict(frequency_penalty=2.1), dict(presence_penalty=-3.0),
                                    dict(presence_penalty=float("inf"))])
def test_invalid_penalties_are_refused(kwargs):
    with pytest.raises(ValueError, match="penalty must be"):
        SamplingParams(**kwargs)


def assert_identity_with_penalties(models, decoder_for, max_new_tokens, runner, params=PENALIZED):
    """Speculative greedy == plain greedy with the penalties on, for each (seed, target) and test
    prompt; the penalties changed the text (so the check could fail), drafts were accepted and
    rejected."""
    drafted = accepted = changed = 0
    for seed, model in models:
        for name, prompt in prompts(seed).items():
            plain, _ = run(model, prompt, "plain", params, max_new_tokens)
            unpenalized, _ = run(model, prompt, "plain", SamplingParams(), max_new_tokens)
            speculative, steps = runner(model, prompt, params, max_new_tokens, decoder_for(seed, model))
            assert speculative == plain, (seed, name)
            changed += plain != unpenalized
            drafted += sum(s.drafted for s in steps)
            accepted += sum(s.accepted for s in steps)
    assert changed >= len(models)
    assert 0 < accepted < drafted


def speculative_run(model, prompt, params, max_new_tokens, decoder):
    return run(model, prompt, "speculative", params, max_new_tokens, decoder)


def test_greedy_chain_with_penalties_equals_plain():
    assert_identity_with_penalties([(seed, tiny_llama(seed)) for seed in range(3)],
                                   lambda seed, model: make_decoder("chain"), 40, speculative_run)


def test_greedy_tree_with_penalties_equals_plain():
    models = [(seed, tiny_llama(seed, weight_scale=8.0)) for seed in range(2)]
    assert_identity_with_penalties(
        models, lambda seed, model: TreeDecoder(ModelTreeDrafter(noisy_copy(seed, 0.3, weight_scale=8.0), TEMPLATE)),
        40, speculative_run)
    assert_identity_with_penalties(
        models, lambda seed, model: TreeDecoder(SuffixDrafter()),
        40, speculative_run, MILD)


def test_greedy_triforce_with_penalties_equals_plain():
    """Prompt lookup, then the target over a retrieval cache, then the full cache; and the
    retrieval stage growing a tree for the full cache."""
    models = [(seed, tiny_llama(seed, weight_scale=8.0)) for seed in range(2)]
    assert_identity_with_penalties(
        models, lambda seed, model: triforce_decoder(model, TriforceSettings(draft="lookup", **SMALL),
                                                     prefill_chunk=16), 40, speculative_run)
    assert_identity_with_penalties(
        models[:1], lambda seed, model: triforce_decoder(model, TriforceSettings(tree=TEMPLATE, **SMALL),
                                                         prefill_chunk=PREFILL_CHUNK), 40, speculative_run)


def test_greedy_dsi_with_penalties_equals_plain():
    """Tasks of four drafts each (a fixed lookahead, no task before its block): a verdict's rows
    after accepted drafts are penalized for them, each for its own prefix."""
    pools, longest = [], []

    def decoder_for(seed, model):
        pools.append(instances(model, 2, jitter=0.005))
        drafter = ModelDrafter(noisy_copy(seed, 0.3, weight_scale=8.0), 2, 16, False, "pair", PREFILL_CHUNK)
        decoder = DsiDecoder(drafter, pools[-1], plain_steps=False)
        decoder.policy.lookahead, decoder.policy.plain_task = (lambda: 4), (lambda: False)
        return decoder

    def dsi_run(model, prompt, params, max_new_tokens, decoder):
        tokens, steps = run_dsi(model, prompt, params, max_new_tokens, decoder)
        longest.append(max(s.accepted for s in steps))
        return tokens, steps

    try:
        assert_identity_with_penalties([(seed, tiny_llama(seed, weight_scale=8.0)) for seed in range(2)],
                                       decoder_for, 40, dsi_run)
    finally:
        for pool in pools:
            pool.close()
    assert max(longest) >= 2  # a verdict used rows after two accepted drafts


def test_acceptance_is_measured_on_the_penalized_distributions():
    """Greedy, width 2, a draft near the target, on penalized calibration text: the rank-k child
    (the draft's k-th best after the penalties) is accepted where it is the target's penalized
    choice, each context counting the continuation before it, counted here by hand."""
    target, draft = tiny_llama(0, weight_scale=8.0), noisy_copy(0, 0.5, weight_scale=8.0)
    prompt = torch.tensor(prompts(0)["n-gram hits"])
    sequence = calibration_sequences(target, [prompt], PENALIZED, make_generator(0), 40)[0]

    def expected(params):
        accepted = [0, 0]
        for end in range(len(prompt), len(sequence)):
            counts = torch.zeros(target.vocab_size)
            for token in sequence[len(prompt):end].tolist():
                counts[token] += 1
            context = sequence[:end]
            rows = [model.forward(context, torch.arange(end), model.new_cache())[-1] for model in (target, draft)]
            if params.penalized:
                rows = [apply_penalties(row, counts, params) for row in rows]
            chosen, children = int(rows[0].argmax()), rows[1].topk(2).indices.tolist()
            if chosen in children:
                accepted[children.index(chosen)] += 1
        return tuple(accepted)

    vector = measure_acceptance(target, draft, [sequence], [len(prompt)], PENALIZED, 2, make_generator(0))
    assert vector.positions == 40 and vector.accepted == expected(PENALIZED) != expected(SamplingParams())


# --- sampled: the law of the first three tokens against the exact processed target -------------

SAMPLED = SamplingParams(temperature=0.9, repetition_penalty=1.8, presence_penalty=1.0)
PROMPT = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def exact_penalized(model, prompt, params, length):
    """P(y_1..y_length | prompt) for every sequence, each position penalized for the answer's
    tokens before it (counted here by hand, not by the functions under test)."""
    vocab = model.vocab_size
    probs = torch.zeros((vocab,) * length, dtype=torch.float64)
    for prefix in itertools.product(range(vocab), repeat=length - 1):
        ids = torch.tensor(prompt + list(prefix))
        logits = model.forward(ids, torch.arange(len(ids)), model.new_cache())[len(prompt) - 1:]
        counts = torch.zeros(length, vocab)
        for row in range(length):
            for token in prefix[:row]:
                counts[row, token] += 1
        rows = warp(logits, params, counts).double()
        head = torch.prod(torch.stack([rows[i, t] for i, t in enumerate(prefix)])) if prefix else 1.0
        probs[prefix] = head * rows[-1]
    return probs


def assert_samples_the_penalized_target(decoder, samples):
    """Sampled decoding of three tokens, `samples` times, with `decoder` (reused: each run starts
    from a copy of the prompt's cache) against the exact penalized law; a draft is verified at the
    second token, and its accepted path's row gives the third (the bonus), penalized for it."""
    target = tiny_llama(7, vocab_size=5, weight_scale=20.0)
    exact = exact_penalized(target, PROMPT, SAMPLED, 3)
    ids, prompt_cache = torch.tensor(PROMPT), target.new_cache()
    first_logits = prefill_all(target, prompt_cache, ids, chunk_size=16)
    counts = torch.zeros_like(exact)
    drafted = accepted = 0
    for seed in range(samples):
        state = DecodeState(target, prompt_cache.clone_prefix(len(PROMPT)), ids, replace(SAMPLED, seed=seed),
                            make_generator(seed))
        steps = list(decode(state, decoder(target), first_logits, 3))
        counts[tuple(state.ids[len(PROMPT):].tolist())] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert 0.1 * drafted < accepted < 0.9 * drafted and drafted >= samples
    assert chi_square_p_value(counts, exact) > 1e-3
    # The penalties matter here: the same samples are far from the unpenalized law.
    unpenalized = exact_penalized(target, PROMPT, SamplingParams(temperature=SAMPLED.temperature), 3)
    assert chi_square_p_value(counts, unpenalized) < 1e-6


def test_sampled_chain_with_penalties_samples_the_penalized_target():
    lookup = ChainDecoder(PromptLookupDrafter(max_ngram=2, min_ngram=1), FixedLookahead(2))
    assert_samples_the_penalized_target(lambda target: lookup, 1000)


def test_sampled_tree_with_penalties_samples_the_penalized_target():
    """The draft's children at the root are drawn from its penalized Q, each verified against the
    target's row for its own path."""
    drafter = ModelTreeDrafter(noisy_copy(7, 0.5, vocab_size=5, weight_scale=20.0), TEMPLATE)
    assert_samples_the_penalized_target(lambda target: TreeDecoder(drafter), 1000)


# --- the repeat guard -----------------------------------------------------------------------------

def test_the_guard_stops_a_loop_at_its_third_run():
    intro, sentence = list(range(100, 130)), list(range(200, 215))  # a 15-token sentence, then a loop
    looping = intro + sentence * 5
    # The 12 tokens ending 12 into a repeat occur for the third time, none overlapping, 30 tokens on.
    assert repeat_end(looping) == len(intro) + 2 * len(sentence) + 12
    assert repeat_end([7] * 40) == 36  # a run of one token: 3 x 12, not 12 + 2
    guard = RepeatGuard()
    assert guard.feed(looping[:50]) is None and guard.feed(looping[50:]) == len(intro) + 42 - 50


def test_the_guard_lets_ordinary_repetition_through():
    phrase = list(range(300, 311))  # an 11-token set phrase, many times over
    text = []
    for index in range(6):
        text += phrase + list(range(400 + 10 * index, 405 + 10 * index))
    sentence = list(range(500, 520))
    assert repeat_end(text) is None
    assert repeat_end(text + sentence + [1, 2] + sentence) is None  # a 20-token sentence twice
    assert repeat_end(text + sentence + sentence + sentence) is not None


def test_the_guard_is_marked_where_the_app_marks_an_ending():
    assert ending_mark({"finish_reason": "repeating"}) == "*(stopped: repeating itself)*"

    class Result:
        finish_reason, context_full = "repeating", False

    assert cut_off_note(Result()) == ", stopped: repeating itself"


# --- reach: the API, the CLI's arguments, the presets ---------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("repetition_penalty", 0, "in (0, 2]"), ("repetition_penalty", 2.5, "in (0, 2]"),
    ("repetition_penalty", "high", "a number"), ("frequency_penalty", -2.5, "in [-2, 2]"),
    ("frequency_penalty", 3, "in [-2, 2]"), ("presence_penalty", True, "a number"),
    ("presence_penalty", 2.01, "in [-2, 2]")])
def test_the_api_refuses_bad_penalties(field, value, words):
    with pytest.raises(ApiError) as refused:
        _parse({"messages": [{"role": "user", "content": "hi"}], field: value}, "m")
    assert refused.value.status == 400 and refused.value.param == field and words in str(refused.value)


def test_the_api_and_the_cli_arguments_pass_the_penalties_on():
    body = {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.2, "frequency_penalty": -0.5,
            "presence_penalty": 1}
    sampling = _parse(body, "m").sampling
    assert (sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty) == (1.2, -0.5, 1.0)
    assert not _parse({"messages": body["messages"]}, "m").sampling.penalized

    class Args:
        temperature, top_k, top_p, seed = 0.0, 0, 1.0, None

    assert sampling_params(Args()) == SamplingParams()  # a subcommand without the options: all off
    Args.repetition_penalty, Args.presence_penalty = 1.1, 0.5
    assert sampling_params(Args()) == SamplingParams(repetition_penalty=1.1, presence_penalty=0.5)


def test_the_document_presets_penalize_and_every_preset_guards():
    assert all(preset.stop_repeats for preset in PRESETS.values())
    assert PRESETS["summarize"].sampling(seed=3).penalized and PRESETS["answer"].sampling().penalized
    assert PRESETS["summarize"].sampling(seed=3).seed == 3
    # The page's Settings: the slider's penalty, the preset's guard.
    page = Settings(system="", preset="summarize", temperature=0.7, top_p=0.9, top_k=0, seed="", max_new_tokens=64,
                    mode="auto", repetition_penalty=1.25)
    assert (page.sampling().repetition_penalty, page.sampling().stop_repeats) == (1.25, True)


def test_the_engine_stops_a_looping_answer_at_the_same_token_in_every_mode(embedded_dir):
    """Tiny random models whose greedy text loops: chain steps commit several tokens at a time,
    yet each answer ends at the token the guard names in the unguarded text, as plain decoding's
    does (checking only after each step would overshoot)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)  # decodes the tiny vocabulary's ids
    accepted = 0
    for seed in (1, 3):
        engine = Engine(tiny_llama(seed, weight_scale=8.0), tokenizer, "tiny")
        for prompt in prompts(seed).values():
            def answer(mode, params):
                return next(event.result for event in engine.generate(prompt, Request(120, params, mode))
                            if isinstance(event, Finished))

            unguarded = answer("plain", SamplingParams())
            end = repeat_end(unguarded.token_ids)
            assert end is not None and end < unguarded.new_tokens
            for mode in ("plain", "chain"):
                guarded = answer(mode, SamplingParams(stop_repeats=True))
                assert guarded.finish_reason == "repeating" and guarded.token_ids == unguarded.token_ids[:end]
                accepted += guarded.stats.accepted_draft_tokens
    assert accepted > 0  # chain steps committed drafts

"""Suffix drafting: the index against brute force, the drafter's chains and trees, and decoding
through it lossless against plain decoding on tiny random models."""

import random
from collections import Counter

import pytest
import torch

from conftest import tiny_llama
from specchat.core.decoding import ChainDecoder, TreeDecoder
from specchat.core.sampling import SamplingParams, make_generator
from specchat.core.exact_outcomes import chi_square_p_value
from specchat.core.speculative.drafters import PromptLookupDrafter
from specchat.core.speculative.lookahead import FixedLookahead
from specchat.core.speculative.suffix_drafter import AnswerHistory, SuffixDrafter
from specchat.core.speculative.suffix_index import LEVELS, MAX_MATCH, MAX_OCCURRENCES, SEPARATOR, SuffixIndex
from specchat.core.speculative.types import DecodeState
from test_decoding import assert_greedy_identity, exact_sequence_probs, prompts, run


def texts():
    """Random texts over small vocabularies, and repetitive ones (periods, quoted spans)."""
    rng = random.Random(0)
    for _ in range(40):
        yield [rng.randrange(rng.choice((6, 12, 40))) for _ in range(rng.randrange(2, 150))]
    for period in (1, 3, 7):
        yield [t % period for t in range(90)] + [rng.randrange(9) for _ in range(5)] + [t % period for t in range(9)]
    for _ in range(10):
        text = [rng.randrange(50) for _ in range(60)]
        for _ in range(4):
            start = rng.randrange(len(text) - 10)
            text += text[start:start + rng.randrange(3, 70)] + [rng.randrange(50)]
        yield text


def longest_earlier_match(text, query):
    """Brute force: the longest suffix of `query` (up to MAX_MATCH) that ends in `text` before
    its last token."""
    best = 0
    for end in range(len(text) - 1):
        length = 0
        while length < min(MAX_MATCH, len(query), end + 1) and text[end - length] == query[-1 - length]:
            length += 1
        best = max(best, length)
    return best


def reference_match(text, query):
    """What the index promises: the latest MAX_OCCURRENCES occurrences of the query's top-level
    n-gram, and the longest match among them."""
    longest = longest_earlier_match(text, query)
    if not longest:
        return 0, []
    level = max(level for level in LEVELS if level <= longest)
    ends = [end for end in range(len(text) - 2, level - 2, -1) if text[end + 1 - level:end + 1] == query[-level:]]
    ends = ends[:MAX_OCCURRENCES]
    length = max(min(MAX_MATCH, len(query), _common_suffix(text[:end + 1], query)) for end in ends)
    return length, ends


def _common_suffix(a, b):
    length = 0
    while length < min(len(a), len(b)) and a[-1 - length] == b[-1 - length]:
        length += 1
    return length


def test_index_matches_brute_force_on_random_and_repetitive_texts():
    for text in texts():
        index = SuffixIndex(text)
        for query in (text, text[:-1] + [text[0]], [7, 7, 7]):
            match = index.match(query)
            longest = longest_earlier_match(text, query)
            assert (match.length, match.ends) == reference_match(text, query), text
            assert match.length <= longest < 2 * max([level for level in LEVELS if level <= match.length] or [0.5])
            if len(match.ends) < MAX_OCCURRENCES:
                assert match.length == longest
            expected = Counter(text[end + 1] for end in match.ends)
            assert {token: len(ends) for token, ends in index.followers(match.ends).items()} == expected
            assert all(text[end] == token for token, ends in index.followers(match.ends).items() for end in ends)


def test_incremental_index_equals_one_built_at_once():
    rng = random.Random(1)
    for text in texts():
        grown, start = SuffixIndex(), 0
        while start < len(text):
            step = rng.randrange(1, 9)
            grown.extend(text[start:start + step])
            start += step
        whole = SuffixIndex(text)
        assert grown.tokens == whole.tokens and grown._ends == whole._ends
        assert (grown.match(text).length, grown.match(text).ends) == (whole.match(text).length, whole.match(text).ends)


def state_of(tokens, params=SamplingParams()):
    return DecodeState(None, None, torch.tensor(tokens), params, make_generator(0))


def test_trees_are_valid_and_their_first_path_is_the_most_frequent_continuation():
    for text in texts():
        if len(text) < 2:
            continue
        for budget, max_nodes in ((2, 8), (5, 16), (40, 32)):
            drafter = SuffixDrafter(max_nodes=max_nodes)
            state = state_of(text)
            drafter.prepare(state)
            proposal = drafter.propose_tree(state, budget)
            chain = drafter.draft(state, state.ids, 64)
            if proposal is None:
                continue
            tree, tokens = proposal.tree, proposal.tokens.tolist()
            assert proposal.q is None and tokens[0] == text[-1] and SEPARATOR not in tokens
            assert 1 < tree.size <= max_nodes and tree.depth <= budget - 1
            assert list(tree.depths) == sorted(tree.depths)  # breadth-first
            for children in tree.children:
                assert len({tokens[child] for child in children}) == len(children)
            first_path, node = [], 0
            while tree.children[node]:
                node = tree.children[node][0]
                first_path.append(tokens[node])
            assert chain is not None and chain.tokens.tolist()[:len(first_path)] == first_path


def test_most_frequent_continuation_first_and_rarer_branches_beside_it():
    # After "1": "2 3" twice, then the latest "2 4"; then "5" once, latest of all.
    state = state_of([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 5, 1])
    drafter = SuffixDrafter()
    assert drafter.draft(state, state.ids, 2).tokens.tolist() == [2, 3]
    proposal = drafter.propose_tree(state, 3)
    tokens = proposal.tokens.tolist()
    assert [tokens[child] for child in proposal.tree.children[0]] == [2, 5]
    assert [tokens[child] for child in proposal.tree.children[1]] == [3, 4]


def test_longest_match_beats_the_ngram_lookups_vote():
    rng = random.Random(2)
    span = [rng.randrange(100, 200) for _ in range(30)]
    decoy = span[10:14] + [7, 7, 7]  # span[10:14] occurs again, twice, followed by something else
    text = span + decoy + decoy + span[:14]
    lookup = PromptLookupDrafter().propose(torch.tensor(text), 8)
    state = state_of(text)
    proposal = SuffixDrafter().draft(state, state.ids, 8)
    assert lookup.tokens.tolist()[:3] == [7, 7, 7]  # the latest two occurrences outvote the first
    assert proposal.tokens.tolist() == span[14:22] and proposal.kind == 8  # 14 tokens matched


def test_drafts_wherever_prompt_lookup_does_and_as_far():
    for text in texts():
        for cut in range(2, len(text), 7):
            ids = torch.tensor(text[:cut])
            lookup = PromptLookupDrafter(min_ngram=1).propose(ids, 16)
            drafter = SuffixDrafter(min_probability=0.0)
            proposal = drafter.draft(state_of(text[:cut]), ids, 16)
            assert (lookup is None) == (proposal is None)
            if lookup is not None:
                assert drafter.index.match(text[:cut]).length >= lookup.kind


def test_the_index_follows_the_committed_text_and_rebuilds_for_a_new_conversation():
    drafter = SuffixDrafter()
    drafter.prepare(state_of([1, 2, 3, 4]))
    index = drafter.index
    drafter.prepare(state_of([1, 2, 3, 4, 5, 1, 2]))  # a follow-up: the same text, extended
    assert drafter.index is index and index.tokens == [1, 2, 3, 4, 5, 1, 2]
    drafter.prepare(state_of([9, 8, 9]))  # another conversation
    assert drafter.index.tokens == [9, 8, 9] and drafter.index._ends == SuffixIndex([9, 8, 9])._ends


def test_history_drafts_when_the_conversation_has_no_match_and_stays_bounded():
    history = AnswerHistory(max_tokens=40, max_answers=3)
    history.add([10, 11, 12, 13, 14])
    history.add([20, 21, 22])
    state = state_of([1, 2, 3, 10, 11])
    proposal = SuffixDrafter(history=history).draft(state, state.ids, 8)
    assert proposal.tokens.tolist() == [12, 13, 14] and proposal.kind == -2  # stops at the answer's end
    assert SuffixDrafter().draft(state, state.ids, 8) is None
    for start in range(0, 200, 10):
        history.add(range(start, start + 10))
        assert history.tokens_held <= 40 and len(history._answers) <= 3
    assert history.match([190, 191]).length == 2 and history.match([10, 11]).length == 0


def test_greedy_chain_with_suffix_drafts_equals_greedy_plain():
    assert_greedy_identity([(seed, tiny_llama(seed)) for seed in range(1)],
                           lambda seed, model: ChainDecoder(SuffixDrafter(), FixedLookahead(6)), 40)


def test_greedy_tree_with_suffix_drafts_equals_greedy_plain():
    assert_greedy_identity([(seed, tiny_llama(seed)) for seed in range(1)],
                           lambda seed, model: TreeDecoder(SuffixDrafter(min_probability=0.0)), 40)


def test_an_earlier_answer_in_the_history_is_drafted_whole_and_stays_lossless():
    model = tiny_llama(3)
    prompt = prompts(3)["no n-gram hits"]
    plain, _ = run(model, prompt, "plain", SamplingParams(), 30)
    history = AnswerHistory()
    history.add(plain)
    for decoder in (ChainDecoder(SuffixDrafter(history=history), FixedLookahead(8)),
                    TreeDecoder(SuffixDrafter(history=history))):
        again, steps = run(model, prompt, "speculative", SamplingParams(), 30, decoder)
        assert again == plain and len(steps) < 10


@pytest.mark.slow
def test_sampled_tree_with_suffix_drafts_samples_from_the_target():
    """Deterministic trees are verified as point masses: the first three tokens follow the
    target's exact sequence distribution."""
    model = tiny_llama(7, vocab_size=5, weight_scale=20.0)
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    params = SamplingParams(temperature=1.0)
    exact = exact_sequence_probs(model, prompt, params, 3)
    counts = torch.zeros_like(exact)
    drafted = accepted = 0
    for sample in range(600):
        decoder = TreeDecoder(SuffixDrafter(min_probability=0.0))
        tokens, steps = run(model, prompt, "tree", SamplingParams(1.0, seed=sample), 3, decoder)
        counts[tuple(tokens)] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert 0.1 * drafted < accepted < 0.9 * drafted
    assert chi_square_p_value(counts, exact) > 1e-3


def test_the_engine_keeps_its_answers_and_a_retry_in_tree_mode_drafts_the_earlier_one(tiny_model_dir):
    from transformers import AutoTokenizer

    from specchat.core.engine import Engine, Finished
    from specchat.core.kv.prefix_store import PrefixStore
    from specchat.core.model import TransformersLM
    from specchat.core.placement import LoadOptions
    from specchat.core.request import Request

    model = TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cpu", None, None))
    engine = Engine(model, AutoTokenizer.from_pretrained(tiny_model_dir), "tiny", prefixes=PrefixStore(0))
    prompt = engine.chat_ids([{"role": "user", "content": "Tell me something."}])

    def answer(mode):
        return next(e.result for e in engine.generate(prompt, Request(24, SamplingParams(), mode))
                    if isinstance(e, Finished))

    first = answer("plain")
    assert engine.answers.tokens_held == first.new_tokens
    again = answer("tree")
    assert again.token_ids == first.token_ids
    # The history held the whole answer: every draft accepted, a few forwards of a 16-node tree.
    assert again.stats.accepted_draft_tokens == again.stats.drafted_tokens >= first.new_tokens // 2
    assert again.stats.target_forwards <= 6  # plain took 24
    engine.answers.clear()
    assert engine.answers.tokens_held == 0

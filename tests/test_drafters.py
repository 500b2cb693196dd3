import torch

from specchat.core.speculative.drafters import PromptLookupDrafter, vote


def ids(*tokens):
    return torch.tensor(tokens)


def test_proposes_what_followed_the_latest_match():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=2)
    proposal = drafter.propose(ids(1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 7, 8, 1, 2, 3), max_tokens=2)
    assert proposal.tokens.tolist() == [6, 7]
    assert proposal.q is None  # deterministic: each draft's Q is the one-hot of its token


def test_longer_ngrams_win():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    # "2 3" last matched before 4; "1 2 3" only before 5.
    proposal = drafter.propose(ids(1, 2, 3, 5, 0, 2, 3, 4, 1, 2, 3), max_tokens=1)
    assert proposal.tokens.tolist() == [5]


def test_no_match_means_no_proposal():
    drafter = PromptLookupDrafter()
    assert drafter.propose(ids(1, 2, 3, 4, 5, 6), max_tokens=4) is None
    assert drafter.propose(ids(7), max_tokens=4) is None


def test_proposal_stops_at_the_end_of_the_text():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2)
    proposal = drafter.propose(ids(4, 5, 4, 5), max_tokens=8)  # "4 5" at 0 is followed by "4 5"
    assert proposal.tokens.tolist() == [4, 5]


def test_the_continuation_most_occurrences_go_on_with_wins():
    drafter = PromptLookupDrafter(max_ngram=1, min_ngram=1)
    # After "1": "2 3" twice, then the latest "2 4"; then "5" once, latest of all.
    proposal = drafter.propose(ids(1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 5, 1), max_tokens=2)
    assert proposal.tokens.tolist() == [2, 3]


def test_vote_follows_the_agreeing_continuations_and_breaks_ties_by_order():
    assert vote([[7, 8, 9], [7, 6], [5, 1], [7, 6, 2]]) == [7, 6, 2]
    assert vote([[4, 1], [5, 2]]) == [4, 1]
    assert vote([[3], [3, 9, 9]]) == [3, 9, 9]
    assert vote([]) == []

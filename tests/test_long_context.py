"""TriForce on the real embedded model over a 7.7K-token document with a needle in its middle:
greedy triforce equals plain, and the retrieval cache (1K positions) reads what the target needs
where a StreamingLLM cache of the same size does not."""

import pytest
import torch

from conftest import DATA
from specchat.core.decoding import TriforceSettings
from specchat.core.engine import Finished
from specchat.core.kv.retrieval import RetrievalCache
from specchat.core.kv.streaming import StreamingCache
from specchat.core.sampling import SamplingParams
from specchat.core.tree_choice import triforce_tree
from specchat.core.request import Request

PASSPHRASE = "violet kangaroo 7342"
BUDGET = 1024


def needle_prompt(engine) -> list[int]:
    document = (DATA / "gpl-3.0.txt").read_text()
    middle = document.find("\n\n", len(document) // 2)
    document = (document[:middle] + f'\n\nThe secret passphrase is "{PASSPHRASE}". Remember it.'
                + document[middle:])
    question = "What is the secret passphrase mentioned in the document above? Then summarize the document."
    return engine.chat_ids([{"role": "user", "content": f"{document}\n\n{question}"}])


def answer(engine, ids, mode, triforce=None):
    events = list(engine.generate(ids, Request(40, SamplingParams(), mode, triforce)))
    assert isinstance(events[-1], Finished)
    return events[-1].result


def next_token_predictions(model, full, ids, answer_ids, cache_for):
    """Teacher forcing along the target's own answer: at each position the argmax of the target
    over `cache_for(length, queries)` (a cache of the first `length` positions, chosen with the
    full verification's queries of the token before, as triforce decoding chooses it)."""
    predictions = []
    for i, token in enumerate([ids[-1]] + answer_ids[:-1]):
        length = len(ids) - 1 + i
        cache = cache_for(length, {layer: q[0, :, max(i - 1, 0)] for layer, q in full["queries"].items()})
        logits = model.forward(torch.tensor([token]), torch.tensor([length]), cache)
        predictions.append(int(logits[-1].argmax()))
    return predictions


@pytest.mark.slow
def test_triforce_and_the_retrieval_cache_on_a_7k_document_with_a_needle(embedded_engine):
    engine, model = embedded_engine, embedded_engine.model
    ids = needle_prompt(engine)
    assert 7000 < len(ids) < model.context_length - 64
    plain = answer(engine, ids, "plain")
    assert PASSPHRASE in plain.text  # the target itself recalls the needle
    triforce = answer(engine, ids, "triforce", TriforceSettings(draft="lookup", budget=BUDGET))  # reuses the prompt's KV from the plain answer
    assert triforce.token_ids == plain.token_ids
    stages = triforce.stats.stages["retrieval"]
    assert stages["builds"] >= 3 and stages["forwards"] > triforce.stats.target_forwards
    assert triforce.stats.target_forwards < plain.stats.target_forwards
    # `--triforce-verify tree`: the final verification checks the optimizer's Sequoia tree.
    tree = triforce_tree(engine.settings, len(ids))
    with_tree = answer(engine, ids, "triforce", TriforceSettings(draft="", budget=BUDGET, tree=tree))
    assert with_tree.token_ids == plain.token_ids
    assert with_tree.stats.tree_size == tree.size and with_tree.stats.stages["retrieval"]["builds"] >= 3

    # The full cache of the prompt and the answer, with the queries of every answer position.
    taken = engine.prefixes.take(ids + plain.token_ids + [0])
    cache = taken[0]
    cache.trim(len(ids) - 1)
    _, queries = model.forward_with_queries(torch.tensor([ids[-1]] + plain.token_ids[:-1]),
                                            torch.arange(len(ids) - 1, len(ids) - 1 + len(plain.token_ids)), cache)
    full = {"queries": queries}
    config = model.hf.config

    def retrieval(length, last_queries):
        return RetrievalCache.build(config, cache.layers(length), last_queries, BUDGET, 8, 64)

    def streaming(length, _):
        return StreamingCache.from_cache(config, cache, sinks=4, window=BUDGET - 4, length=length)

    by_retrieval = next_token_predictions(model, full, ids, plain.token_ids, retrieval)
    by_streaming = next_token_predictions(model, full, ids, plain.token_ids, streaming)
    agreement = sum(a == b for a, b in zip(by_retrieval, plain.token_ids)) / len(plain.token_ids)
    assert agreement >= 0.9, agreement

    # The needle: the answer's tokens from the passphrase's first token on.
    text_before = plain.text[:plain.text.index(PASSPHRASE)]
    first = next(i for i in range(len(plain.token_ids))
                 if len(engine.tokenizer.decode(plain.token_ids[:i + 1])) > len(text_before))
    needle = range(first, first + len(engine.tokenizer.encode(PASSPHRASE, add_special_tokens=False)))
    assert all(by_retrieval[i] == plain.token_ids[i] for i in needle)
    assert by_streaming[first] != plain.token_ids[first]  # the window never saw the passphrase

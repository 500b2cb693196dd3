"""A request is validated once, where it is made; the engine builds each mode's decoder from its
registry, with the request's options for that mode."""

import pytest
from conftest import tiny_llama

from specchat.core.decoding import ChainDecoder, PlainDecoder, TreeDecoder, TriforceSettings
from specchat.core.errors import InputError
from specchat.core.modes import MAX_DSI_WORKERS, MODES
from specchat.core.request import DsiOptions, Request, TreeDraft
from specchat.core.engine import Engine
from specchat.core.speculative.tree import Tree


@pytest.mark.parametrize("fields, message", [
    ({"mode": "fast"}, "unknown mode 'fast'"),
    ({"max_new_tokens": 0}, "at least 1"),
    ({"document_tokens": -1}, "cannot be negative"),
    ({"mode": "chain", "options": TriforceSettings()}, "TriforceSettings is for triforce mode, not chain"),
    ({"mode": "auto", "options": DsiOptions()}, "DsiOptions is for dsi mode, not auto"),
    ({"mode": "dsi", "options": "two workers"}, "unknown mode options str"),
])
def test_a_bad_request_fails_where_it_is_made(fields, message):
    with pytest.raises(InputError, match=message):
        Request(**fields)


def test_dsi_workers_are_checked_with_the_options():
    with pytest.raises(InputError, match=f"1 to {MAX_DSI_WORKERS} worker processes"):
        DsiOptions(workers=MAX_DSI_WORKERS + 1)


def test_triforce_stages_with_auto_apply_only_if_auto_is_triforce():
    settings = TriforceSettings(budget=512)
    request = Request(mode="auto", options=settings)
    assert request.options_for("triforce") is settings
    assert request.options_for("chain") is None


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """Built in memory: no loader for DSI's instances."""
    from transformers import AutoTokenizer

    return Engine(tiny_llama(2), AutoTokenizer.from_pretrained(tiny_model_dir), "tiny")


def test_every_mode_has_a_decoder_and_each_gets_its_options(engine):
    assert set(engine._decoders) == set(MODES)
    build = engine._decoders
    assert isinstance(build["plain"](None), PlainDecoder)
    assert isinstance(build["chain"](None), ChainDecoder)
    assert isinstance(build["tree"](None), TreeDecoder)
    drafted = build["tree"](TreeDraft(tiny_llama(1), Tree.chain(2)))
    assert isinstance(drafted, TreeDecoder) and drafted.drafter.__class__.__name__ == "ModelTreeDrafter"
    with pytest.raises(InputError, match="built in memory"):  # dsi needs a model loaded from disk
        build["dsi"](DsiOptions(workers=1))
    assert engine.dsi.answering is None

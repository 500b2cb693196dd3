"""Warping, sampling and verification run where the logits are (issue 39, item 4).

On a GPU the logits never cross to the host whole: each step reads back a few numbers, and no
operation mixes them with a tensor on the host (CUDA would raise). The CPU rehearses it with a
model whose logits stand for a GPU's (device_rehearsal.py), so that a step that pulls a vocabulary
row to the host, or meets host-made counts or draft distributions, fails here, not first on a GPU.
The chi-square and enumeration tests of test_verify.py and test_tree_verify.py run on a GPU too.
"""

import pytest
import torch

from conftest import needs_cuda, tiny_llama
from device_rehearsal import LogitsOnDevice, OnDevice, rehearsed
from specchat.core.acceptance import calibration_sequences, measure_acceptance
from specchat.core.decoding import (ChainDecoder, PlainDecoder, TreeDecoder, TriforceSettings, decode, prefill_all,
                                    triforce_decoder)
from specchat.core.sampling import SamplingParams, make_generator, on_device, sample
from specchat.core.speculative.drafters import PromptLookupDrafter
from specchat.core.speculative.lookahead import FixedLookahead
from specchat.core.speculative.suffix_drafter import SuffixDrafter
from specchat.core.speculative.tree_drafters import ModelTreeDrafter
from test_tree_decoding import TEMPLATE
from specchat.core.speculative.types import DecodeState
from specchat.core.speculative.verify import verify_chain

VOCAB = 97


SMALL = dict(budget=24, chunk_size=4, recent=8, stride=8, sinks=2, window=16)
DECODERS = {
    "plain": lambda target: PlainDecoder(),
    "chain (lookup)": lambda target: ChainDecoder(PromptLookupDrafter(min_ngram=1), FixedLookahead(4)),
    "tree (suffix)": lambda target: TreeDecoder(SuffixDrafter(max_nodes=8)),
    "tree (draft model)": lambda target: TreeDecoder(ModelTreeDrafter(LogitsOnDevice(tiny_llama(5, VOCAB)), TEMPLATE)),
    "triforce (skip1)": lambda target: triforce_decoder(target, TriforceSettings(draft="skip1", **SMALL),
                                                        prefill_chunk=16),
}
SAMPLINGS = {
    "greedy": SamplingParams(),
    "greedy penalized": SamplingParams(repetition_penalty=1.3),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=3),
    "penalized": SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
}


def steps_reads(mode: str, params: SamplingParams) -> tuple[list[tuple[int, list[tuple[str, int]]]], list[str]]:
    """(tokens verified, the reads on the host) per target step of a 24-token answer, and every
    operation that mixed the device's tensors with the host's."""
    target = LogitsOnDevice(tiny_llama(3, VOCAB, weight_scale=8.0))
    phrase = list(range(10, 22))
    prompt = torch.tensor(phrase + list(range(40, 60)) + phrase + phrase[:5])
    with rehearsed():
        state = DecodeState(target, target.new_cache(), prompt, params, make_generator(params.seed))
        decoder = DECODERS[mode](target)
        first = prefill_all(target, state.cache, prompt, 16, decoder)
        assert isinstance(first, OnDevice)
        steps, out, mixed = decode(state, decoder, first, 24), [], []
        while True:
            OnDevice.reads = []
            try:
                step = next(steps)
            except StopIteration:
                return out, mixed + OnDevice.mixed
            out.append((step.verified, OnDevice.reads))


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", DECODERS)
def test_a_step_reads_a_few_numbers_never_a_distribution(mode, sampling):
    steps, mixed = steps_reads(mode, SAMPLINGS[sampling])
    assert not mixed, sorted(set(mixed))
    for verified, reads in steps:
        # Tree verification reads its uniforms (one per node) and a few numbers per child tested.
        assert all(elements < VOCAB and elements <= max(verified, 2) for _, elements in reads), reads
    if mode in ("plain", "chain (lookup)"):
        # The verdict is one read; the warp adds one for top-p, one for the penalties' seen tokens.
        most = 1 + (SAMPLINGS[sampling].top_p < 1) + SAMPLINGS[sampling].penalized
        assert max(len(reads) for _, reads in steps) <= most, steps
    if mode == "chain (lookup)":
        assert max(verified for verified, _ in steps) > 1  # drafts were verified, not only plain steps


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_calibration_s_acceptance_runs_where_the_logits_are(sampling):
    """The pair's first load measures acceptance on the GPU: its counts, draws and verdicts there."""
    params = SAMPLINGS[sampling]
    target, draft = LogitsOnDevice(tiny_llama(3, VOCAB, weight_scale=8.0)), LogitsOnDevice(tiny_llama(4, VOCAB))
    with rehearsed():
        sequences = calibration_sequences(target, [torch.arange(5, 20)], params, make_generator(0), 12)
        vector = measure_acceptance(target, draft, sequences, [15], params, 3, make_generator(1))
        mixed = list(OnDevice.mixed)
    assert vector.positions == 12 and not mixed, sorted(set(mixed))


def test_a_deterministic_draft_without_q_verifies_as_its_one_hot():
    """Prompt lookup's proposals carry no Q (no [g, vocab] one-hot built on the host and shipped):
    the verdicts are the one-hot rule's, draw for draw."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        p = (torch.randn(5, 11, generator=generator) * 2).softmax(-1)
        if trial % 3 == 0:
            p = torch.nn.functional.one_hot(p.argmax(-1), 11).float()  # greedy
        tokens = torch.randint(11, (4,), generator=generator)
        one_hot = torch.nn.functional.one_hot(tokens, 11).float()
        seed = int(torch.randint(2**31, (1,), generator=generator))
        assert (verify_chain(tokens, None, p, torch.Generator().manual_seed(seed))
                == verify_chain(tokens, one_hot, p, torch.Generator().manual_seed(seed)))


def test_the_cpu_draws_from_the_answer_s_own_generator():
    generator = make_generator(5)
    assert on_device(generator, torch.device("cpu")) is generator
    assert on_device(None, torch.device("cpu")) is None


@needs_cuda
def test_a_seeded_answer_draws_the_same_on_the_gpu_every_time():
    probs = torch.rand(1000, device="cuda").softmax(-1)
    first, second = make_generator(9), make_generator(9)
    assert on_device(first, probs.device) is on_device(first, probs.device)  # one companion per answer
    assert ([sample(probs, first) for _ in range(20)] == [sample(probs, second) for _ in range(20)])

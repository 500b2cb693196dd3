"""Replayable decode steps (core/step_graphs.py, kv/device_length.py): the static path a CUDA graph
captures, run eagerly on the CPU in fp64, equals the eager forward, and every decoding mode through
it writes what plain decoding writes; on a GPU, a replayed graph equals the same path run eagerly."""

import pytest
import torch
from conftest import needs_cuda, tiny_llama
from test_decoding import prompts, run
from test_hierarchy import SMALL, TREE
from test_tree_decoding import model_tree_decoder, noisy_copy

from specchat.core.decoding import TriforceSettings, make_decoder, triforce_decoder
from specchat.core.kv import device_length
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.suffix_drafter import SuffixDrafter
from specchat.core.step_graphs import GRAPH_TOKENS


def twins(seed=3, **kwargs):
    """The same tiny model twice: eager, and with replayable steps run eagerly."""
    eager, replaying = tiny_llama(seed, **kwargs), tiny_llama(seed, **kwargs)
    return eager, replaying, replaying.set_step_graphs(capture=False)


def test_a_replayable_step_equals_the_eager_forward_and_a_wrong_length_would_show(monkeypatch):
    eager, replaying, graphs = twins(weight_scale=4.0)
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(0))
    caches = eager.new_cache(), replaying.new_cache()

    def both(start, n, mask=None):
        return [model.forward(ids[start:start + n], torch.arange(start, start + n), cache, mask)
                for model, cache in zip((eager, replaying), caches)]

    both(0, 30)  # the prompt: a first forward has no past, so it runs eagerly
    assert graphs.replays == 0
    poison_spare_slots(caches[1])
    for n in (1, 4, 1, 7, GRAPH_TOKENS + 1):
        expected, got = both(caches[0].length, n)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert graphs.replays == 4  # the step longer than GRAPH_TOKENS ran eagerly
    for cache in caches:  # a chain's rejected tokens, then a tree's accepted path
        cache.trim(40)
    tree_mask = TREE.attention_mask(40)
    expected, got = both(40, TREE.size, tree_mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for cache in caches:
        cache.keep(torch.cat([torch.arange(40), torch.tensor([40, 41, 45])]))
    expected, got = both(43, 2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert graphs.replays == 6 and caches[1].length == caches[0].length == 45

    # A forward that records its queries (TriForce's final verification): recorded through the step too.
    (expected, expected_queries), (got, got_queries) = (
        model.forward_with_queries(ids[45:48], torch.arange(45, 48), cache)
        for model, cache in zip((eager, replaying), caches))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert set(got_queries) == set(expected_queries) == {0, 1} and graphs.replays == 7
    for layer, queries in expected_queries.items():
        torch.testing.assert_close(got_queries[layer], queries, rtol=0, atol=1e-12)
    for cache in caches:
        cache.trim(45)

    # The control: a past one slot short changes the logits, so the comparisons above can fail.
    fill = device_length.DeviceStep.fill
    monkeypatch.setattr(device_length.DeviceStep, "fill", lambda step, start, allowed: fill(step, start - 1, allowed))
    expected, got = both(45, 3)
    assert (got - expected).abs().max() > 1e-3


def on_the_host(model):
    """`model` with its input embedding kept in CPU memory (an 8 GB card's plan), its steps
    replayable again (the runner looks for the host embedding when it is made)."""
    from specchat.core.host_embedding import embedding_on_cpu

    embedding_on_cpu(model.hf)
    return model.set_step_graphs(capture=model.step_graphs.capture if model.step_graphs else False)


def test_with_the_embedding_on_the_host_a_step_looks_its_rows_up_then_replays_the_rest():
    eager, replaying, _ = twins(weight_scale=4.0)
    graphs = on_the_host(replaying)
    assert graphs.off is None and graphs._host_embedding is not None
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(1))
    caches = eager.new_cache(), replaying.new_cache()
    for model, cache in zip((eager, replaying), caches):
        model.forward(ids[:30], torch.arange(30), cache)
    for n in (1, 3, 1, 5):
        start = caches[0].length
        expected, got = (model.forward(ids[start:start + n], torch.arange(start, start + n), cache)
                         for model, cache in zip((eager, replaying), caches))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert graphs.replays == 4
    target = tiny_llama(2, weight_scale=8.0)
    on_the_host(target)
    prompt = prompts(2)["n-gram hits"]
    plain, _ = run(tiny_llama(2, weight_scale=8.0), prompt, "plain", SamplingParams(), 30)
    assert run(target, prompt, "chain", SamplingParams(), 30)[0] == plain and target.step_graphs.replays > 0


def poison_spare_slots(cache):
    """NaN in every slot not yet written: a step that reads one (even with weight 0) shows it."""
    with torch.inference_mode():
        for layer in cache.transformers_cache.layers:
            for buffer in layer.buffers:
                buffer[:, :, layer.get_seq_length():] = float("nan")


def test_a_new_token_that_does_not_see_the_whole_past_runs_eagerly():
    eager, replaying, graphs = twins()
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1))
    caches = eager.new_cache(), replaying.new_cache()
    for model, cache in zip((eager, replaying), caches):
        model.forward(ids[:20], torch.arange(20), cache)
    mask = TREE.attention_mask(20)
    mask[0, 0, 2, 5] = torch.finfo(mask.dtype).min  # node 2 does not see position 5
    expected, got = (model.forward(ids[20:20 + TREE.size], torch.arange(20, 20 + TREE.size), cache, mask)
                     for model, cache in zip((eager, replaying), caches))
    assert graphs.replays == 0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_copied_model_replays_with_its_own_runner_and_another_attention_runs_eagerly():
    import copy

    eager, replaying, graphs = twins()
    copied = copy.deepcopy(replaying)  # DSI's thread instances are copies
    assert copied.step_graphs is not graphs and copied.step_graphs.hf is copied.hf
    expected, _ = run(eager, prompts(3)["n-gram hits"], "chain", SamplingParams(), 12)
    got, _ = run(copied, prompts(3)["n-gram hits"], "chain", SamplingParams(), 12)
    assert got == expected and copied.step_graphs.replays > 0 and graphs.replays == 0
    replaying.hf.set_attn_implementation("eager")  # transformers' own: it would read every slot
    got, _ = run(replaying, prompts(3)["n-gram hits"], "chain", SamplingParams(), 12)
    assert got == expected and graphs.replays == 0


def test_8_bit_and_offloaded_caches_decode_eagerly():
    """An offloaded KV always; an 8-bit one where its fused kernel does not run (here, the CPU
    outside tests/test_kv_int8_fused.py)."""
    from specchat.core.model import TransformersLM

    for options in ({"kv_dtype": "int8"}, {"offload_capacity": 128}):
        model = tiny_llama(2)
        model = TransformersLM(model.hf, **options)
        graphs = model.set_step_graphs(capture=False)
        plain, _ = run(model, prompts(2)["n-gram hits"], "chain", SamplingParams(), 12)
        assert graphs.replays == 0 and len(plain) == 12


class FakeGraph:
    """Stands in for a CUDA graph on the CPU: while capturing, the static path is recorded, not
    run, as a capture records kernels; `replay` runs it with whatever the static tensors hold."""
    capturing = None

    def __init__(self):
        self.replays, self.run = 0, None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        FakeGraph.capturing = self

    def capture_end(self):
        FakeGraph.capturing = None

    def replay(self):
        self.replays += 1
        self.run()

    def pool(self):
        return None


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    import contextlib

    from specchat.core.step_graphs import StepGraphs

    captured = []
    run = StepGraphs._run

    def run_or_record(runner, replay, transformers_cache):
        graph = FakeGraph.capturing
        if graph is None:
            return run(runner, replay, transformers_cache)
        graph.run = lambda: run(runner, replay, transformers_cache)
        captured.append(graph)

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(StepGraphs, "_run", run_or_record)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return captured


def test_a_size_is_captured_at_its_second_use_checked_once_and_replayed(fake_cuda_graphs):
    eager, replaying = tiny_llama(6, weight_scale=4.0), tiny_llama(6, weight_scale=4.0)
    graphs = replaying.set_step_graphs(capture=True)
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(6))
    caches = eager.new_cache(), replaying.new_cache()
    for start, n in [(0, 30), (30, 1), (31, 1), (32, 1), (33, 3), (36, 3), (39, 1)]:
        expected, got = (model.forward(ids[start:start + n], torch.arange(start, start + n), cache)
                         for model, cache in zip((eager, replaying), caches))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # one token: eager, captured (and checked against the eager forward), replayed twice;
    # three tokens: eager, captured
    assert graphs.off is None, graphs.off
    assert [fake.replays for fake in fake_cuda_graphs] == [3, 1]
    assert graphs.replays == 4 and graphs.off is None and caches[1].length == 40


def test_a_capture_that_differs_from_the_eager_forward_turns_graphs_off(fake_cuda_graphs, monkeypatch):
    eager, replaying = tiny_llama(6, weight_scale=4.0), tiny_llama(6, weight_scale=4.0)
    graphs = replaying.set_step_graphs(capture=True)
    # A kernel that misreads the past's length (the slots written stay right): one slot short.
    past = device_length._masked_past
    monkeypatch.setattr(device_length, "_masked_past", lambda q, k, v, length, scale: past(q, k, v, length - 1, scale))
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(6))
    caches = eager.new_cache(), replaying.new_cache()
    for start, n in [(0, 30), (30, 1), (31, 1), (32, 1)]:
        expected, got = (model.forward(ids[start:start + n], torch.arange(start, start + n), cache)
                         for model, cache in zip((eager, replaying), caches))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert graphs.off.startswith("a replayed step differed from the eager forward")
    assert graphs.replays == 0 and caches[1].length == 33


def decoders():
    """(name, makes a decoder for a target, the draft model it uses or None)."""
    def pair(seed):
        return noisy_copy(seed, 0.3, weight_scale=8.0)
    return {
        "chain": lambda seed, target: (make_decoder("chain"), None),
        "suffix tree": lambda seed, target: (make_decoder("tree", suffix=SuffixDrafter()), None),
        "draft tree": lambda seed, target: (lambda draft: (model_tree_decoder(draft), draft))(pair(seed)),
        "triforce skip1": lambda seed, target: (triforce_decoder(target, TriforceSettings(draft="skip1", **SMALL),
                                                                 prefill_chunk=16), None),
        "triforce pair": lambda seed, target: (lambda draft: (triforce_decoder(
            target, TriforceSettings(draft="pair", **SMALL), draft, prefill_chunk=16), draft))(pair(seed)),
        "triforce tree": lambda seed, target: (triforce_decoder(target, TriforceSettings(tree=TREE, **SMALL),
                                                                prefill_chunk=16), None),
    }


@pytest.mark.parametrize("mode", list(decoders()))
def test_greedy_decoding_through_replayable_steps_equals_plain(mode):
    drafted = accepted = 0
    for seed in range(2):
        eager = tiny_llama(seed, weight_scale=8.0)
        for name, prompt in prompts(seed).items():
            plain, _ = run(eager, prompt, "plain", SamplingParams(), 40)
            target = tiny_llama(seed, weight_scale=8.0)
            graphs = target.set_step_graphs(capture=False)
            decoder, draft = decoders()[mode](seed, target)
            draft_graphs = draft.set_step_graphs(capture=False) if draft is not None else None
            speculative, steps = run(target, prompt, mode, SamplingParams(), 40, decoder)
            assert speculative == plain, (mode, seed, name)
            assert graphs.replays > 0
            assert draft_graphs is None or draft_graphs.replays > 0
            drafted += sum(s.drafted for s in steps)
            accepted += sum(s.accepted for s in steps)
    assert 0 < accepted < drafted  # both verification branches ran through the replayed steps


@pytest.mark.parametrize("tree", [None, TREE])
def test_triforce_s_rebuilt_retrieval_cache_keeps_its_graphs(fake_cuda_graphs, monkeypatch, tree):
    """The retrieval cache is rebuilt every `stride` committed tokens: refilled in its buffers,
    the middle stage's graphs keep replaying instead of being captured again for every build
    (each capture costs two forwards of host time: a build lasts a few)."""
    from specchat.core.kv.retrieval import RetrievalCache

    prompt = prompts(0)["n-gram hits"]
    plain, _ = run(tiny_llama(0, weight_scale=8.0), prompt, "plain", SamplingParams(), 40)

    def graphs_made_and_replayed() -> tuple[int, int]:
        fake_cuda_graphs.clear()
        target = tiny_llama(0, weight_scale=8.0)
        graphs = target.set_step_graphs(capture=True)
        decoder = triforce_decoder(target, TriforceSettings(draft="lookup", tree=tree, **SMALL), prefill_chunk=16)
        speculative, _ = run(target, prompt, "triforce", SamplingParams(), 40, decoder)
        assert speculative == plain and graphs.off is None
        assert decoder.stage_counts()["retrieval"]["builds"] >= 4
        return len(fake_cuda_graphs), graphs.replays

    refilled = graphs_made_and_replayed()
    held = RetrievalCache.held.__func__
    monkeypatch.setattr(RetrievalCache, "held", classmethod(lambda cls, config, layers, base, reuse:
                                                             held(cls, config, layers, base, None)))
    rebuilt = graphs_made_and_replayed()  # as before: a new cache, new buffers, every build
    assert refilled[1] > rebuilt[1], (refilled, rebuilt)  # (graphs captured, steps replayed)


@needs_cuda
def test_a_captured_graph_replays_the_static_path_bit_for_bit():
    """fp32 on a GPU: the graph's logits equal the same static path run eagerly, bit for bit,
    and the eager forward to rounding; greedy decoding through graphs equals plain."""
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(4))
    models = [tiny_llama(4, dtype=torch.float32, weight_scale=4.0).to("cuda") for _ in range(3)]
    eager, captured, static = models
    graphs = captured.set_step_graphs(capture=True)
    static.set_step_graphs(capture=False)
    caches = [model.new_cache() for model in models]
    for model, cache in zip(models, caches):
        model.forward(ids[:30], torch.arange(30), cache)
    poison_spare_slots(caches[1])
    for start in range(30, 40):
        logits = [model.forward(ids[start:start + 1], torch.tensor([start]), cache)
                  for model, cache in zip(models, caches)]
        torch.testing.assert_close(logits[1], logits[2], rtol=0, atol=0)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert graphs.off is None and graphs.replays == 9  # the first step of its size ran eagerly
    target = tiny_llama(4, dtype=torch.float32, weight_scale=8.0).to("cuda")
    target.set_step_graphs(capture=True)
    plain, _ = run(tiny_llama(4, dtype=torch.float32, weight_scale=8.0).to("cuda"), prompts(4)["n-gram hits"],
                   "plain", SamplingParams(), 30)
    speculative, _ = run(target, prompts(4)["n-gram hits"], "chain", SamplingParams(), 30)
    assert speculative == plain and target.step_graphs.off is None and target.step_graphs.replays > 0
    # An 8 GB card's placement: the embedding on the host, the rest replayed.
    hosted = tiny_llama(4, dtype=torch.float32, weight_scale=8.0).to("cuda")
    graphs = on_the_host(hosted)
    assert hosted.hf.get_input_embeddings().weight.device.type == "cpu" and graphs.capture
    speculative, _ = run(hosted, prompts(4)["n-gram hits"], "chain", SamplingParams(), 30)
    assert speculative == plain and graphs.off is None and graphs.replays > 0


def flash_varlen_reference(q, k, v, bounds_q, bounds_k, max_q, max_k, dropout, causal, debug, *, scale, seqused_k):
    """aten._flash_attention_forward as documented, one sequence: q [total_q, heads, d], k and v
    [total_k, kv_heads, d], head h reading KV head h // (heads / kv_heads), the first `seqused_k`
    keys -> (out [total_q, heads, d], lse [heads, total_q])."""
    used = int(seqused_k[0])
    groups = q.shape[1] // k.shape[1]
    keys, values = (t[:used].repeat_interleave(groups, 1).transpose(0, 1) for t in (k, v))  # [heads, used, d]
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * scale  # [heads, total_q, used]
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp().matmul(values).transpose(0, 1), lse, None, None, None


def efficient_reference(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout, mask_type, with_lse, *, scale, seqlen_k):
    """aten._efficient_attention_forward as documented: q [B, M, H, d], k and v [B, N, H, d], the
    first `seqlen_k` keys -> (out [B, M, H, d], lse [B, H, M rounded up to 32])."""
    used = int(seqlen_k[0])
    scores = q.transpose(1, 2) @ k[:, :used].transpose(1, 2).transpose(-1, -2) * scale  # [B, H, M, used]
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ v[:, :used].transpose(1, 2)
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("inf"), dtype=lse.dtype)
    padded[..., :lse.shape[2]] = lse
    return out.transpose(1, 2), padded, None, None, None, None


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_the_gpu_kernels_arguments_and_layouts_match_the_reference(kernel, monkeypatch):
    """The CUDA past attention's reshapes, against each kernel's documented semantics stood in by
    plain arithmetic: the same out and lse as the masked reference, with the buffer's tail unread."""
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(9)
    kv_heads, groups, n, capacity, past, dim = 2, 3, 4, 20, 11, 8
    folded = torch.randn(1, kv_heads, groups * n, dim, generator=generator, dtype=torch.float64)
    keys, values = (torch.randn(1, kv_heads, capacity, dim, generator=generator, dtype=torch.float64) for _ in "kv")
    step = device_length.DeviceStep.empty(n, capacity, torch.device("cpu"))
    step.fill(past, None)
    expected = device_length._masked_past(folded, keys, values, step.past, 0.3)
    keys[:, :, past:], values[:, :, past:] = float("nan"), float("nan")  # never read
    fake = SimpleNamespace(_flash_attention_forward=SimpleNamespace(default=flash_varlen_reference),
                           _efficient_attention_forward=SimpleNamespace(default=efficient_reference))
    monkeypatch.setattr(torch.ops, "aten", fake)
    if kernel == "flash":
        out, lse = device_length._flash_past(folded, keys, values, step, 0.3)
    else:
        out, lse = device_length._efficient_past(folded, keys, values, step.past, 0.3)
    torch.testing.assert_close(out, expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected[1], rtol=1e-12, atol=1e-12)

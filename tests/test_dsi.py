"""DSI (speculative/dsi/) on tiny random models: identical to plain greedy decoding and exact in
distribution when sampling, whatever order its target instances answer in."""

import copy
import json
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from specchat.core.exact_outcomes import chi_square_p_value
from conftest import needs_cuda, tiny_llama
from test_decoding import exact_sequence_probs, prompts, run
from test_hierarchy import sampled_hierarchy
from test_tree_decoding import noisy_copy
from specchat.core.decoding import decode, prefill_all, triforce_drafter
from specchat.core.speculative.types import DecodeState
from specchat.core.sampling import SamplingParams, make_generator
from specchat.core.speculative.drafters import PromptLookupDrafter
from specchat.benchmarks.dsi import CoinDrafter, WaitingTarget, ratio_noise, slower_beyond_noise, timed_run
from specchat.core.speculative.dsi.orchestrator import DsiDecoder, resolve
from specchat.core.speculative.dsi.policy import (DECAY, NEAR_PATIENCE, PROBE_BACKOFF, PROBE_EVERY, PROBE_NEAR,
                                                  PROBE_RARELY, DsiPolicy)
from specchat.core.speculative.dsi.pool import thread_pool, wait_unless_cancelled
from specchat.core.speculative.hierarchy import ModelDrafter
from specchat.core.request import Request
from specchat.core.runtime import EngineSettings

PREFILL_CHUNK = EngineSettings().prefill_chunk  # the engine's, where a test builds a decoder itself


class Slow:
    """A model whose forwards take `seconds` more, plus a random extra up to `jitter` (so tasks
    finish out of order): a target slower than its drafter, as DSI assumes."""

    def __init__(self, model, seconds: float, jitter: float, seed: int):
        self.model, self.seconds, self.jitter = model, seconds, jitter
        self.random = random.Random(seed)
        self.vocab_size, self.context_length = model.vocab_size, model.context_length

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, ids, positions, cache, mask=None, last_only=False):
        if not last_only:  # reading the prompt is quick: the decoding steps are what DSI hides
            wait_unless_cancelled(self.seconds + self.random.uniform(0, self.jitter))
        return self.model.forward(ids, positions, cache, mask, last_only)


def instances(model, count, seconds=0.01, jitter=0.0):
    return thread_pool([Slow(copy.deepcopy(model), seconds, jitter, seed) for seed in range(count)], PREFILL_CHUNK)


def alternating(decoder: DsiDecoder, period: int) -> DsiDecoder:
    """The instances for `period` positions, then plain steps on the engine's own target for as
    many, and so on, whatever the cost model would say: exactness must not depend on which."""
    def pays(fresh=True):
        state = decoder._state
        return state is None or (state.ids.shape[0] // period) % 2 == 0

    decoder.policy.pays = pays
    return decoder


def plain_tasks_at_even_positions(decoder: DsiDecoder) -> DsiDecoder:
    """A new frontier gets a plain task at once at even positions, and waits for a lookahead of
    drafts at odd ones, whatever the cost model would say: exactness must not depend on which."""
    decoder.policy.plain_task = lambda: decoder._state is None or decoder._state.ids.shape[0] % 2 == 0
    return decoder


def run_dsi(model, prompt, params, max_new_tokens, decoder):
    """Like test_decoding.run, but the engine's cache only holds the prompt: the instances hold the rest."""
    ids = torch.tensor(prompt)
    state = DecodeState(model, model.new_cache(), ids, params, make_generator(params.seed))
    first_logits = prefill_all(model, state.cache, ids, chunk_size=16, decoder=decoder)
    steps = list(decode(state, decoder, first_logits, max_new_tokens))
    return [t for s in steps for t in s.tokens][:max_new_tokens], steps


def test_resolve_stops_at_the_last_row_without_a_bonus_when_every_draft_is_accepted():
    p = torch.eye(4)[[1, 2]]  # greedy: the target says 1, then 2
    q = torch.eye(4)[[1, 2]]
    assert resolve(p, torch.tensor([1, 2]), q, None) == (2, None)  # the next row comes from a later task
    assert resolve(p, torch.tensor([1]), q[:1], None) == (1, 2)  # bonus from the last row
    assert resolve(p, torch.tensor([1, 3]), torch.eye(4)[[1, 3]], None) == (1, 2)  # recovered


@pytest.mark.parametrize("workers, jitter", [(1, 0.0), (2, 0.0), (3, 0.01)])
@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_greedy_dsi_equals_greedy_plain(drafter, workers, jitter):
    used = cancelled = drafted = accepted = 0
    for seed in range(2):
        target = tiny_llama(seed, weight_scale=8.0)
        pool = instances(target, workers, jitter=jitter)
        for name, prompt in prompts(seed).items():
            plain, _ = run(target, prompt, "plain", SamplingParams(), 40)
            source = (PromptLookupDrafter(min_ngram=1) if drafter == "lookup"
                      else ModelDrafter(noisy_copy(seed, 0.3, weight_scale=8.0), 2, 16, False, "pair", PREFILL_CHUNK))
            decoder = DsiDecoder(source, pool, plain_steps=False)
            if seed == 1:
                plain_tasks_at_even_positions(decoder)
            parallel, steps = run_dsi(target, prompt, SamplingParams(), 40, decoder)
            assert parallel == plain, (seed, name)
            counts = decoder.stage_counts()["dsi"]
            used, cancelled = used + counts["accepted"], cancelled + counts["cancelled"]
            drafted += sum(s.drafted for s in steps)
            accepted += sum(s.accepted for s in steps)
        pool.close()
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert used > 0
    assert cancelled > 0 or workers == 1  # rejections cancelled tasks built on the rejected drafts


class StuckDrafter(PromptLookupDrafter):
    """A drafter whose turn does not end until `release` is set (a wake-up that never comes)."""

    def __init__(self):
        super().__init__(min_ngram=1)
        self.release = threading.Event()

    def draft(self, state, seq, max_tokens):
        self.release.wait()
        return None


def test_a_step_with_nothing_in_flight_never_waits_for_a_wake_up_forever():
    """Clean-clone CI hung in a DSI answer: the caller waited for a result with no task in flight,
    for a wake-up from a drafting thread that had nothing to draft. With nothing in flight the
    caller waits DRAFTER_WAIT_S at most, then sends the frontier a task (the old code hangs here)."""
    target = tiny_llama(0, weight_scale=8.0)
    prompt = prompts(0)["no n-gram hits"]
    plain, _ = run(target, prompt, "plain", SamplingParams(), 6)
    drafter, pool = StuckDrafter(), instances(target, 2)
    decoder = DsiDecoder(drafter, pool, plain_steps=False)
    decoder.policy.plain_task = lambda: False  # the frontier waits for a block of drafts
    result = {}
    answering = threading.Thread(target=lambda: result.update(tokens=run_dsi(target, prompt, SamplingParams(), 6,
                                                                               decoder)[0]), daemon=True)
    answering.start()
    answering.join(timeout=60)
    drafter.release.set()
    answering.join(timeout=10)
    pool.close()
    assert result.get("tokens") == plain


def test_greedy_dsi_equals_greedy_plain_through_plain_steps_and_back():
    """Plain steps on the engine's own target every other three positions: the drafts kept past
    a plain step whose token equals the next draft are verified by the instances after it."""
    plain_steps = tasks = 0
    for seed in range(2):
        target = tiny_llama(seed, weight_scale=8.0)
        pool = instances(target, 2, jitter=0.005)
        for name, prompt in prompts(seed).items():
            plain, _ = run(target, prompt, "plain", SamplingParams(), 40)
            for source in (PromptLookupDrafter(min_ngram=1),
                           ModelDrafter(noisy_copy(seed, 0.3, weight_scale=8.0), 2, 16, False, "pair", PREFILL_CHUNK)):
                decoder = alternating(DsiDecoder(source, pool), 3)
                parallel, _ = run_dsi(target, prompt, SamplingParams(), 40, decoder)
                assert parallel == plain, (seed, name, type(source).__name__)
                counts = decoder.stage_counts()["dsi"]
                plain_steps, tasks = plain_steps + counts["plain_steps"], tasks + counts["accepted"]
        pool.close()
    assert plain_steps > 50 and tasks > 50


def test_the_instances_pay_by_the_cost_model_against_a_plain_step():
    latencies = DsiPolicy(instances=2)
    assert latencies.pays()  # nothing measured yet: the instances, as DSI was asked for
    latencies.observe_task(0.020)
    latencies.observe_handoff(0.0005)  # each task also waits 0.5 ms for its handoff and verdict
    latencies.observe_draft(0.0004, 1)
    assert latencies.pays()  # the prior acceptance (70%) with a drafter at 2% of the target
    for _ in range(40):
        latencies.observe_verdict(1, 0)
    assert not latencies.pays()  # every draft fails: a task is a plain step plus its handoff
    for _ in range(40):
        latencies.observe_verdict(4, 4)
    assert latencies.pays() and latencies.lookahead() > 1
    latencies.observe_draft(0.020, 1)  # a drafter as slow as the target: nothing to hide it behind
    for _ in range(40):
        latencies.observe_draft(0.020, 1)
    assert not latencies.pays()
    latencies.observe_local(0.040)  # ... unless a plain step here is slower than an instance's
    assert latencies.pays()
    for _ in range(40):
        latencies.observe_local(0.021)
        latencies.observe_verdict(10, 9)  # 90% of the drafts accepted: DSI a little faster
    assert latencies.pays()
    # The drafter first ends, after each rejection, a draft on the rejected text (half of one on
    # average): that delays a run by 0.5 ms at most, as the plain task then covers the frontier.
    for _ in range(40):
        latencies.observe_restart(0.010)
    assert latencies.pays()
    latencies.observe_local(0.0195)
    assert latencies.pays()  # the median of the last plain steps' times is still 21 ms
    for _ in range(40):
        latencies.observe_local(0.0195)
    assert not latencies.pays()
    # Not even at full acceptance: plain steps need the drafter only to watch its latency.
    assert latencies.probe_every() == PROBE_RARELY
    latencies.observe_local(0.200)  # a stall (measured only during plain steps: it must not move them)
    assert latencies.local == 0.0195 and not latencies.pays()
    always = DsiPolicy(instances=2, plain_steps=False)  # asked for every token from the instances
    always.observe_task(0.020)
    always.observe_draft(0.020, 1)
    for _ in range(40):
        always.observe_verdict(1, 0)
    assert always.pays() and always.lookahead() == 1


def test_a_few_failed_verdicts_show_the_instances_do_not_pay():
    """The prior is weak: where every draft fails, four verdicts (four tokens at a task's
    handoff over a plain step) move the orchestrator to plain steps."""
    latencies = DsiPolicy(instances=2)
    latencies.observe_task(0.0203)
    latencies.observe_handoff(0.0007)
    latencies.observe_draft(0.0004, 1)
    latencies.observe_local(0.0206)
    verdicts = 0
    while latencies.pays():
        latencies.observe_verdict(1, 0)
        verdicts += 1
    assert verdicts <= 4


def test_a_plain_step_measures_a_greedy_draft_as_the_general_rule_would():
    """min(1, P/Q) at the draft's token, P one-hot at the target's token (greedy): 1 where the
    draft is that token, 0 elsewhere, whatever Q. The plain step takes it without a tensor
    operation."""
    decoder = DsiDecoder(PromptLookupDrafter(), SimpleNamespace(size=2, cancel=lambda tasks: None))
    q = torch.tensor([0.1, 0.6, 0.3, 0, 0, 0, 0, 0])
    p = torch.nn.functional.one_hot(torch.tensor(2), 8).float()
    for draft in (1, 2):
        decoder.drafts, decoder.q = [draft], [q]
        assert decoder._acceptance(p, 2, greedy=True) == decoder._acceptance(p, 2, greedy=False) == float(draft == 2)


def test_the_first_draft_is_one_token():
    """Until the drafter's latency and a task's are measured it drafts one token at a time: a
    drafter as slow as the target shows in one draft, not in a lookahead of them. Simulated (a
    target of 20 ms, drafts of 1 ms accepted 90% of the time) so that the lookahead the figures
    then choose is well above one on a loaded machine too."""
    asked = []

    class Recording(CoinDrafter):
        def draft(self, state, seq, max_tokens):
            asked.append(max_tokens)
            return super().draft(state, seq, max_tokens)

    pool = thread_pool([WaitingTarget(0.020) for _ in range(2)], PREFILL_CHUNK)
    timed_run(DsiDecoder(Recording(0.001, 0.9, seed=0), pool), WaitingTarget(0.020), 24)
    pool.close()
    assert asked[0] == 1 and max(asked) > 1, asked


def test_most_plain_steps_are_plain_decoding_with_no_lock_and_the_probes_measure_them():
    """Where the instances do not pay, the steps between probes take no lock and have no draft
    beside them (the orchestrator's bookkeeping, cold after a forward's wait, cost 0.7% of every
    step); a plain step's time is measured over them, and the text is plain decoding's."""

    class Counting(threading.Condition):
        taken = 0  # by the caller's thread

        def __enter__(self):
            if threading.current_thread() is threading.main_thread():
                self.taken += 1
            return super().__enter__()

    target = tiny_llama(0, weight_scale=8.0)
    pool = instances(target, 2)
    prompt = prompts(0)["n-gram hits"]
    plain, _ = run(target, prompt, "plain", SamplingParams(), 64)
    decoder = DsiDecoder(PromptLookupDrafter(min_ngram=1), pool)
    decoder.policy.pays = lambda fresh=True: False
    decoder._changed = lock = Counting()
    took_the_lock = []
    step = decoder.step

    def counted(state, budget):
        before = lock.taken
        result = step(state, budget)
        took_the_lock.append(lock.taken > before)
        return result

    decoder.step = counted
    parallel, _ = run_dsi(target, prompt, SamplingParams(), 64, decoder)
    pool.close()
    assert parallel == plain
    lean = took_the_lock.count(False)
    assert lean >= len(took_the_lock) // 2, took_the_lock  # at least every other one (was none)
    assert decoder.policy.local is not None  # measured over the lean steps


def test_without_a_plain_task_where_blocks_would_wait_for_an_instance():
    latencies = DsiPolicy(instances=2)
    latencies.observe_task(0.020)
    latencies.observe_handoff(0.0005)
    latencies.observe_draft(0.0004, 1)  # 2% of the target: 2 x 16 drafts (the cap) take 13 ms < 20 ms
    for _ in range(40):
        latencies.observe_verdict(8, 8)
    assert latencies.pays() and not latencies.plain_task()
    for _ in range(40):
        latencies.observe_verdict(2, 1)  # half the drafts fail: the plain task covers a rejection at once
    assert latencies.pays() and latencies.plain_task()
    for _ in range(40):
        latencies.observe_verdict(1, 0)
    assert not latencies.pays()
    assert latencies.probe_every() == PROBE_NEAR  # so fast a drafter pays with one draft in ten accepted
    seven = DsiPolicy(instances=7)  # enough instances for one always to be free: the paper's DSI
    seven.observe_task(0.020)
    seven.observe_draft(0.0004, 1)
    for _ in range(40):
        seven.observe_verdict(8, 8)
    assert seven.plain_task() and seven.lookahead() < 16


def test_plain_steps_measure_a_draft_more_often_a_verdict_away_from_the_break_even():
    latencies = DsiPolicy(instances=2)
    latencies.observe_task(0.020)
    latencies.observe_local(0.020)
    latencies.observe_draft(0.014, 1)  # 70% of the target, and half a draft to restart after a rejection
    latencies.observe_restart(0.007)
    for _ in range(40):
        latencies.observe_verdict(1, 0)
    probes = []
    while not latencies.pays():  # drafts accepted one at a time, up to the break-even
        probes.append(latencies.probe_every())
        latencies.observe_verdict(1, 1)
    assert probes[0] == PROBE_EVERY and probes[-1] == PROBE_NEAR, probes  # a verdict away: every other step
    assert probes.count(PROBE_NEAR) == 1, probes


def probe_intervals(acceptance: float, tiers: list[int], tokens: int) -> list[int]:
    """The lean runs' lengths (each ends in a probe) over `tokens` plain steps, a zero-latency
    drafter right with probability `acceptance`, the instances never paying and each probe's tier
    taken from `tiers`."""
    pool = thread_pool([WaitingTarget(0.002) for _ in range(2)], PREFILL_CHUNK)
    decoder = DsiDecoder(CoinDrafter(0.0, acceptance, seed=0), pool)
    decoder.policy.pays = lambda fresh=True: False
    tiers = iter(tiers)
    decoder.policy.probe_every = lambda fresh=True: next(tiers)
    intervals = []
    probe_beside = decoder._probe_beside

    def recorded():
        intervals.append(decoder.policy.lean_run[1] + 1)
        probe_beside()

    decoder._probe_beside = recorded
    timed_run(decoder, WaitingTarget(0.002), tokens)  # the target's text, as every decoder here
    pool.close()
    return intervals


def test_probes_back_off_while_they_find_the_instances_no_nearer_to_paying():
    """Each probe costs the drafter's wake-up and bookkeeping after a forward. Far from paying,
    each lean run is twice as long as the last, up to PROBE_BACKOFF times its tier's; near the
    break-even (one accepted draft from paying), so only after more than NEAR_PATIENCE drafts in
    a row that the target did not take, and a draft taken starts over."""
    assert (PROBE_BACKOFF, NEAR_PATIENCE) == (8, 3)
    failing = probe_intervals(0.0, [PROBE_EVERY] * 5 + [PROBE_NEAR] * 7 + [PROBE_RARELY] * 9, 320)
    assert failing == [4, 8, 16, 32, 32, 2, 2, 2, 4, 8, 16, 16, 16, 32, 64], failing
    taken = probe_intervals(1.0, [PROBE_NEAR] * 5 + [PROBE_EVERY] * 3 + [PROBE_NEAR] * 2 + [PROBE_EVERY] * 9, 120)
    assert taken == [2, 2, 2, 2, 2, 4, 8, 16, 2, 2, 4, 8, 16, 32], taken


def test_a_verdict_counts_only_the_drafts_it_judged():
    """Drafts after the first rejection were never judged: counting them as failed would make a
    90% drafter look like a 60% one (and the cost model choose as if it were)."""
    model = tiny_llama(0)
    decoder = DsiDecoder(PromptLookupDrafter(), SimpleNamespace(size=2, cancel=lambda tasks: None))
    state = DecodeState(model, model.new_cache(), torch.tensor([1, 2]), SamplingParams(), make_generator(0))
    decoder.drafts = [5, 6, 7, 8, 9, 10, 11, 12]
    decoder.q = list(torch.eye(model.vocab_size)[decoder.drafts])
    p = torch.eye(model.vocab_size)[[5, 3, 7, 8, 9, 10, 11, 12, 13]]  # the second draft is rejected
    before = decoder.policy.drafted, decoder.policy.accepted
    step = decoder._verdict(state, p, budget=16)
    assert step.tokens == [5, 3] and step.accepted == 1
    assert decoder.policy.drafted == pytest.approx(DECAY * before[0] + 2)  # judged: the first two
    assert decoder.policy.accepted == pytest.approx(DECAY * before[1] + 1)


@pytest.mark.slow
@pytest.mark.parametrize("period", [None, 1])
def test_sampled_dsi_over_the_hierarchy_samples_from_the_target(period, params=SamplingParams(temperature=0.7,
                                                                                               top_p=0.9)):
    """TriForce's hierarchy below (a noisy draft over a streaming cache, verified by the target over
    a retrieval cache) drafts for DSI over two instances that answer in random order: the first
    four tokens follow the target's exact sequence distribution, every token from the instances
    (a new frontier gets a plain task at once at even positions, and waits for drafts at odd ones).
    With `period` 1, every other position is a plain step on the engine's own target, whose
    token keeps the drafts after it when it equals the next draft."""
    target, draft, prompt, settings = sampled_hierarchy()
    exact = exact_sequence_probs(target, prompt, params, 4)
    pool = instances(target, 2, seconds=0.004, jitter=0.002)

    def batch(first_seed: int) -> torch.Tensor:
        counts = torch.zeros_like(exact)
        drafted = accepted = plain_steps = 0
        for sample in range(first_seed, first_seed + 1200):
            run_params = SamplingParams(params.temperature, params.top_k, params.top_p, seed=sample)
            decoder = DsiDecoder(triforce_drafter(target, settings, draft, prefill_chunk=PREFILL_CHUNK), pool,
                                 plain_steps=False)
            if period is None:
                plain_tasks_at_even_positions(decoder)
            else:
                alternating(decoder, period)
            tokens, steps = run_dsi(target, prompt, run_params, 4, decoder)
            counts[tuple(tokens)] += 1
            drafted += sum(s.drafted for s in steps)
            accepted += sum(s.accepted for s in steps)
            plain_steps += decoder.counts["plain_steps"]
        assert drafted > 500 and 0.1 * drafted < accepted < 0.95 * drafted, (drafted, accepted)
        assert (plain_steps > 300) == (period is not None), plain_steps
        return counts

    # The instances' timing is random, so unlike the seeded tests this one can fail by chance
    # (one CI run: p = 0.0007; 6,000 samples of the same run gave p = 0.37). A low p earns one
    # fresh batch: a sampler that is wrong fails both, a right one fails both once in a million.
    try:
        p_value = chi_square_p_value(batch(0), exact)
        if p_value <= 1e-3:
            p_value = chi_square_p_value(batch(1200), exact)
    finally:
        pool.close()
    assert p_value > 1e-3


def test_the_simulation_runs_every_decoder_to_the_target_text(tmp_path):
    """The bench's simulated world through plain, SI and DSI (each run checks it committed only
    the target's tokens); timings are the bench's business, not this test's."""
    from specchat.benchmarks.dsi import run_dsi_simulation

    paths = run_dsi_simulation(tmp_path, instances=(2,), draft_shares=(0.1,), acceptances=(0.0, 0.9), rejections=2,
                               progress=lambda line: None)
    report = json.loads(paths[0].read_text())
    cells = report["instances"]["2"]["cells"]
    assert [(c["draft_share"], c["acceptance"]) for c in cells] == [(0.1, 0.0), (0.1, 0.9)]
    assert all(c["plain_s"] > 0 and c["si_s"] > 0 and c["dsi_s"] > 0 for c in cells)
    assert report["instances"]["2"]["ratio_noise"] >= 0
    assert isinstance(report["instances"]["2"]["dsi_slower_than_plain_beyond_noise"], list)


def test_the_simulation_flags_a_cell_slower_than_plain_beyond_the_timing_noise():
    """Plain is timed twice a cell; their differences over the grid give one run's sigma, and a
    DSI/plain ratio more than three of its sigmas under 1 is slower than plain, not noise."""
    cells = [{"draft_share": 0.1, "acceptance": acceptance, "dsi_over_plain": ratio, "plain_noise": noise}
             for acceptance, ratio, noise in [(0.0, 0.996, 0.001), (0.3, 0.994, 0.003), (0.6, 1.3, 0.0)]]
    assert ratio_noise(cells) == pytest.approx(0.001581, abs=1e-6)  # sqrt((1 + 9) 1e-6 / 3 / 2) sqrt(1.5)
    assert slower_beyond_noise(cells) == [[0.1, 0.3]]  # under 1 - 3 sigma = 0.9953


def test_a_cancelled_forward_leaves_the_instance_as_if_it_never_ran():
    """Stopped between two layers (the first layer's KV written, the second's not), the instance
    rolls every layer back: its next task's logits equal a fresh instance's."""
    import threading

    from specchat.core.speculative.dsi import pool as dsi_pool
    from specchat.core.interrupt import cancellable

    model = tiny_llama(3)
    instance = dsi_pool.CacheInstance(model, PREFILL_CHUNK)
    tokens = torch.tensor(prompts(3)["n-gram hits"])
    flag = threading.Event()
    with cancellable(flag):
        def stop_after_the_first_layer(module, args, output):
            if args[0].shape[1] == 4:  # the task's last forward, not the prompt read before it
                flag.set()

        hook = model.hf.base_model.layers[0].register_forward_hook(stop_after_the_first_layer)
        with pytest.raises(dsi_pool.Cancelled):
            instance.logits(tokens, 4)
        hook.remove()
        assert instance.ids.shape[0] == tokens.shape[0] - 4  # the prompt part finished before the stop
        flag.clear()
        again = instance.logits(tokens[:-1], 5)
    fresh = dsi_pool.CacheInstance(tiny_llama(3), PREFILL_CHUNK).logits(tokens[:-1], 5)
    assert torch.equal(again, fresh)


@needs_cuda
def test_greedy_dsi_over_cuda_processes_through_plain_steps_on_the_shared_target(tmp_path):
    """The GPU worker path on one card, through plain steps: the engine's own target serves
    instance 0 from a thread while the decoder's plain steps run on it too (each thread with its
    own cache and cancel flag), and a spawned process holds the second copy."""
    from specchat.core.speculative.dsi.pool import TargetLoader, process_pool
    from specchat.core.placement import LoadOptions

    tiny_llama(0, weight_scale=8.0).hf.save_pretrained(tmp_path)
    loader = TargetLoader(str(tmp_path), LoadOptions("float64", "cuda:0", None, None))
    target = loader("cuda:0")
    pool = process_pool(loader, ["cuda:0", "cuda:0"], PREFILL_CHUNK, local=target)
    plain_steps = tasks = 0
    for name, prompt in prompts(0).items():
        plain, _ = run(target, prompt, "plain", SamplingParams(), 40)
        for source in (PromptLookupDrafter(min_ngram=1),
                       ModelDrafter(noisy_copy(0, 0.3, weight_scale=8.0), 2, 16, False, "pair", PREFILL_CHUNK)):
            decoder = alternating(DsiDecoder(source, pool), 3)
            parallel, _ = run_dsi(target, prompt, SamplingParams(), 40, decoder)
            assert parallel == plain, (name, type(source).__name__)
            counts = decoder.stage_counts()["dsi"]
            plain_steps, tasks = plain_steps + counts["plain_steps"], tasks + counts["accepted"]
    assert plain_steps > 20 and tasks > 20
    assert all(count > 0 for count in pool.finished), pool.finished
    pool.close()


@pytest.mark.slow
@needs_cuda
def test_greedy_dsi_over_cuda_instances_equals_plain_on_a_document(embedded_dir):
    """The GPU worker path on one card (issue 17): the engine's own target is instance 0, served
    from a thread; a spawned process loads the second copy onto the same card, as it would onto
    a second one. The embedded model in fp32 on a 3K-token document: identical to plain, again
    once the instances hold the prompt, after a stopped answer, and sampling runs through.
    (bf16 rounds near-ties differently in single and batched forwards, plain decoding included.)"""
    import threading

    from transformers import AutoTokenizer

    from conftest import DATA
    from specchat.app.documents import user_turn
    from specchat.core.speculative.dsi.pool import TargetLoader
    from specchat.core.engine import Engine, Finished, TextDelta
    from specchat.core.placement import LoadOptions
    from specchat.core.runtime import EngineSettings

    loader = TargetLoader(str(embedded_dir), LoadOptions("float32", "cuda:0", None, None))
    engine = Engine(loader("cuda:0"), AutoTokenizer.from_pretrained(embedded_dir), "embedded",
                    settings=EngineSettings(dsi_devices=("cuda:0", "cuda:0")), target_loader=loader)
    text = (DATA / "gpl-3.0.txt").read_text()
    turn = user_turn("Summarize this document.", text[:text.rfind("\n\n", 0, 14000)])
    prompt = engine.chat_ids([{"role": "user", "content": turn}])
    assert 2800 <= len(prompt) <= 3300

    def answer(mode, sampling=SamplingParams(), stop_after=None):
        cancel, produced = threading.Event(), 0
        for event in engine.generate(prompt, Request(96, sampling, mode), cancel=cancel):
            if isinstance(event, TextDelta):
                produced += len(event.token_ids)
                if stop_after is not None and produced >= stop_after:
                    cancel.set()
            elif isinstance(event, Finished):
                return event.result

    plain = answer("plain")
    first, again = answer("dsi"), answer("dsi")  # the second: the instances already hold the prompt
    stopped = answer("dsi", stop_after=8)
    after_stop = answer("dsi")
    sampled = answer("dsi", SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    for name, result in (("first", first), ("again", again), ("after a stop", after_stop)):
        assert result.token_ids == plain.token_ids, name
        counts = result.stats.stages["dsi"]
        assert counts["instances"] == 2 and counts["accepted"] > 0, (name, counts)
    assert stopped.finish_reason == "cancelled" and stopped.token_ids == plain.token_ids[:len(stopped.token_ids)]
    assert sampled.finish_reason in ("stop", "length") and sampled.new_tokens > 0
    pool = engine.dsi.pool
    assert all(count > 0 for count in pool.finished), pool.finished  # the spawned process verified too
    pool.close()


def test_a_plain_step_commits_its_own_token_only_and_keeps_the_drafts_after_a_match():
    """A non-lean DSI plain step whose token equals the next draft drops that draft and
    commits nothing else; the drafts after it wait for an instance's verdict (a mutation audit found
    the sampled tests, which docs/tests.md credited with this, let it through)."""
    target = tiny_llama(0, weight_scale=8.0)
    prompt = torch.tensor(prompts(0)["no n-gram hits"])
    state = DecodeState(target, target.new_cache(), prompt, SamplingParams(), make_generator(0))
    prefill_all(target, state.cache, prompt[:-1], 16)  # the cache holds all but the last
    expected = int(target.forward(prompt[-1:], torch.tensor([len(prompt) - 1]),
                                  state.cache.clone_prefix(state.cache.length))[-1].argmax())
    wrong = (expected + 1) % target.vocab_size
    decoder = DsiDecoder(PromptLookupDrafter(), SimpleNamespace(size=2, cancel=lambda tasks: None))
    decoder.policy.lean, decoder.policy.lean_run = 0, None  # a plain step with its bookkeeping
    decoder.drafts, decoder.q = [expected, wrong, wrong], [None] * 3
    step = decoder._plain_step(state, 16)
    assert step.tokens == [expected]
    assert state.ids.tolist() == prompt.tolist() + [expected]
    assert decoder.drafts == [wrong, wrong]

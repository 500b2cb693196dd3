"""`specchat selftest`: checks, on the user's own machine and model, that decoding is lossless.

Each check is a function returning a `CheckResult` (it never prints): exact enumeration of the
verification rules (algorithms.md sections 1 and 2) on tiny vocabularies, a seeded chi-square
test of sampled verification, greedy identity of every decoding mode against plain decoding on a
document shipped with the package, and on a CUDA GPU its forward and offloaded KV cache against
the CPU's. The checks call the real code (the `verify` module's rules looked up at call time,
`Engine.generate` with each mode), so a broken rule or decoder fails here, not just in tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources

import torch

from .errors import first_line
from .exact_outcomes import chain_outcome, chi_square_p_value, drafted_outcome, node_outcome, random_case, total_variation
from .request import Request
from .sampling import SamplingParams, sample_without_replacement, warp
from .speculative import verify
from .speculative.tree import Tree

EXACT_TOLERANCE = 1e-9  # enumeration in float64: exactness up to rounding
CHI_SQUARE_LEVEL = 1e-3  # seeded, so a pass is reproducible; a wrong rule lands far below
ENUMERATION_CASES = 12  # random (P, Q) pairs per rule, zeros and disjoint supports included
CHAIN_VOCAB, TREE_VOCAB = 4, 5
CHAIN_DRAWS, TREE_DRAWS = 3000, 1500
# Root with 3 children; its first child has 2 children, the first of which has one: depth 3.
SAMPLED_TREE = Tree((-1, 0, 0, 0, 1, 1, 4))
# The final verification of "triforce with a tree": small enough for any retrieval budget.
TRIFORCE_TREE = Tree((-1, 0, 0, 1, 1, 3))
QUESTION = "Summarize the document above in a few sentences."
NEW_TOKENS, QUICK_NEW_TOKENS = 32, 16
TIE_ULPS = 4  # a greedy divergence this close to a tie is rounding, not a broken decoder
CUDA_TOLERANCE = 1e-3  # fp32 logits, CPU against CUDA kernels (different summation orders)


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # "pass", "fail" or "skip"
    what: str  # what was checked, one line
    detail: str  # the figures behind the verdict, or why it was skipped
    seconds: float


def all_passed(results: list[CheckResult]) -> bool:
    return all(result.status != "fail" for result in results)


def run_selftest(engine, quick: bool = False,
                 on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Every check, in order: the rules, then the engine's modes, then the GPU paths.
    `on_result` sees each result as it ends (the CLI prints them as they come)."""
    checks: list[Callable[[], CheckResult]] = [chain_rule_enumeration, tree_rule_enumeration, sampled_chi_square]
    reference = PlainReference(engine, QUICK_NEW_TOKENS if quick else NEW_TOKENS)
    checks += [lambda mode=mode: greedy_identity(engine, mode, reference) for mode in engine_modes(engine)]
    checks += [cuda_forward, offloaded_cache]
    results = []
    for check in checks:
        result = check()
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _timed(name: str, what: str, body: Callable[[], tuple[bool | None, str]]) -> CheckResult:
    """Run `body` -> (passed, detail), passed None for a skip; an exception is a failure."""
    started = time.perf_counter()
    try:
        passed, detail = body()
    except Exception as error:  # a crash in the code under test is a failed check, not a traceback
        passed, detail = False, f"raised {type(error).__name__}: {first_line(error)}"
    status = "skip" if passed is None else "pass" if passed else "fail"
    return CheckResult(name, status, what, detail, time.perf_counter() - started)


# ---- exact enumeration of the verification rules --------------------------------------------


def chain_rule_enumeration() -> CheckResult:
    def body():
        error = transport = 0.0
        for seed in range(ENUMERATION_CASES):
            p, q = random_case(seed, CHAIN_VOCAB)
            emitted, accepted = chain_outcome(p, q)
            error = max(error, float((emitted - p).abs().max()))
            transport = max(transport, abs(accepted - (1 - total_variation(p, q))))
        worst = max(error, transport)
        return worst <= EXACT_TOLERANCE, (f"max |emitted - P| {error:.1e}, max |acceptance - (1 - TV)| "
                                          f"{transport:.1e} over {ENUMERATION_CASES} (P, Q) pairs")
    return _timed("chain-rule", f"chain verification emits exactly P (enumeration, {CHAIN_VOCAB} tokens)", body)


def tree_rule_enumeration() -> CheckResult:
    def body():
        error = transport = 0.0
        for seed in range(ENUMERATION_CASES):
            p, q = random_case(seed, TREE_VOCAB)
            for k in range(1, TREE_VOCAB):
                emitted, accepted = drafted_outcome(p, q, k)
                error = max(error, float((emitted - p).abs().max()))
                if k == 1:  # one child: acceptance is the optimal transport 1 - TV(P, Q)
                    transport = max(transport, abs(accepted - (1 - total_variation(p, q))))
            # Deterministic children (prompt lookup, greedy top-k), repeats included.
            for children in ([seed % TREE_VOCAB], [0, 1, 0, 2], list(range(TREE_VOCAB))[::-1]):
                emitted, _ = node_outcome(p, None, children)
                error = max(error, float((emitted - p).abs().max()))
        worst = max(error, transport)
        return worst <= EXACT_TOLERANCE, (f"max |emitted - P| {error:.1e}, max |1-child acceptance - (1 - TV)| "
                                          f"{transport:.1e} over {ENUMERATION_CASES} (P, Q) pairs, 1-4 children")
    return _timed("tree-rule", "tree verification, children drawn without replacement, emits exactly P "
                  f"(enumeration, {TREE_VOCAB} tokens)", body)


# ---- chi-square of sampled verification -----------------------------------------------------


def toy_pair(seed: int, vocab: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy autoregressive target and draft: row t is the next-token distribution after token t
    (fp32 and warped, as verification receives them); the draft is the target plus noise, so that
    drafts are accepted at every level often enough, yet rejections are common."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=generator) * 2
    return warp(logits, params), warp(logits + torch.randn(vocab, vocab, generator=generator) * 1.5, params)


def chain_samples(draws: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two draft tokens from Q, verified by `verify_chain`; counts of the first two emitted
    tokens [vocab, vocab] and their exact distribution P(y1 | 0) P(y2 | y1)."""
    target, draft = toy_pair(7, CHAIN_VOCAB, SamplingParams(temperature=0.8))
    counts = torch.zeros(CHAIN_VOCAB, CHAIN_VOCAB)
    for _ in range(draws):
        x1 = int(torch.multinomial(draft[0], 1, generator=generator))
        x2 = int(torch.multinomial(draft[x1], 1, generator=generator))
        tokens = torch.tensor([x1, x2])
        verdict = verify.verify_chain(tokens, draft[[0, x1]], target[[0, x1, x2]], generator)
        emitted = tokens[:verdict.accepted].tolist() + [verdict.next_token]
        if len(emitted) < 2:  # the first draft was rejected: continue plainly from the recovered token
            emitted.append(int(torch.multinomial(target[emitted[0]], 1, generator=generator)))
        counts[emitted[0], emitted[1]] += 1
    return counts, target[0].double()[:, None] * target.double()


def tree_samples(draws: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A depth-3 tree drafted without replacement, verified by `verify_tree`; as `chain_samples`."""
    tree = SAMPLED_TREE
    target, draft = toy_pair(7, TREE_VOCAB, SamplingParams(temperature=0.8))
    counts = torch.zeros(TREE_VOCAB, TREE_VOCAB)
    for _ in range(draws):
        tokens = [0] * tree.size
        for node, children in enumerate(tree.children):  # breadth-first: a parent's token is set
            if children:
                drawn = sample_without_replacement(draft[tokens[node]], len(children), generator).tolist()
                for child, token in zip(children, drawn):  # Q has full support: every child drawn
                    tokens[child] = token
        ids = torch.tensor(tokens)
        verdict = verify.verify_tree(tree, ids, target[ids], draft[ids], generator)
        emitted = ids[verdict.path].tolist() + [verdict.next_token]
        if len(emitted) < 2:
            emitted.append(int(torch.multinomial(target[emitted[0]], 1, generator=generator)))
        counts[emitted[0], emitted[1]] += 1
    return counts, target[0].double()[:, None] * target.double()


def sampled_chi_square() -> CheckResult:
    def body():
        generator = torch.Generator().manual_seed(1234)
        chain = chi_square_p_value(*chain_samples(CHAIN_DRAWS, generator))
        tree = chi_square_p_value(*tree_samples(TREE_DRAWS, generator))
        return min(chain, tree) > CHI_SQUARE_LEVEL, (f"chi-square p-values: chain {chain:.3g} "
                                                     f"({CHAIN_DRAWS} draws), tree {tree:.3g} ({TREE_DRAWS} draws); "
                                                     f"pass above {CHI_SQUARE_LEVEL:g}, fixed seed")
    return _timed("sampled", "sampled chain and tree verification: the first two tokens follow the target's "
                  "joint distribution", body)


# ---- greedy identity of every decoding mode -------------------------------------------------


def document() -> str:
    """The shipped test document: sections 1-4 of the Apache License 2.0 (about 1.4K tokens)."""
    return resources.files(__package__).joinpath("selftest_document.txt").read_text(encoding="utf-8")


def engine_modes(engine) -> list[str]:
    """The modes compared with plain: chain, tree, triforce with its first stage, triforce with a
    tree as its final verification, auto."""
    return ["chain", "tree", "triforce", "triforce-tree", "auto"]


class PlainReference:
    """The prompt (the shipped document and a question) and plain greedy decoding's answer,
    computed once, by the first check that needs them."""

    def __init__(self, engine, new_tokens: int):
        self.engine, self.new_tokens = engine, new_tokens
        self._answer = None

    def get(self):
        if self._answer is None:
            prompt = self.engine.chat_ids([{"role": "user", "content": f"{document()}\n\n{QUESTION}"}])
            self._answer = prompt, _greedy(self.engine, prompt, "plain", self.new_tokens)
        return self._answer


def greedy_identity(engine, mode: str, reference: PlainReference) -> CheckResult:
    """Greedy `mode` on the shipped document must produce plain greedy decoding's tokens. A
    divergence where the target's two candidates tie to within rounding (bf16 on a GPU, say) is
    reported as such and passes: which one wins depends on the forward's shape, not on the
    decoder; a broken decoder diverges where the target clearly prefers plain's token."""
    label = {"triforce": f"triforce (first stage {engine.settings.triforce.draft or 'none'})",
             "triforce-tree": f"triforce with a {TRIFORCE_TREE.size}-node tree as final verification",
             "auto": f"auto (= {engine.auto_mode})"}.get(mode, mode)

    def body():
        prompt, plain = reference.get()
        triforce = replace(engine.settings.triforce, tree=TRIFORCE_TREE) if mode == "triforce-tree" else None
        engine.answers.clear()  # else the tree drafts plain's own answer back, and any verifier passes
        result = _greedy(engine, prompt, "triforce" if mode == "triforce-tree" else mode, reference.new_tokens,
                         triforce)
        stats = result.stats
        drafts = f"{stats.accepted_draft_tokens} of {stats.drafted_tokens} draft tokens accepted"
        if result.token_ids == plain.token_ids:
            return True, f"{len(plain.token_ids)} tokens identical; {drafts}"
        at = next((i for i, (a, b) in enumerate(zip(plain.token_ids, result.token_ids)) if a != b),
                  min(len(plain.token_ids), len(result.token_ids)))
        where = (f"at token {at} of {len(plain.token_ids)} (plain {plain.token_ids[at:at + 1]}, "
                 f"{mode} {result.token_ids[at:at + 1]}")
        if at == min(len(plain.token_ids), len(result.token_ids)):  # one of them ended its answer there
            return False, f"differs from plain {where}); {drafts}"
        gap, rounding = _logit_gap(engine, prompt + plain.token_ids[:at], plain.token_ids[at], result.token_ids[at])
        if abs(gap) <= rounding:
            return True, (f"identical up to a near tie {where}: their logits differ by {gap:.2g}, within the "
                          f"{rounding:.2g} that rounding in {engine.model.dtype} can flip); {drafts}")
        return False, f"differs from plain {where}, logit gap {gap:.2g}); {drafts}"
    return _timed(f"greedy-{mode}", f"greedy {label} equals plain decoding on the shipped document", body)


def _logit_gap(engine, ids: list[int], chosen: int, other: int) -> tuple[float, float]:
    """The target's next-token logit of `chosen` minus `other` after `ids`, and how much rounding
    in the model's dtype can move it (a few units in the last place of the largest logit): greedy
    decoding may then pick either, depending on the forward's shape (algorithms.md section 1)."""
    from .decoding import prefill_all

    model = engine.model
    logits = prefill_all(model, model.new_cache(), torch.tensor(ids, dtype=torch.long),
                         engine.settings.prefill_chunk).float()
    rounding = TIE_ULPS * torch.finfo(model.dtype).eps * float(logits.abs().max())
    return float(logits[chosen] - logits[other]), rounding


def _greedy(engine, prompt: list[int], mode: str, new_tokens: int, triforce=None):
    from .engine import Finished

    request = Request(new_tokens, SamplingParams(), mode, triforce if mode in ("auto", "triforce") else None)
    finished = [event for event in engine.generate(prompt, request) if isinstance(event, Finished)]
    return finished[-1].result


# ---- the GPU paths ---------------------------------------------------------------------------


def tiny_llama(seed: int = 0, vocab: int = 97):
    """A 2-layer Llama with random weights in fp32 on the CPU: the GPU checks' model (any real
    model's kernels are the same; this one fits anywhere and copies in no time)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .model import TransformersLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.random.fork_rng():  # the app's own random state stays as it was
        torch.manual_seed(seed)
        return TransformersLM(LlamaForCausalLM(config).to(torch.float32))


def _no_cuda() -> tuple[None, str] | None:
    if torch.cuda.is_available():
        return None
    return None, "no CUDA GPU here: the GPU paths are not used, nothing to check"


def _max_relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.cpu(), expected.cpu()  # logits stay on the device that computed them
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12))


def cuda_forward() -> CheckResult:
    def body():
        if (skip := _no_cuda()) is not None:
            return skip
        cpu = tiny_llama()
        cuda = tiny_llama()
        cuda.to("cuda")
        ids = (torch.arange(40) * 7 % 97).to(torch.long)
        expected = cpu.forward(ids, torch.arange(40), cpu.new_cache())
        got = cuda.forward(ids, torch.arange(40), cuda.new_cache())
        error = _max_relative_error(got, expected)
        return error <= CUDA_TOLERANCE, f"max relative logit difference {error:.1e} (tolerance {CUDA_TOLERANCE:g})"
    return _timed("cuda-forward", "a forward on the CUDA GPU equals the CPU's (fp32, 40 tokens)", body)


def offloaded_cache() -> CheckResult:
    """The offloaded full KV cache (host memory streamed per layer) against the one on the GPU:
    the same logits through appends, a rollback and a tree path's compaction."""
    def body():
        if (skip := _no_cuda()) is not None:
            return skip
        from .kv.offload import OffloadedCache

        model = tiny_llama()
        model.to("cuda")
        ids = (torch.arange(50) * 7 % 97).to(torch.long)
        full = model.new_cache()
        offloaded = OffloadedCache(model.config, 64, "cuda", model.dtype)
        error = 0.0
        for cache in (full, offloaded):
            model.forward(ids[:30], torch.arange(30), cache)
        for new in (ids[30:33], ids[33:34]):
            positions = torch.arange(full.length, full.length + len(new))
            error = max(error, _max_relative_error(model.forward(new, positions, offloaded),
                                                   model.forward(new, positions, full)))
        for cache in (full, offloaded):
            cache.trim(31)
            cache.keep(torch.tensor(list(range(29)) + [30]))  # drop position 29, as a tree path would
        new, positions = ids[40:45], torch.arange(30, 35)
        error = max(error, _max_relative_error(model.forward(new, positions, offloaded),
                                               model.forward(new, positions, full)))
        streamed = offloaded.fetched_bytes
        return error <= CUDA_TOLERANCE and streamed > 0, (f"max relative logit difference {error:.1e} "
                                                          f"(tolerance {CUDA_TOLERANCE:g}); {streamed:,} bytes streamed")
    return _timed("offloaded-kv", "the offloaded KV cache gives the in-GPU cache's logits (append, rollback, "
                  "tree compaction)", body)

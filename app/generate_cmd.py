"""`specchat generate`: one question (and a document) answered from the command line, checked
before the model loads; the mode options it takes (TriForce's stages, a tree's draft)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ..core.errors import InputError
from ..core.modes import MAX_DSI_WORKERS
from .session import cut_off_note, load, preset_question, request_from_args, sampling_params
from .terminal_text import for_terminal


def run(args) -> int:
    """`specchat generate`: one question answered, streamed to stdout or printed as one JSON object."""
    from .documents import document_tokens, read_document_or_text, read_text_file, user_turn

    # Check everything the user typed before the model loads: bad input fails in a second.
    params = sampling_params(args)
    triforce = checked_options(args)
    question = args.prompt if args.prompt is not None else \
        read_text_file(args.prompt_file) if args.prompt_file is not None else preset_question(args)
    document = read_document_or_text(args.document) if args.document else None
    content = user_turn(question, document)
    if not question.strip():
        raise InputError("the prompt is empty: give --prompt TEXT, a non-empty --prompt-file, or a --preset "
                         "with a question (summarize)")

    if args.draft_layers is not None and args.mode != "tree":
        raise InputError("--draft-layers goes with --mode tree")
    if args.cache_document and not (document and document.strip()):
        raise InputError("--cache-document needs a non-empty --document FILE")
    from ..core.engine import Finished, Notice, TextDelta
    from ..core.request import TreeDraft

    engine = load(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    prompt_ids = engine.chat_ids(system + [{"role": "user", "content": content}])
    triforce = _check_triforce(engine, triforce, args.triforce_verify, len(prompt_ids))
    saved_tokens = document_tokens(engine, system, document) if args.cache_document else 0
    draft = draft_for(engine, args.draft_layers) if args.mode == "tree" else None
    plan = _plan_tree_draft(engine, draft, params, len(prompt_ids)) if draft is not None else None
    result = None
    tree_draft = TreeDraft(*plan.tree_draft) if plan is not None and plan.tree_draft else None
    # TriForce's stages apply wherever the mode can be TriForce (auto included).
    options = tree_draft if args.mode == "tree" else triforce if args.mode in ("auto", "triforce") else None
    for event in engine.generate(prompt_ids, request_from_args(args, params, saved_tokens, options)):
        if isinstance(event, Notice):
            print(f"specchat: note: {for_terminal(event.text)}", file=sys.stderr)
        elif isinstance(event, TextDelta) and not args.json:
            sys.stdout.write(for_terminal(event.text))  # --json keeps the exact text
            sys.stdout.flush()
        elif isinstance(event, Finished):
            result = event.result
    if args.json:
        output = result.to_json()
        if plan is not None:
            output["tree_plan"] = {**asdict(plan.choice), "draft_cost": plan.draft_cost,
                                   "acceptance": list(plan.acceptance.p)}
        if args.mode in ("auto", "triforce") and triforce.tree is not None:  # measured t(n) may choose a small one
            output["triforce_tree"] = {"size": triforce.tree.size, "depth": triforce.tree.depth}
        print(json.dumps(output, ensure_ascii=False))
    else:
        stats = result.stats
        print(file=sys.stdout)
        print(f"[{result.new_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
              f"{stats.mean_accepted_per_forward:.2f} tokens per target forward, mode {result.mode}"
              f"{cut_off_note(result)}]", file=sys.stderr)
    return 0


def checked_options(args):
    """The options `generate` and `chat` share, checked before the model loads (bad input fails
    in a second, not after a load); TriForce's settings (`triforce_settings`)."""
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.dsi_workers is not None and args.mode != "dsi":
        raise InputError("--dsi-workers goes with --mode dsi")
    if args.dsi_workers is not None and not 1 <= args.dsi_workers <= MAX_DSI_WORKERS:
        raise InputError(f"--dsi-workers must be between 1 and {MAX_DSI_WORKERS}, got {args.dsi_workers}")
    if args.dsi_always and args.mode != "dsi":
        raise InputError("--dsi-always goes with --mode dsi")
    return triforce_settings(args)


def triforce_options(engine, args, settings, context: int):
    """TriForce's stages for requests whose mode can be TriForce (auto included), else None;
    the options checked against the loaded model either way."""
    checked = _check_triforce(engine, settings, args.triforce_verify, context)
    return checked if args.mode in ("auto", "triforce") else None


def triforce_settings(args):
    """`--triforce-draft` and `--retrieval-budget`, checked before the model loads."""
    import re

    from ..core.decoding import TriforceSettings

    draft = "" if args.triforce_draft == "none" else args.triforce_draft
    if draft not in ("", "lookup", "pair") and not re.fullmatch(r"skip[1-9][0-9]*", draft):
        raise InputError(f"--triforce-draft must be lookup, skipN (N layers), pair or none, got {args.triforce_draft!r}")
    settings = TriforceSettings(draft=draft, budget=args.retrieval_budget)
    if args.retrieval_budget < 2 * settings.chunk_size + settings.recent:
        raise InputError(f"--retrieval-budget must be at least {2 * settings.chunk_size + settings.recent}")
    return settings


def _check_triforce(engine, settings, verify: str | None, context: int):
    """The request's TriForce stages: the engine's (the plan's) gammas, window and final
    verification with the options given; `verify` "tree" makes the final verification the
    optimizer's Sequoia tree, "chain" a chain."""
    from dataclasses import replace

    from ..core.tree_choice import triforce_tree

    if settings.draft.startswith("skip"):
        check_draft_layers(engine, int(settings.draft[len("skip"):]), "the N of --triforce-draft skipN")
    if settings.draft == "pair" and engine.draft is None:
        raise InputError(f"--triforce-draft pair: {engine.name} has no draft model (use lookup or skipN)")
    chosen = replace(engine.settings.triforce, draft=settings.draft, budget=settings.budget)
    if verify is None:
        return chosen
    return replace(chosen, tree=triforce_tree(engine.settings, context) if verify == "tree" else None)


def check_draft_layers(engine, draft_layers: int, option: str = "--draft-layers") -> None:
    layers = engine.model.num_layers
    if not 1 <= draft_layers < layers:
        raise InputError(f"{option} must be between 1 and {layers - 1} for {engine.name}")


def draft_for(engine, draft_layers: int | None):
    """The draft a tree uses: `--draft-layers N` (layer skip), else the pair's draft model if it
    has one, else none (prompt-lookup branches)."""
    from ..core.calibration import layer_skip_draft, pair_draft

    if draft_layers is None:
        return pair_draft(engine)
    check_draft_layers(engine, draft_layers)
    return layer_skip_draft(engine, draft_layers)


def _plan_tree_draft(engine, draft, params, context: int):
    """Choose the draft tree for this prompt (measuring what it needs) and install it."""
    from ..core.calibration import plan_tree_draft

    print(f"Measuring the draft and the target at {context} tokens of context...", file=sys.stderr)
    plan = plan_tree_draft(engine, draft, params, context)
    print(f"Tree plan: {plan.choice.reason}", file=sys.stderr)
    return plan

"""`specchat bench`: the benchmark suites, each writing its JSON (and PNG) under bench/."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.errors import InputError


def add_parser(commands, add_model_option) -> None:
    """Add `bench` to the CLI's subparsers; `add_model_option` is the CLI's `--model` option."""
    bench = commands.add_parser("bench", help="side-by-side decoding benchmark -> bench/ (JSON, PNG)")
    add_model_option(bench)
    bench.add_argument("--document", metavar="FILE", help="the document to answer about (trees, prefill, longctx)")
    bench.add_argument("--prompt", default="Summarize this document.")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--draft-layers", type=int, default=24)
    bench.add_argument("--documents", nargs="+", metavar="FILE",
                       help="the documents of the auto suite (each answered with --prompt)")
    bench.add_argument("--suite",
                       choices=("trees", "prefill", "longctx", "offload", "auto", "yardstick", "peers", "dsi", "gpu"),
                       default="trees",
                       help="trees: decoding modes side by side (default); auto: every mode and auto on "
                            "several --documents, with the cost model's predictions; yardstick: tokens per "
                            "target forward of several drafters at 4-64 verified nodes, replayed on the greedy "
                            "answers to --documents (hardware-independent); peers: specchat plain and auto "
                            "against transformers' greedy generate and its prompt lookup on --documents; "
                            "prefill: time to first token for a first question, a follow-up and a reloaded "
                            "document; longctx: every mode including triforce on a long document; offload: a full "
                            "verification against a 128K offloaded KV cache on a CUDA GPU, random weights "
                            "of Llama-3.1-8B's shape (no document, no download); dsi: the DSI paper's simulation, "
                            "plain, SI and DSI over draft latency x acceptance with forwards replaced by waits "
                            "(no model); gpu: the GPU path measured whole (tests, selftest, decode steps, "
                            "quantized weights, offloaded KV, memory against the plan), random weights of "
                            "Llama-3.1-8B's shape")
    bench.add_argument("--sections", help="gpu: a comma-separated subset of its sections (default: all)")
    bench.add_argument("--dry-run", action="store_true",
                       help="gpu: rehearse every section on the CPU at toy shapes")
    bench.add_argument("--budget-s", type=float, default=480.0,
                       help="gpu: start no section after this many seconds (default 480)")
    bench.add_argument("--out", default="bench", help="folder for the results (default: bench)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="longctx, auto: measure every mode N times in shuffled rounds; report medians (default 1)")


def run(args, load, check_draft_layers) -> int:
    """Run the chosen suite; `load(args)` is the CLI's loader, `check_draft_layers(engine, n)` its
    check of --draft-layers."""
    from .documents import read_document_or_text, user_turn

    if args.suite == "offload":
        from ..benchmarks.report import write_report
        from ..benchmarks.offload import draw_offload, run_offload_bench

        for path in write_report(run_offload_bench(), Path(args.out), "gpu-offload", draw_offload):
            print(path)
        return 0
    if args.suite == "gpu":
        from ..benchmarks.gpu.campaign import parse_sections, run_campaign

        sections = parse_sections(args.sections)
        if args.budget_s <= 0:
            raise InputError(f"--budget-s must be positive, got {args.budget_s}")
        repo_root = Path(__file__).resolve().parent.parent  # the checkout: its tests/ feed the tests section
        for path in run_campaign(sections, args.dry_run, args.budget_s, Path(args.out), repo_root,
                                 lambda line: print(line, file=sys.stderr, flush=True)):
            print(path)
        return 0
    if args.suite == "dsi":
        from ..benchmarks.dsi import run_dsi_simulation

        for path in run_dsi_simulation(Path(args.out)):
            print(path)
        return 0
    if args.repeats < 1:
        raise InputError(f"--repeats must be at least 1, got {args.repeats}")
    if args.suite in ("auto", "yardstick", "peers"):
        return _bench_documents(args, load)
    if args.document is None:
        raise InputError(f"the {args.suite} suite needs --document FILE")
    document = read_document_or_text(args.document)
    engine = load(args)
    if args.suite == "prefill":
        from ..benchmarks.prefill import run_prefill_bench

        def messages_for(question: str, history: list[dict]) -> list[dict]:
            return history + [{"role": "user", "content": question if history else user_turn(question, document)}]

        paths = run_prefill_bench(engine, messages_for, args.max_new_tokens, Path(args.out))
    else:
        check_draft_layers(engine, args.draft_layers)
        from ..benchmarks.decode import run_bench
        from ..benchmarks.longctx import run_longctx_bench

        prompt_ids = engine.chat_ids([{"role": "user", "content": user_turn(args.prompt, document)}])
        if args.suite == "longctx":
            paths = run_longctx_bench(engine, prompt_ids, args.max_new_tokens, args.draft_layers, Path(args.out),
                                      args.repeats)
        else:
            paths = run_bench(engine, prompt_ids, args.max_new_tokens, args.draft_layers, Path(args.out))
    for path in paths:
        print(path)
    return 0


def _bench_documents(args, load) -> int:
    """The suites over several documents, each answered with --prompt: auto, yardstick and peers."""
    from .documents import read_document_or_text, user_turn

    if not args.documents:
        raise InputError(f"the {args.suite} suite needs --documents FILE [FILE ...]")
    texts = {Path(name).name: read_document_or_text(name) for name in args.documents}
    engine = load(args)
    prompts = {name: engine.chat_ids([{"role": "user", "content": user_turn(args.prompt, text)}])
               for name, text in texts.items()}
    if args.suite == "yardstick":
        from ..benchmarks.yardstick import run_yardstick

        paths = run_yardstick(engine, prompts, args.max_new_tokens, Path(args.out))
    elif args.suite == "peers":
        from ..benchmarks.peers import run_peers_bench

        peer = _as_transformers_ships_it(getattr(args, "model", "embedded"), engine)
        paths = run_peers_bench(engine, peer, prompts, args.max_new_tokens, args.repeats, Path(args.out))
    else:
        from ..benchmarks.auto import run_auto_bench

        paths = run_auto_bench(engine, prompts, args.max_new_tokens, args.repeats, Path(args.out))
    for path in paths:
        print(path)
    return 0


def _as_transformers_ships_it(model_id: str, engine):
    """The engine's weights loaded by transformers alone (its attention and linears), for the
    peers suite: the embedded model or a model directory."""
    from transformers import AutoModelForCausalLM

    from ..core import embedded

    if engine.name == embedded.EMBEDDED_ID:
        path = embedded.ensure_converted(lambda line: None)
    elif (Path(model_id) / "config.json").is_file():
        path = Path(model_id)
    else:
        raise InputError("the peers suite compares with transformers on the embedded model or a model directory "
                         f"(--model DIR), not a registry pair ({model_id!r})")
    return AutoModelForCausalLM.from_pretrained(path, dtype=engine.model.dtype).eval()

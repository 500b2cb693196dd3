"""The `specchat` command: its parser, and the dispatch to the app (default), `chat` and each
subcommand's module (`generate_cmd.py`, `bench_cmd.py`, `plan_cmd.py`, ...).

Public contract: `generate --json` prints exactly one JSON object (text, token_ids,
prompt_tokens, new_tokens, mode, finish_reason, stats, context_full); bad input prints one line to
stderr and exits with code 2. Extend it, never break it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from typing import NoReturn

from ..core.env_settings import SWITCH_ON, env_switch
from ..core.errors import InputError, SpecchatError, first_line
from ..core.modes import REQUEST_MODES
from .presets import PRESETS
from .session import context_of, load, model_id, registry, sampling_params, settle_preset
from .terminal_text import for_terminal

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2, without the usage dump,
    and takes options only in full (so `--mode` never passes for `--model`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specchat", description="Long-context chat with lossless speculative decoding.")
    _add_server_options(parser)
    commands = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    ui = commands.add_parser("ui", help="launch the chat app in a browser tab (the default)")
    _add_server_options(ui)

    generate = commands.add_parser("generate", help="answer one prompt and exit")
    source = generate.add_mutually_exclusive_group()  # one of them, or a --preset with a question
    source.add_argument("--prompt", help="the question or instruction")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 file")
    generate.add_argument("--document", metavar="FILE", help="a text file put ahead of the prompt")
    generate.add_argument("--cache-document", action="store_true",
                          help="save the document's KV on disk, so a later run with it skips its prefill")
    generate.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    generate.add_argument("--draft-layers", type=int, metavar="N",
                          help="with --mode tree: a draft of the target's first N layers (default: the "
                               "pair's draft model, if any), its tree chosen by the hardware-aware optimizer "
                               "(prompt-lookup branches if it does not pay)")
    _add_generation_options(generate)

    chat = commands.add_parser("chat", help="a conversation in the terminal")
    chat.add_argument("--document", metavar="FILE", help="a text file the conversation is about")
    chat.add_argument("--cache-document", action="store_true",
                      help="save the document's KV on disk, so a later chat with it skips its prefill")
    _add_generation_options(chat)

    calibrate = commands.add_parser(
        "calibrate", help="measure the model's step times on this machine again (the first use does it "
                          "once), and a draft's positional acceptance vector (for Sequoia trees)")
    _add_generation_options(calibrate, mode=False)
    calibrate.add_argument("--pair", dest="model", default=argparse.SUPPRESS,
                           help="the pair to calibrate (same as --model)")
    calibrate.add_argument("--draft-layers", type=int,
                           help="draft = the target's first N layers (layer-skip self-draft); default: "
                                "the pair's draft model, or 24 layers when the pair has none")
    calibrate.add_argument("--width", type=int, default=8, help="children measured per node")
    calibrate.add_argument("--json", action="store_true", help="print one JSON object")

    models = commands.add_parser("models", help="model pairs: list, download, remove")
    _add_models_file_option(models)
    models_commands = models.add_subparsers(dest="models_command", parser_class=_Parser, metavar="ACTION",
                                            required=True)
    listing = models_commands.add_parser("list", help="every pair: size, fit on this machine, downloaded or not")
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    download = models_commands.add_parser("download", help="download a pair from the Hugging Face Hub (resumes)")
    download.add_argument("pair", help="a pair id from `specchat models list`")
    download.add_argument("--token", help="Hugging Face token for gated models (default: HF_TOKEN or `hf auth login`)")
    remove = models_commands.add_parser("remove", help="delete a downloaded pair from the cache")
    remove.add_argument("pair", help="a pair id from `specchat models list`")
    for action in (listing, download, remove):
        _add_models_file_option(action)
    from .plan_cmd import add_parsers as add_plan_parsers
    add_plan_parsers(commands, _add_models_file_option)
    from .selftest_cmd import add_parser as add_selftest_parser
    add_selftest_parser(commands, _add_model_option)
    from .bench_cmd import add_parser as add_bench_parser
    add_bench_parser(commands, _add_model_option)
    for command in (parser, *commands.choices.values()):
        command.add_argument("--vram-limit", type=float, metavar="GB", default=argparse.SUPPRESS,
                             help="use at most this much of each GPU, e.g. to leave room for a game, or to try "
                                  "an 8 GB card's plan on a larger one (default: $SPECCHAT_VRAM_LIMIT, else all)")
        if "--precision" not in command._option_string_actions:  # `plan` declares its own
            command.add_argument("--precision", choices=("auto", "exact"), default=argparse.SUPPRESS,
                                 help="auto: the fastest of the model's own weights and KV, 4-bit weights and an "
                                      "8-bit KV (answers are exactly what the model as loaded writes); exact: the "
                                      "model's own precision wherever it fits (default: $SPECCHAT_PRECISION, else auto)")
    return parser


def _add_models_file_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-file", metavar="FILE", default=argparse.SUPPRESS,
                        help="a models.toml merged over the shipped registry (default: the user config "
                             "folder's models.toml, if any)")


def _add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=argparse.SUPPRESS,
                        help="a pair id from `specchat models list` (default: embedded) or a local "
                             "transformers model directory")
    parser.add_argument("--context", default=argparse.SUPPRESS, metavar="N",
                        help="plan and read the pair at N tokens of prompt and answer (32768, 32K; "
                             "default: its full context): a pair that does not fit may at a shorter one")
    _add_models_file_option(parser)


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=argparse.SUPPRESS,
                        help="address to bind (default 127.0.0.1: this computer only)")
    parser.add_argument("--port", type=_port, default=argparse.SUPPRESS, help="port (default 7860)")
    parser.add_argument("--no-browser", action="store_true", default=argparse.SUPPRESS,
                        help="do not open a browser tab")
    parser.add_argument("--api-key", default=argparse.SUPPRESS,
                        help="require this key on the page and every route: the /v1 API and Gradio's "
                             "(Authorization: Bearer KEY; the page asks for it once per browser) "
                             "(default: $SPECCHAT_API_KEY, else no key)")
    parser.add_argument("--allow-host", action="append", metavar="NAME", default=argparse.SUPPRESS,
                        help="also answer requests for this host name, e.g. behind a proxy (repeatable; "
                             "default: $SPECCHAT_ALLOWED_HOSTS, comma-separated; localhost and IP addresses "
                             "always; other names are refused against DNS rebinding)")
    _add_model_option(parser)


def _port(text: str) -> int:
    """A TCP port a server can listen on (argparse turns the error into its line and exit 2)."""
    if not (text.isdigit() and 1 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, got {text!r}")
    return int(text)


def _add_generation_options(parser: argparse.ArgumentParser, mode: bool = True) -> None:
    # The preset-able options default to None: `settle_preset` fills them from --preset, else
    # from GENERATION_DEFAULTS, so an option given on the command line always wins.
    _add_model_option(parser)
    if mode:
        parser.add_argument("--preset", choices=sorted(PRESETS),
                            help="the app's preset: its system prompt, sampling settings and repeat guard, and "
                                 "(summarize) its question when no prompt is given; options given explicitly win")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, help="default 1 (no filter)")
    parser.add_argument("--top-k", type=int, default=0, help="0 (default): no top-k filter")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", type=float,
                        help="a token the answer already holds: logit / R if > 0, * R if < 0 (1 = off, the "
                             "default; at most 2)")
    parser.add_argument("--frequency-penalty", type=float,
                        help="logit -= F x the token's count in the answer so far (-2 to 2, 0 = off, the default)")
    parser.add_argument("--presence-penalty", type=float,
                        help="logit -= P if the answer already holds the token (-2 to 2, 0 = off, the default)")
    parser.add_argument("--stop-repeats", action=argparse.BooleanOptionalAction,
                        help="end an answer that repeats a 12-token run 3 times, marked (stopped: repeating "
                             "itself) (default: off, on with a preset)")
    if mode:
        parser.add_argument("--mode", choices=REQUEST_MODES, default="auto",
                            help="plain decoding, chain or tree speculation, triforce (a draft, the target "
                                 "over a retrieval cache, the target over the full cache), dsi (drafting "
                                 "never waits: target instances verify in parallel), or auto (the plan's choice)")
        parser.add_argument("--triforce-draft", default="lookup", metavar="DRAFT",
                            help="with --mode triforce, the first stage: lookup (prompt lookup, default), "
                                 "skipN (the target's first N layers), pair (the pair's draft model) or none")
        parser.add_argument("--retrieval-budget", type=int, default=1024, metavar="N",
                            help="with --mode triforce, positions of the retrieval cache (default 1024)")
        parser.add_argument("--dsi-workers", type=int, metavar="N",
                            help="with --mode dsi, target instances as CPU processes standing in for GPUs "
                                 "(default: the plan's GPUs, else 2)")
        parser.add_argument("--dsi-always", action="store_true",
                            help="with --mode dsi, every token from the target instances, even where the cost "
                                 "model expects plain steps on the engine's own target to be faster (to measure "
                                 "DSI itself)")
        parser.add_argument("--triforce-verify", choices=("chain", "tree"),
                            help="with --mode triforce, the final verification against the full cache: a chain "
                                 "or the optimizer's Sequoia tree, grown by the retrieval stage (default: the "
                                 "plan's choice)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _set_vram_limit(args)
        _set_precision(args)
        env_switch("SPECCHAT_CALIBRATE", True)  # a bad value fails here, before anything loads
        settle_preset(args)
        context_of(args)  # a bad --context fails here, before anything loads
        if args.command == "generate":
            from .generate_cmd import run as run_generate
            return run_generate(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "bench":
            from .bench_cmd import run as run_bench
            from .generate_cmd import check_draft_layers
            return run_bench(args, load, check_draft_layers)
        if args.command in ("profile", "plan"):
            from .plan_cmd import run_plan, run_profile
            return run_profile(args) if args.command == "profile" else run_plan(args)
        if args.command == "selftest":
            from .selftest_cmd import run as run_selftest
            return run_selftest(args)
        if args.command == "models":
            from .models_cmd import run_models
            return run_models(args, registry(args))
        if args.command == "chat":
            from .generate_cmd import checked_options
            from .terminal import run_chat, read_chat_document
            triforce = checked_options(args)  # bad options and a bad file fail before the model loads
            document = read_chat_document(args)
            return run_chat(load(args), args, document, triforce=triforce)
        from .key_attempts import checked_api_key

        hosts = allowed_hosts(args)  # a bad name, registry or --models-file fails here, before the server
        api_key = checked_api_key(args.api_key if hasattr(args, "api_key") else os.environ.get("SPECCHAT_API_KEY"))
        registry(args)
        from ..core.embedded import cache_root
        from .uploads import use_own_upload_folder

        use_own_upload_folder(cache_root())  # before gradio is imported
        from .server import launch
        host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 7860)

        def load_for_app(model, progress):
            engine = load(args, model, progress=progress, calibrate_when_idle=True)
            print(f"specchat: ready: {engine.name} answers at http://{host}:{port}/", file=sys.stderr)
            return engine

        launch(load_for_app, model_id(args), getattr(args, "models_file", None),
               host=host, port=port,
               open_browser=not getattr(args, "no_browser", False),
               api_key=api_key,
               allowed_hosts=hosts)
        return 0
    except SpecchatError as error:
        print(f"specchat: error: {for_terminal(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("specchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`specchat profile | head -1`): nothing to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush stays quiet
        return EXIT_FAILURE
    except Exception as error:  # the last line of defence: one line, never a traceback
        if os.environ.get("SPECCHAT_DEBUG", "").strip().lower() in SWITCH_ON:
            raise
        print(f"specchat: unexpected error: {type(error).__name__}: {for_terminal(first_line(error))} "
              "(set SPECCHAT_DEBUG=1 for details)", file=sys.stderr)
        return EXIT_FAILURE


def _set_precision(args) -> None:
    """--precision reaches every plan through the environment (the app's Models tab, loading, worker
    processes), and a bad $SPECCHAT_PRECISION fails here, before anything loads."""
    from ..core.planning import PRECISION_ENV, precision_setting

    if hasattr(args, "precision"):
        os.environ[PRECISION_ENV] = precision_setting(args.precision)
    precision_setting()


def _set_vram_limit(args) -> None:
    """--vram-limit reaches every part through the environment (worker processes included), and
    a bad value fails here, before anything loads."""
    from ..core.hardware import VRAM_LIMIT_ENV, vram_limit_bytes

    if hasattr(args, "vram_limit"):
        os.environ[VRAM_LIMIT_ENV] = f"{args.vram_limit:g}"
    vram_limit_bytes()


def allowed_hosts(args) -> list[str]:
    """--allow-host names and $SPECCHAT_ALLOWED_HOSTS, checked before the server starts."""
    from .security import allowed_host

    given = [*getattr(args, "allow_host", []), *os.environ.get("SPECCHAT_ALLOWED_HOSTS", "").split(",")]
    return [allowed_host(name) for name in given if name.strip()]


def _calibrate(args) -> int:
    params = sampling_params(args)
    if args.width < 1 or args.max_new_tokens < 1:
        raise InputError("--width and --max-new-tokens must be at least 1")
    engine = load(args)
    from ..core.calibration import calibrate
    from ..core.step_calibration import calibrated_step_times

    from .generate_cmd import draft_for

    draft = draft_for(engine, args.draft_layers) or draft_for(engine, min(24, engine.model.num_layers - 1))
    calibrated_step_times(engine.model, engine.calibration_key, engine.context_length,
                          lambda line: print(line, file=sys.stderr), refresh=True)
    vector, path = calibrate(engine, draft, params, args.width, args.max_new_tokens)
    if args.json:
        print(json.dumps({"models": vector.models, "p": vector.p, "positions": vector.positions,
                          "file": str(path)}))
    else:
        print(f"{vector.models}: p = {', '.join(f'{p:.3f}' for p in vector.p)} "
              f"({vector.positions} positions, sum {sum(vector.p):.3f})\nsaved to {path}")
    return 0


def _exit_now(code: int) -> NoReturn:
    """End the process without tearing its modules down one by one: after the app's server
    stopped, freeing torch's and Gradio's module graphs took over a second of a Ctrl-C. The exit
    handlers still run (temporary folders, locks, worker processes)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, or a stream already closed
            pass
    os._exit(code)


def entry_point() -> None:
    _exit_now(main())


if __name__ == "__main__":  # `python -m specchat.app.cli`, as the `specchat` command
    entry_point()

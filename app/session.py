"""What the CLI's subcommands, the terminal chat and the page share: the model to load and the
sampling settings read from parsed arguments, the engine loaded with progress lines, and the note
on a cut-off answer. It imports nothing from cli.py, so the subcommands depend on it, not on cli."""

from __future__ import annotations

import sys

from ..core.errors import InputError


def model_id(args) -> str:
    """`--model` may come before or after the subcommand."""
    return getattr(args, "model", "embedded")


def context_of(args) -> int | None:
    """`--context` in tokens, None when not given."""
    from .plan_cmd import parse_context

    return parse_context(args.context) if hasattr(args, "context") else None


# What the sampling options are when neither the command line nor a --preset sets them.
GENERATION_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                       "presence_penalty": 0.0, "stop_repeats": False}


def settle_preset(args) -> None:
    """Fill the sampling options and the system prompt left unset on the command line from
    `--preset` (as the app's preset menu sets them), else from GENERATION_DEFAULTS."""
    from .presets import PRESETS

    preset = PRESETS[args.preset] if getattr(args, "preset", None) else None
    for name, default in GENERATION_DEFAULTS.items():
        if getattr(args, name, default) is None:
            setattr(args, name, getattr(preset, name) if preset else default)
    if preset and preset.system and getattr(args, "system", None) is None:
        args.system = preset.system


def preset_question(args) -> str:
    """The preset's question (summarize: "Summarize this document."), "" without one."""
    from .presets import PRESETS

    return PRESETS[args.preset].question if getattr(args, "preset", None) else ""


def sampling_params(args):
    """The sampling options; the repetition controls where the subcommand has them (off otherwise)."""
    from ..core.sampling import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                              repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                              frequency_penalty=getattr(args, "frequency_penalty", 0.0),
                              presence_penalty=getattr(args, "presence_penalty", 0.0),
                              stop_repeats=getattr(args, "stop_repeats", False))
    except ValueError as error:
        raise InputError(str(error)) from None


def request_from_args(args, sampling, document_tokens: int = 0, options=None):
    """The engine request of `generate` and the terminal chat: --max-new-tokens, --mode, the
    sampling options (`sampling_params`), and dsi mode's --dsi-workers and --dsi-always; other
    modes' options (a tree draft, TriForce's stages) as `options`."""
    from ..core.request import DsiOptions, Request

    if args.mode == "dsi":
        options = DsiOptions(args.dsi_workers, plain_steps=not args.dsi_always)
    return Request(args.max_new_tokens, sampling, args.mode, options, document_tokens)


def registry(args):
    """The registry with `--models-file` (given before or after the subcommand) merged in."""
    from ..core.registry import load_registry

    return load_registry(getattr(args, "models_file", None))


def load(args, model: str | None = None, progress=None, calibrate_when_idle: bool = False):
    """The engine for `model` (default: `--model`); progress lines go to stderr, and to
    `progress` when given (the app's status line). `calibrate_when_idle`: the app's load, which
    leaves a first calibration to the engine's idle time (step_calibration.IdleCalibration)."""
    from .models_cmd import ProgressLine

    reg = registry(args)  # a bad registry fails before transformers is imported
    quiet_transformers()
    from ..core.loading import load_engine

    def report(message: str) -> None:
        print(message, file=sys.stderr)
        if progress is not None:
            progress(message)

    # --context is for the model named at the start; a pair the app switches to later loads whole.
    context = context_of(args) if model in (None, model_id(args)) else None
    return load_engine(model or model_id(args), progress=report,
                       registry=reg, download_progress=ProgressLine(), context=context,
                       calibrate_when_idle=calibrate_when_idle)


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def cut_off_note(result) -> str:
    """For an answer's end line: which limit cut it off, since finish_reason "length" says it for
    both (the answer limit, or the model's context with no room left); or the repeat guard."""
    if result.finish_reason == "repeating":
        return ", stopped: repeating itself"
    if result.finish_reason != "length":
        return ""
    return ", cut off: the context is full" if result.context_full else ", cut off at the answer limit"

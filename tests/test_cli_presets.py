"""`--preset NAME` on generate and chat: the app's preset settings, each overridden by an option given."""

import argparse
import json

from test_cli import assert_bad_input, specchat

from specchat.app.cli import build_parser
from specchat.app.presets import PRESETS
from specchat.app.session import preset_question, sampling_params, settle_preset


def settled(*argv) -> argparse.Namespace:
    args = build_parser().parse_args(["generate", *argv])
    settle_preset(args)
    return args


def test_a_preset_sets_what_the_command_line_leaves_unset():
    summarize = PRESETS["summarize"]
    args = settled("--preset", "summarize", "--document", "x.txt")
    assert args.system == summarize.system and preset_question(args) == summarize.question
    assert sampling_params(args) == summarize.sampling()
    assert (args.temperature, args.top_p, args.repetition_penalty, args.stop_repeats) == (0.7, 0.9, 1.1, True)


def test_options_given_win_over_the_preset():
    args = settled("--preset", "summarize", "--prompt", "hi", "--temperature", "0", "--system", "",
                   "--repetition-penalty", "1", "--no-stop-repeats")
    assert (args.temperature, args.top_p, args.repetition_penalty, args.stop_repeats) == (0.0, 0.9, 1.0, False)
    assert args.system == ""  # an empty --system is a choice too: no system prompt


def test_without_a_preset_the_defaults_are_unchanged():
    args = settled("--prompt", "hi")
    assert (args.temperature, args.top_p, args.repetition_penalty, args.frequency_penalty, args.presence_penalty,
            args.stop_repeats, args.system) == (0.0, 1.0, 1.0, 0.0, 0.0, False, None)
    assert settled("--prompt", "hi", "--stop-repeats").stop_repeats is True


def test_a_preset_without_a_question_still_needs_a_prompt():
    assert_bad_input(specchat("generate", "--preset", "answer"), "prompt is empty", "--preset")
    assert_bad_input(specchat("generate", "--preset", "frobnicate", "--prompt", "hi"), "invalid choice")


def test_the_preset_answers_as_its_settings_given_by_hand(tiny_model_dir, tmp_path):
    """The same seed gives the same tokens with --preset summarize as with its settings spelled
    out, and other tokens without them (the test fails if the preset is not applied)."""
    document = tmp_path / "doc.txt"
    document.write_text("The river rises in the hills and runs to the sea past three towns. " * 4)
    summarize = PRESETS["summarize"]
    common = ("generate", "--model", tiny_model_dir, "--document", document, "--json", "--max-new-tokens", "24",
              "--seed", "1")
    by_preset = specchat(*common, "--preset", "summarize")
    by_hand = specchat(*common, "--prompt", summarize.question, "--system", summarize.system, "--temperature", "0.7",
                       "--top-p", "0.9", "--repetition-penalty", "1.1", "--stop-repeats")
    plain = specchat(*common, "--prompt", summarize.question)
    for completed in (by_preset, by_hand, plain):
        assert completed.returncode == 0, completed.stderr
    tokens = [json.loads(completed.stdout)["token_ids"] for completed in (by_preset, by_hand, plain)]
    assert tokens[0] == tokens[1] != tokens[2]

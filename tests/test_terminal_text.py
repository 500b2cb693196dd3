"""Nothing from a model, a file name or a request reaches the operator's terminal as a control
sequence (app/terminal_text.py): not the chat's streamed answer, not a `generate` error line."""

from __future__ import annotations

import io

from test_cli import assert_bad_input, specchat
from test_terminal import chat_args

from specchat.app.terminal import run_chat
from specchat.app.terminal_text import for_terminal
from specchat.core.engine import TextDelta

HOSTILE = "red\x1b[31m text\x1b]0;owned\x07 \x9b2J back\rover \u202etxt.exe\u2066 tab\there\nline"


def test_controls_and_direction_overrides_go_and_tabs_and_newlines_stay():
    assert for_terminal(HOSTILE) == "red[31m text]0;owned 2J backover txt.exe tab\there\nline"
    assert for_terminal("Plain text, ünïcode 東京.") == "Plain text, ünïcode 東京."


class _EngineSpeakingEscapes:
    """What a model that emits ESC looks like to the chat loop (from a folder with one in its name)."""

    name = "/models/\x1b]0;title\x07tiny"

    def chat_ids(self, messages):
        return [1, 2, 3]

    def generate(self, ids, request):
        yield TextDelta(HOSTILE, [], None)


def test_the_terminal_chat_prints_no_control_character():
    stdout = io.StringIO()
    run_chat(_EngineSpeakingEscapes(), chat_args(), stdin=io.StringIO("Hello\n/exit\n"), stdout=stdout)
    printed = stdout.getvalue()
    assert "txt.exe" in printed and "/models/]0;titletiny" in printed and "\x1b[31m" not in printed and "\u202e" not in printed and "\x9b" not in printed


def test_a_file_name_with_escapes_is_named_without_them(tmp_path):
    completed = specchat("generate", "--prompt", "Hi", "--document", tmp_path / "\x1b[2Jmissing.txt", timeout=120)
    assert_bad_input(completed, "missing.txt")
    assert "\x1b" not in completed.stderr

"""An edited question is the question as written with the user's changes: the chat's edit box
starts from the inert text it shows (`&lt;` for `<`, `[image: ` for `![`), which must never
become what the model reads."""

import pytest

from specchat.app.conversation import LEFT_OUT, attachment_label
from specchat.app.edited_question import edited_question
from specchat.app.safe_markdown import inert_markdown

WRITTEN = "What does <b>bold</b> do, and what is ![cat](x.png) please?"
SHOWN = inert_markdown(WRITTEN)


def test_the_shown_text_is_not_the_written_one():  # else the tests below could not fail
    assert "&lt;b>" in SHOWN and "[image: cat]" in SHOWN


@pytest.mark.parametrize("change, expected", [
    (lambda shown: shown, WRITTEN),
    (lambda shown: shown.replace("please?", "thanks."), WRITTEN.replace("please?", "thanks.")),
    (lambda shown: shown.replace("What does", "Why does"), WRITTEN.replace("What does", "Why does")),
    (lambda shown: shown.replace("&lt;b>bold&lt;/b>", "nothing"), WRITTEN.replace("<b>bold</b>", "nothing")),
    (lambda shown: shown.replace("&lt;b>", ""), WRITTEN.replace("<b>", "")),
    (lambda shown: shown + " And <i>this</i>?", WRITTEN + " And <i>this</i>?"),  # typed: taken as typed
])
def test_an_edit_changes_only_what_the_user_changed(change, expected):
    assert edited_question(WRITTEN, SHOWN, change(SHOWN)) == expected


def test_the_attachment_line_and_the_left_out_mark_are_the_chats_not_the_question():
    label = attachment_label({"name": "report.pdf", "text": "…", "tokens": 3, "note": ""})
    shown = f"{label}\n\n{SHOWN}\n\n{LEFT_OUT}"
    assert edited_question(WRITTEN, shown, shown.replace("please", "now")) == WRITTEN.replace("please", "now")


def test_code_keeps_its_characters_and_a_new_question_is_the_text_typed():
    written = "Use `a<b` and <i>x</i>"
    shown = inert_markdown(written)
    assert edited_question(written, shown, shown.replace("x", "y")) == "Use `a<b` and <i>y</i>"
    assert edited_question("", "", " new text ") == "new text"

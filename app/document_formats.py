"""Readers for the document formats that are not plain text: bytes in, text out.

Each raises `InputError` naming the file when it cannot be read. pypdf and python-docx are imported
inside the readers so that starting the app does not pay for them.

Each reader counts its text as it comes out (PDF pages, .docx paragraphs, HTML text) against
`DOCUMENT_TEXT` and stops at the limit, so a small file that inflates to gigabytes of text costs
no more than the limit; a .docx is also refused up front when its archive declares more than a
document within the limit can need.
"""

from __future__ import annotations

import io
import logging
import re
import zipfile
from html.parser import HTMLParser
from pathlib import Path

from ..core.errors import InputError, first_line
from ..core.files import human_size
from ..core.limits import DOCUMENT_FILE, DOCUMENT_TEXT

# A .docx is XML around its text: Word writes well under 10 bytes of XML per byte of text, so an
# archive may unpack to its file limit (pictures) plus this many times the text limit.
XML_PER_TEXT_BYTE = 10
# A member this large that inflates more than RATIO_LIMIT-fold is a zip bomb, not a document:
# Word's XML deflates 5- to 20-fold, pictures hardly at all.
BOMB_MEMBER_BYTES = 10**6
RATIO_LIMIT = 200
UNPACK_CHUNK = 1 << 20
HTML_CHUNK = 1 << 20  # characters fed to the HTML parser between two looks at the count
TEXTLESS_PAGES = re.compile(r"^\[pages? (\d+)(?:-(\d+))? of (\d+): no text to read \(", re.MULTILINE)


class TextBudget:
    """The text a reader has produced so far, in UTF-8 bytes, against `DOCUMENT_TEXT`."""

    def __init__(self, path: Path):
        self.path = path
        self.limit = DOCUMENT_TEXT.bytes
        self.used = 0

    def counted(self, text: str, separator: int = 1) -> str:
        """`text`, once it is counted with the `separator` bytes that will join it to the next."""
        self.used += (len(text) if text.isascii() else len(text.encode("utf-8"))) + separator
        if self.used > self.limit:
            DOCUMENT_TEXT.check(self.used, f"the text of {self.path} (read until it passed the limit)")
        return text


def pdf_text(data: bytes, path: Path) -> str:
    """The text of every page, pages separated by a blank line ("" for a PDF without pages)."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its repair notes on stderr would bury our one line
    budget = TextBudget(path)  # pypdf itself caps each stream it inflates (75 MB): one page stays bounded
    try:
        pages = [budget.counted(page.extract_text().strip(), separator=2)  # pages join with a blank line
                 for page in PdfReader(io.BytesIO(data)).pages]
    except InputError:
        raise
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
    return "\n\n".join(_with_textless_marked(pages))


def _with_textless_marked(pages: list[str]) -> list[str]:
    """The pages' texts, each run of pages without text one line saying so: the model and the
    reader learn that something was not read (`textless_note`), instead of losing it silently."""
    texts, empty_from = [], None
    for number, text in enumerate([*pages, "end"], start=1):
        if not text and empty_from is None:
            empty_from = number
        elif text and empty_from is not None:
            pages_named = f"page {empty_from}" if empty_from == number - 1 else f"pages {empty_from}-{number - 1}"
            texts.append(f"[{pages_named} of {len(pages)}: no text to read (a scanned image, a figure, or blank)]")
            empty_from = None
        if text and number <= len(pages):
            texts.append(text)
    return texts


def textless_note(text: str) -> str:
    """" ⚠️ N of M PDF pages have no text…" when the text marks pages without text, else ""."""
    runs = TEXTLESS_PAGES.findall(text)
    if not runs:
        return ""
    count = sum(int(last or first) - int(first) + 1 for first, last, _ in runs)
    return (f" ⚠️ {count} of {runs[0][2]} pages have no text (scanned images or figures?): they are not read; "
            "run OCR on the PDF to include them.")


def docx_text(data: bytes, path: Path) -> str:
    """Paragraphs and tables in document order; a table row becomes one line of tab-separated cells."""
    import docx
    from docx.table import Table

    budget = TextBudget(path)
    try:
        blocks = docx.Document(_repacked(data, path)).iter_inner_content()
        lines = [budget.counted(_table_text(block) if isinstance(block, Table) else block.text) for block in blocks]
    except InputError:
        raise
    except Exception as error:  # not a zip, missing parts, bad XML: all mean an unusable file
        raise InputError(f"cannot read {path}: it is not a valid .docx file ({_reason(error)}); an old .doc "
                         "or a password-protected file must be re-saved as .docx first") from None
    return "\n".join(lines)


def _repacked(data: bytes, path: Path) -> io.BytesIO:
    """The .docx archive with its members inflated into an uncompressed copy, for python-docx.

    Its members' declared sizes are checked first. They bind only this way: zipfile cuts a member
    at its declared size but inflates a whole read() in one call, so python-docx reading the
    original would hold all of a member whose header lies before the cut. Inflating here chunk by
    chunk stops at the declared size with the memory of one chunk.
    """
    copy = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as archive, zipfile.ZipFile(copy, "w", zipfile.ZIP_STORED) as stored:
        members = [member for member in archive.infolist() if not member.is_dir()]
        _check_declared_sizes(members, path)
        for member in members:
            with archive.open(member) as source, stored.open(member.filename, "w") as target:
                while chunk := source.read(UNPACK_CHUNK):
                    target.write(chunk)
    copy.seek(0)
    return copy


def _check_declared_sizes(members: list[zipfile.ZipInfo], path: Path) -> None:
    """Refuse an archive that declares more than a document within the limits can need, or a
    member that inflates like a zip bomb, before anything is inflated."""
    declared = sum(member.file_size for member in members)
    allowed = DOCUMENT_FILE.bytes + XML_PER_TEXT_BYTE * DOCUMENT_TEXT.bytes
    if declared > allowed:
        raise InputError(f"{path} unpacks to {human_size(declared)}, more than a document within the "
                         f"{DOCUMENT_TEXT.name} limit of {human_size(DOCUMENT_TEXT.bytes)} can need "
                         f"({human_size(allowed)}; set {DOCUMENT_TEXT.variable} in MB to change it)")
    for member in members:
        if member.file_size > BOMB_MEMBER_BYTES and member.file_size > RATIO_LIMIT * max(member.compress_size, 1):
            raise InputError(f"{path} is not a usable .docx: its part {member.filename} inflates "
                             f"{member.file_size // max(member.compress_size, 1):,}-fold to "
                             f"{human_size(member.file_size)} (a zip bomb?)")


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

    def __init__(self, budget: TextBudget) -> None:
        super().__init__(convert_charrefs=True)
        self.budget = budget
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
            self.parts.append(self.budget.counted(data, separator=0))


def html_text(markup: str, path: Path) -> str:
    """Visible text of an HTML page: one line per block, at most one blank line in a row."""
    parser = _VisibleText(TextBudget(path))
    for start in range(0, len(markup), HTML_CHUNK):  # the parser holds back only an unfinished tag
        parser.feed(markup[start:start + HTML_CHUNK])
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")

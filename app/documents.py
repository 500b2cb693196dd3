"""Text that people hand to specchat: prompt and document files, and how a document joins a turn.

Every file is measured before it is read and read no further than its limit (`core.limits`): a
plain-text file is its own text, so `DOCUMENT_TEXT` bounds it; a PDF, .docx or HTML file is bound by
`DOCUMENT_FILE`, its readers count the text they produce, and they run in a process of their own
with a time and memory limit (document_worker.py).
"""

from __future__ import annotations

import codecs
import os
import re
from pathlib import Path

from ..core.errors import InputError
from ..core.limits import DOCUMENT_FILE, DOCUMENT_TEXT, Limit
from .document_formats import docx_text, html_text, pdf_text
from .document_worker import read_in_worker

TEXT_SUFFIXES = (".txt", ".md")
DOCUMENT_SUFFIXES = (".txt", ".md", ".pdf", ".docx", ".html", ".htm")
READ_CHUNK = 1 << 20


def read_document(path: str | Path) -> str:
    """The text of a document in any of `DOCUMENT_SUFFIXES`, or an `InputError` naming the file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in DOCUMENT_SUFFIXES:
        raise InputError(f"cannot read {path}: {suffix or 'a file without a suffix'} is not a supported "
                         f"document type; use one of {', '.join(DOCUMENT_SUFFIXES)}")
    if suffix == ".pdf":
        text = read_in_worker(pdf_text, read_bytes(path, DOCUMENT_FILE), path)
    elif suffix == ".docx":
        text = read_in_worker(docx_text, read_bytes(path, DOCUMENT_FILE), path)
    elif suffix in (".html", ".htm"):
        text = read_in_worker(html_bytes_text, read_bytes(path, DOCUMENT_FILE), path)
    else:
        text = read_text_file(path)
    if not text.strip():
        raise InputError(f"{path} is empty: give a document that contains some text")
    return text


def html_bytes_text(data: bytes, path: Path) -> str:
    """An HTML file's visible text (decoded in the reader's process too), in the encoding its
    `<meta charset>` declares where it is not UTF-8 (older pages are often windows-1252)."""
    declared = HTML_CHARSET.search(data[:HTML_CHARSET_BYTES])
    return html_text(_decode(data, path, declared.group(1).decode("ascii") if declared else None), path)


def read_document_or_text(path: str | Path) -> str:
    """A document given on the command line: the formats above by suffix, any other file as
    plain text (a .log or a file without a suffix is fine; a binary one gets a clear error)."""
    return read_document(path) if Path(path).suffix.lower() in DOCUMENT_SUFFIXES else read_text_file(path)


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of a file, or an `InputError` that says what is wrong with it."""
    path = Path(path)
    return _decode(read_bytes(path, DOCUMENT_TEXT), path)


def _decode(data: bytes, path: Path, declared: str | None = None) -> str:
    """Text by its byte-order mark (Windows Notepad's "Unicode" is UTF-16), else UTF-8, else the
    encoding the file declares (`declared`, HTML's)."""
    for mark, codec in BYTE_ORDER_MARKS:
        if data.startswith(mark):
            try:
                return data[len(mark):].decode(codec)
            except UnicodeDecodeError as error:
                raise InputError(f"{path} starts as {codec} text but is not (bad bytes at offset "
                                 f"{error.start + len(mark)}): save it as UTF-8 and try again") from None
    if b"\x00" in data:
        raise InputError(f"{path} looks like a binary file, not text: give a text file (UTF-8 or UTF-16)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        problem = f"{path} is not UTF-8 text (bad byte at offset {error.start})"
    if declared and declared.lower().replace("_", "-") not in ("utf-8", "utf8"):
        try:
            return data.decode(declared)
        except LookupError:
            problem += f", and it declares an encoding unknown here ({declared})"
        except UnicodeDecodeError as error:
            problem = f"{path} is not {declared} text as it declares (bad byte at offset {error.start})"
    raise InputError(f"{problem}: save it as UTF-8 and try again")


# Longest first: UTF-32's little-endian mark starts with UTF-16's.
BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
                    (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
# <meta charset="x"> or <meta http-equiv="Content-Type" content="text/html; charset=x">, where
# browsers look for it: near the top.
HTML_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9._:-]{1,40})""", re.IGNORECASE)
HTML_CHARSET_BYTES = 4096


def read_bytes(path: Path, limit: Limit) -> bytes:
    """The bytes of a file within `limit`, or an `InputError` that says why it cannot be read. The
    size is checked before reading, and the read stops past the limit anyway: a pipe or a device
    (/dev/zero) reports no size, and a file can grow while it is read."""
    try:
        with path.open("rb") as file:
            limit.check(os.fstat(file.fileno()).st_size, str(path))
            chunks, size, most = [], 0, limit.bytes
            # In chunks: one read of the whole limit would reserve all of it for every file.
            while chunk := file.read(min(READ_CHUNK, most + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
                limit.check(size, f"{path} (read until it passed the limit)")
        return b"".join(chunks)
    except FileNotFoundError:
        raise InputError(f"cannot read {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"cannot read {path}: it is a folder, not a file") from None
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None


def well_formed(text: str) -> str:
    """`text` with each unpaired surrogate as U+FFFD: a browser's string can hold half an emoji
    (text cut inside one), and no tokenizer takes it."""
    if not has_unpaired_surrogate(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def has_unpaired_surrogate(text: str) -> bool:
    """At C speed (a document can be megabytes, checked as it is typed beside): only an unpaired
    surrogate stops a string from encoding as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def user_turn(question: str, document: str | None) -> str:
    """The user message: the document first, then the question about it."""
    question = question.strip()
    if document and document.strip():
        return f"{document.strip()}\n\n{question}" if question else document.strip()
    return question


def document_tokens(engine, before: list[dict], document: str) -> int:
    """How many leading prompt tokens hold the document, for a question that carries it after
    `before` (the system prompt, earlier turns: what the model reads ahead of that question):
    the prompts of two different questions, and of the document without one (its question left
    out), agree up to the end of the document, so every form of the turn shares one saved file."""
    from ..core.kv.prefix_store import common_prefix_length

    first, *others = (engine.chat_ids(before + [{"role": "user", "content": user_turn(question, document)}])
                      for question in ("A?", "B?", ""))
    return min(common_prefix_length(first, other) for other in others)

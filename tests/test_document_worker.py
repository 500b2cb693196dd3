"""Document readers in a process of their own (app/document_worker.py): a file built to keep a
reader busy or to exhaust its memory is refused within the limits, the limit and its variable
named, and an ordinary file reads as before."""

from __future__ import annotations

import random
import sys
import time
import zipfile
import zlib

import pytest
from test_documents import BODY_END, BODY_START, CONTENT_TYPES, RELATIONSHIPS, write_docx_archive

from specchat.app.documents import read_document
from specchat.core.errors import InputError


def write_busy_pdf(path, operators: int):
    """One page whose compressed content stream is `operators` text-showing operators: a few KB
    on disk, minutes of pypdf's text extraction (a second probe of main: 69 MB inflated, > 5 min)."""
    content = zlib.compress(b"BT /F1 12 Tf 72 720 Td " + b"(a) Tj " * operators + b"ET", 9)
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
               b"/Contents 5 0 R >>",
               b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(content) + content + b"\nendstream"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    path.write_bytes(bytes(out))
    return path


def write_many_paragraphs(path, count: int):
    """A .docx of `count` short paragraphs of random letters: it compresses like text, not like a
    zip bomb, and python-docx holds a few hundred bytes of objects per paragraph."""
    letters = random.Random(0).choices("abcdefghijklmnopqrstuvwxyz", k=6 * count)
    paragraphs = b"".join(b"<w:p><w:r><w:t>%s</w:t></w:r></w:p>" % "".join(letters[6 * n:6 * n + 6]).encode()
                          for n in range(count))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", CONTENT_TYPES)
        archive.writestr("_rels/.rels", RELATIONSHIPS)
        archive.writestr("word/document.xml", BODY_START + paragraphs + BODY_END)
    return path


def test_a_pdf_built_to_keep_the_reader_busy_is_refused_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_DOCUMENT_READ_SECONDS", "1")
    path = write_busy_pdf(tmp_path / "busy.pdf", 3_000_000)
    assert path.stat().st_size < 100_000
    started = time.monotonic()
    with pytest.raises(InputError, match=r"took longer than 1 s .* set SPECCHAT_DOCUMENT_READ_SECONDS"):
        read_document(path)
    assert time.monotonic() - started < 1 + 2 + 2  # the limit, the start allowance, slack for a busy machine


def test_a_small_busy_pdf_still_reads_within_the_limit(tmp_path):
    path = write_busy_pdf(tmp_path / "small.pdf", 200)
    assert read_document(path) == "a" * 200


@pytest.mark.skipif(sys.platform != "linux", reason="the memory limit is the OS's address-space limit")
def test_a_docx_that_needs_more_memory_than_allowed_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_DOCUMENT_READ_MEMORY_MB", "150")
    monkeypatch.setenv("SPECCHAT_DOCUMENT_READ_SECONDS", "60")
    path = write_many_paragraphs(tmp_path / "many.docx", 400_000)
    with pytest.raises(InputError, match=r"needs more than 150 MB of memory .* set SPECCHAT_DOCUMENT_READ_MEMORY_MB"):
        read_document(path)
    monkeypatch.setenv("SPECCHAT_DOCUMENT_READ_MEMORY_MB", "2048")
    assert len(read_document(write_docx_archive(tmp_path / "fine.docx", 1)).splitlines()) == 1000


def test_a_bad_limit_names_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_DOCUMENT_READ_SECONDS", "soon")
    with pytest.raises(InputError, match="SPECCHAT_DOCUMENT_READ_SECONDS must be a positive number of seconds"):
        read_document(write_busy_pdf(tmp_path / "small.pdf", 1))

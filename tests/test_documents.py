"""Reading documents: each format's text, and one clear error for each way a file can fail."""

from __future__ import annotations

import os
import time

import pytest

from specchat.app.document_formats import docx_text
from specchat.app.documents import DOCUMENT_SUFFIXES, read_document, read_document_or_text, read_text_file
from specchat.core.errors import InputError

from pdf_fixture import write_pdf


def make_docx(path, paragraphs: list[str], table: list[list[str]] | None = None):
    import docx

    document = docx.Document()
    for paragraph in paragraphs:
        document.add_paragraph(paragraph)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for row, values in zip(grid.rows, table):
            for cell, value in zip(row.cells, values):
                cell.text = value
    document.save(path)
    return path


def test_text_files_read_as_before(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes("\ufeffcafé\n\nsecond paragraph\n".encode("utf-8"))
    assert read_document(path) == read_text_file(path) == "café\n\nsecond paragraph\n"
    markdown = tmp_path / "notes.md"
    markdown.write_text("# Title\n\ntext\n", encoding="utf-8")
    assert read_document(markdown) == "# Title\n\ntext\n"


def test_pdf_pages_are_separated_by_blank_lines(tmp_path):
    path = write_pdf(tmp_path / "report.pdf", ["First page (one)\nsecond line", "Third page"])
    assert read_document(path) == "First page (one)\nsecond line\n\nThird page"


def test_pdf_pages_without_text_are_named_not_dropped(tmp_path):
    # Found: a partly scanned PDF lost its image pages without a word.
    from specchat.app.document_formats import textless_note

    path = write_pdf(tmp_path / "mixed.pdf", ["", "Page two.", "", "", "Page five.", ""])
    text = read_document(path)
    assert text == ("[page 1 of 6: no text to read (a scanned image, a figure, or blank)]\n\nPage two.\n\n"
                    "[pages 3-4 of 6: no text to read (a scanned image, a figure, or blank)]\n\nPage five.\n\n"
                    "[page 6 of 6: no text to read (a scanned image, a figure, or blank)]")
    assert textless_note(text).startswith(" ⚠️ 4 of 6 pages have no text") and "run OCR" in textless_note(text)
    assert textless_note(read_document(write_pdf(tmp_path / "full.pdf", ["One.", "Two."]))) == ""


def test_suffix_case_does_not_matter(tmp_path):
    path = write_pdf(tmp_path / "REPORT.PDF", ["Shouted"])
    assert read_document(path) == "Shouted"


def test_docx_paragraphs_and_table_rows(tmp_path):
    path = make_docx(tmp_path / "memo.docx", ["Dear team,", "Figures below."],
                     table=[["name", "score"], ["Ada", "10"]])
    assert read_document(path) == "Dear team,\nFigures below.\nname\tscore\nAda\t10"


def test_html_keeps_visible_text_only(tmp_path):
    path = tmp_path / "page.html"
    path.write_text("""<!doctype html>
<html><head><title>Hidden title</title><style>p { color: red }</style></head>
<body>
  <h1>Fish &amp; chips</h1>
  <script>var hidden = 1;</script>
  <p>First   paragraph
     wraps here.</p>


  <div>Line one<br>Line two<br><br>Line four</div>
  <ul><li>alpha</li><li>beta&nbsp;gamma</li></ul>
  <pre>  indented
    code</pre>
</body></html>""", encoding="utf-8")
    assert read_document(path) == ("Fish & chips\n\nFirst paragraph wraps here.\n\nLine one\nLine two\n\nLine four\n\n"
                                   "alpha\nbeta\xa0gamma\n\n  indented\n    code")


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-be", "utf-32", "utf-8-sig"])
def test_text_with_a_byte_order_mark_reads_in_its_encoding(tmp_path, codec):
    """Windows Notepad's "Unicode" is UTF-16 with a byte-order mark: it is text, not binary."""
    text = "Café, naïve, 東京: plain text."
    (tmp_path / "notes.txt").write_bytes(text.encode(codec) if codec != "utf-16-be" else b"\xfe\xff" + text.encode(codec))
    (tmp_path / "page.html").write_bytes(f"<p>{text}</p>".encode(codec) if codec != "utf-16-be"
                                         else b"\xfe\xff" + f"<p>{text}</p>".encode(codec))
    assert read_document(tmp_path / "notes.txt") == text and read_document(tmp_path / "page.html") == text


def test_html_reads_in_the_encoding_it_declares(tmp_path):
    page = tmp_path / "old.html"
    for declaration in ('<meta charset="windows-1252">', '<META HTTP-EQUIV="Content-Type" CONTENT="text/html; charset=ISO-8859-1">'):
        page.write_bytes(f"<html><head>{declaration}</head><body><p>Caf\u00e9 \u00e0 la carte</p></body></html>".encode("cp1252"))
        assert read_document(page) == "Caf\u00e9 \u00e0 la carte"
    page.write_bytes("<p>\u201cquoted\u201d</p>".encode("cp1252"))  # declared nowhere: never guessed
    with pytest.raises(InputError, match="not UTF-8 text .*save it as UTF-8"):
        read_document(page)
    page.write_bytes('<meta charset="x-unheard-of"><p>Caf\u00e9</p>'.encode("cp1252"))
    with pytest.raises(InputError, match=r"declares an encoding unknown here \(x-unheard-of\)"):
        read_document(page)


def test_htm_is_html(tmp_path):
    path = tmp_path / "page.htm"
    path.write_text("<p>a &lt; b</p>", encoding="utf-8")
    assert read_document(path) == "a < b"


def test_unknown_suffix_lists_the_supported_ones(tmp_path):
    path = tmp_path / "slides.pptx"
    path.write_bytes(b"PK")
    with pytest.raises(InputError, match="slides.pptx") as error:
        read_document(path)
    assert all(suffix in str(error.value) for suffix in DOCUMENT_SUFFIXES)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="gone.pdf: no such file"):
        read_document(tmp_path / "gone.pdf")


def test_password_protected_pdf(tmp_path):
    from pypdf import PdfWriter

    writer = PdfWriter(clone_from=write_pdf(tmp_path / "plain.pdf", ["secret text"]))
    writer.encrypt(user_password="secret", algorithm="RC4-128")
    writer.write(tmp_path / "locked.pdf")
    with pytest.raises(InputError, match="locked.pdf is password-protected: remove the password"):
        read_document(tmp_path / "locked.pdf")


def test_pdf_encrypted_with_an_empty_password_reads(tmp_path):
    from pypdf import PdfWriter

    writer = PdfWriter(clone_from=write_pdf(tmp_path / "plain.pdf", ["open text"]))
    writer.encrypt(user_password="", owner_password="owner", algorithm="RC4-128")
    writer.write(tmp_path / "restricted.pdf")
    assert read_document(tmp_path / "restricted.pdf") == "open text"


def test_pdf_without_text_layer(tmp_path):
    path = write_pdf(tmp_path / "scan.pdf", ["", ""])
    with pytest.raises(InputError, match=r"scan.pdf has no text layer \(a scanned PDF\?\): run OCR"):
        read_document(path)


@pytest.mark.parametrize("data", [b"", b"not a pdf at all", b"%PDF-1.4\n1 0 obj\n<< /Type"])
def test_corrupt_pdf(tmp_path, data):
    path = tmp_path / "broken.pdf"
    path.write_bytes(data)
    with pytest.raises(InputError, match="cannot read .*broken.pdf: it is not a valid PDF"):
        read_document(path)


def test_corrupt_docx(tmp_path):
    path = tmp_path / "broken.docx"
    path.write_bytes(b"an old binary .doc, say")
    with pytest.raises(InputError, match=r"cannot read .*broken.docx: it is not a valid \.docx file"):
        read_document(path)


@pytest.mark.parametrize("name", ["empty.txt", "empty.docx", "empty.html", "empty.pdf"])
def test_empty_document(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".docx"):
        make_docx(path, ["", "   "])
    elif name.endswith(".pdf"):
        write_pdf(path, [])
    else:
        path.write_text("<html><head><title>only a title</title></head></html>\n  \n" if name.endswith(".html")
                        else "  \n\n", encoding="utf-8")
    with pytest.raises(InputError, match=f"{name} is empty"):
        read_document(path)


# ---- limits: measured before reading, counted while reading ---------------------------------

CONTENT_TYPES = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
                 b'<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
                 b'<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
                 b'<Default Extension="xml" ContentType="application/xml"/>'
                 b'<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-'
                 b'officedocument.wordprocessingml.document.main+xml"/></Types>')
RELATIONSHIPS = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
                 b'<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
                 b'<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/'
                 b'relationships/officeDocument" Target="word/document.xml"/></Relationships>')
BODY_START = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<w:document xmlns:w='
              b'"http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>')
BODY_END = b"</w:body></w:document>"
PARAGRAPHS = b"<w:p><w:r><w:t>All work and no play makes Jack a dull boy.</w:t></w:r></w:p>" * 1000


def deflated(*pieces: tuple[bytes, int]) -> tuple[bytes, int, int]:
    """Raw deflate of each (chunk, repeats), the size and CRC of what it inflates to. Each chunk is
    compressed once and its block repeated (a full flush makes blocks independent), so a gigabyte
    of text costs milliseconds and a few megabytes to build."""
    import zlib

    blocks, size, crc = [], 0, 0
    for chunk, repeats in pieces:
        compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
        blocks.append((compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)) * repeats)
        size += len(chunk) * repeats
        if repeats < 100:  # a bomb's checksum is never reached: the reader refuses it first
            for _ in range(repeats):
                crc = zlib.crc32(chunk, crc)
    blocks.append(zlib.compressobj(9, zlib.DEFLATED, -15).flush())  # the final, empty block
    return b"".join(blocks), size, crc


def write_docx_archive(path, paragraph_repeats: int, declared: int | None = None):
    """A minimal .docx written by hand, whose document.xml holds `paragraph_repeats` times 1,000
    paragraphs and declares `declared` bytes (default: the truth) in its zip headers."""
    import struct

    members = [("[Content_Types].xml", *deflated((CONTENT_TYPES, 1))),
               ("_rels/.rels", *deflated((RELATIONSHIPS, 1))),
               ("word/document.xml", *deflated((BODY_START, 1), (PARAGRAPHS, paragraph_repeats), (BODY_END, 1)))]
    out, central = bytearray(), bytearray()
    for name, data, size, crc in members:
        size = declared if declared is not None and name == "word/document.xml" else size
        offset, encoded = len(out), name.encode()
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(data), size, len(encoded), 0)
        out += encoded + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, crc, len(data), size,
                               len(encoded), 0, 0, 0, 0, 0, offset) + encoded
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central),
                                 len(out), 0)
    path.write_bytes(bytes(out))
    return path


def measured(read):
    """What `read()` raised, with the seconds and the peak Python memory it took. The reader is
    called in this process (read_document runs it in a worker, whose memory tracemalloc cannot see)."""
    import tracemalloc

    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(InputError) as error:
            read()
        return str(error.value), time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_hand_made_docx_reads(tmp_path):
    """The bombs below are refused for what they are, not for being malformed."""
    text = read_document(write_docx_archive(tmp_path / "fine.docx", 1))
    assert text.splitlines() == ["All work and no play makes Jack a dull boy."] * 1000


def test_a_docx_declaring_a_gigabyte_is_refused_before_inflating(tmp_path):
    path = write_docx_archive(tmp_path / "bomb.docx", 14_000)  # 1 GB of XML in about 4 MB
    assert path.stat().st_size < 5e6
    message, seconds, peak = measured(lambda: docx_text(path.read_bytes(), path))
    assert f"{path} unpacks to 1.1 GB, more than a document within the document text limit of 8.0 MB" in message
    assert "SPECCHAT_MAX_DOCUMENT_TEXT_MB" in message
    assert seconds < 0.5 and peak < 5 * path.stat().st_size + 1e6  # the archive, never its contents


def test_a_docx_whose_header_lies_stops_at_the_declared_size(tmp_path):
    path = write_docx_archive(tmp_path / "liar.docx", 14_000, declared=100_000)  # inflates to 1 GB
    message, seconds, peak = measured(lambda: docx_text(path.read_bytes(), path))
    assert f"cannot read {path}: it is not a valid .docx file" in message
    assert seconds < 1 and peak < 5 * path.stat().st_size + 10e6


def test_a_docx_that_inflates_absurdly_is_a_zip_bomb(tmp_path):
    path = write_docx_archive(tmp_path / "dense.docx", 1_000)  # 78 MB of XML: within the declared budget
    message, seconds, peak = measured(lambda: docx_text(path.read_bytes(), path))
    assert f"{path} is not a usable .docx: its part word/document.xml inflates" in message and "zip bomb" in message
    assert seconds < 0.5 and peak < 5 * path.stat().st_size + 1e6


def test_docx_text_is_counted_while_reading(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_MAX_DOCUMENT_TEXT_MB", "0.01")  # 10 KB of text
    path = make_docx(tmp_path / "long.docx", [f"Paragraph {n} of a long memo." for n in range(1000)])
    with pytest.raises(InputError) as error:
        read_document(path)
    assert str(error.value) == (f"the text of {path} (read until it passed the limit) is 10.0 KB, over the "
                                "document text limit of 10.0 KB (set SPECCHAT_MAX_DOCUMENT_TEXT_MB in MB to change it)")


def test_pdf_and_html_text_are_counted_while_reading(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_MAX_DOCUMENT_TEXT_MB", "0.001")  # 1 KB of text
    pdf = write_pdf(tmp_path / "long.pdf", ["A line of text on a page.\n" * 20] * 3)  # 520 bytes a page
    html = tmp_path / "long.html"
    html.write_text("<p>Some words here.</p>\n" * 200, encoding="utf-8")
    for path in (pdf, html):
        with pytest.raises(InputError, match=rf"the text of .*{path.name} \(read until it passed the limit\) is "
                                             r"1\.0 KB, over the document text limit of 1\.0 KB"):
            read_document(path)
    assert read_document(write_pdf(tmp_path / "short.pdf", ["short"])) == "short"


@pytest.mark.parametrize("name", ["big.pdf", "big.docx", "big.html"])
def test_a_document_file_over_the_limit_is_refused_before_reading(tmp_path, monkeypatch, name):
    monkeypatch.setenv("SPECCHAT_MAX_DOCUMENT_MB", "0.001")
    path = tmp_path / name
    path.write_bytes(b"x" * 2000)
    with pytest.raises(InputError) as error:
        read_document(path)
    assert str(error.value) == (f"{path} is 2.0 KB, over the document file limit of 1.0 KB "
                                "(set SPECCHAT_MAX_DOCUMENT_MB in MB to change it)")


def test_text_files_and_prompt_files_are_bound_by_the_text_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_MAX_DOCUMENT_TEXT_MB", "0.001")
    path = tmp_path / "prompt.txt"
    path.write_text("y" * 1500)
    for read in (read_text_file, read_document, read_document_or_text):
        with pytest.raises(InputError, match=r"prompt.txt is 1\.5 KB, over the document text limit of 1\.0 KB"):
            read(path)


def test_an_endless_file_is_read_no_further_than_the_limit(monkeypatch):
    if not os.path.exists("/dev/zero"):
        pytest.skip("needs /dev/zero")
    monkeypatch.setenv("SPECCHAT_MAX_DOCUMENT_TEXT_MB", "0.001")  # /dev/zero reports a size of 0
    with pytest.raises(InputError, match=r"/dev/zero \(read until it passed the limit\) is 1\.0 KB, over the "
                                         r"document text limit"):
        read_document_or_text("/dev/zero")

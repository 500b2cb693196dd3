"""Reading documents: each format's text, and one clear error for each way a file can fail."""

from __future__ import annotations

import pytest

from specchat.app.documents import DOCUMENT_SUFFIXES, read_document, read_text_file
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
    path = write_pdf(tmp_path / "report.pdf", ["First page (one)\nsecond line", "", "Third page"])
    assert read_document(path) == "First page (one)\nsecond line\n\nThird page"


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

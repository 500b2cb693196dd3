"""Minimal text PDFs written by hand, so tests can make PDFs without a PDF-writing dependency."""

from __future__ import annotations

from pathlib import Path

FONT_SIZE = 12
LEADING = 14  # points between lines
PAGE_WIDTH, PAGE_HEIGHT = 612, 792  # US Letter


def write_pdf(path: str | Path, pages: list[str]) -> Path:
    """A PDF with one page per string, each line of it drawn in Helvetica (ASCII text only).
    An empty string makes a page without any text, like a scan."""
    count = len(pages)
    # Objects: 1 catalog, 2 page tree, 3 font, then for page i: 4 + 2i the page, 5 + 2i its content.
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(count))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {count} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    for i, text in enumerate(pages):
        content = _content_stream(text)
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {PAGE_WIDTH} {PAGE_HEIGHT}] "
                       f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")

    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)  # each entry is 20 bytes
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    path = Path(path)
    path.write_bytes(bytes(out))
    return path


def _content_stream(text: str) -> bytes:
    """BT … ET drawing each line below the previous one, from the top-left margin."""
    if not text:
        return b""
    lines = [f"BT /F1 {FONT_SIZE} Tf {LEADING} TL 72 {PAGE_HEIGHT - 72} Td"]
    lines += [f"({_escape(line)}) Tj T*" for line in text.splitlines()]
    lines.append("ET")
    return "\n".join(lines).encode("latin-1")


def _escape(line: str) -> str:
    """A PDF literal string: backslash and parentheses are escaped."""
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

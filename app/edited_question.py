"""A question edited in the chat, back in the words the user wrote.

The chat's edit box starts from the question as shown: made inert (`safe_markdown`: `<` as `&lt;`,
`![` as `[image: `), under its attachment line. Saving that as the question would make the model
read the escapes; so the user's changes (what differs between the shown text and the edited one)
are applied to the question as written, and what they left alone stays as it was.
"""

from __future__ import annotations

from difflib import SequenceMatcher

from .conversation import LEFT_OUT


def edited_question(written: str, shown: str, edited: str) -> str:
    """The question `written`, shown in the chat as `shown` (its inert form, attachment line and
    marks included), with the changes that turned `shown` into `edited`."""
    shown, edited = _question_part(shown), _question_part(edited)
    segments = _segments(shown, written)
    pieces = []
    for operation, shown_start, shown_end, edited_start, edited_end in SequenceMatcher(
            None, shown, edited, autojunk=False).get_opcodes():
        if operation == "equal":  # left alone: taken from the question as written
            pieces += [_written_part(segment, shown_start, shown_end, shown, written) for segment in segments
                       if segment[0] < shown_end and shown_start < segment[1]
                       or segment[0] == segment[1] and shown_start <= segment[0] < shown_end]
        else:  # typed in the box: the user's own text
            pieces.append(edited[edited_start:edited_end])
    return "".join(pieces).strip()


def _question_part(text: str) -> str:
    """The box's text without the attachment line and the left-out mark the chat adds."""
    text = text.removesuffix(LEFT_OUT).rstrip()
    lines = text.split("\n")
    return "\n".join(lines[1:]).lstrip("\n") if lines and lines[0].startswith("📎") else text


def _segments(shown: str, written: str) -> list[tuple[int, int, int, int, bool]]:
    """The shown text cut where it agrees with the written one and where it does not (an escape):
    (shown start, shown end, written start, written end, agrees) in order."""
    segments, shown_at, written_at = [], 0, 0
    for block in SequenceMatcher(None, shown, written, autojunk=False).get_matching_blocks():
        if (shown_at, written_at) != (block.a, block.b):
            segments.append((shown_at, block.a, written_at, block.b, False))
        if block.size:
            segments.append((block.a, block.a + block.size, block.b, block.b + block.size, True))
        shown_at, written_at = block.a + block.size, block.b + block.size
    return segments


def _written_part(segment: tuple[int, int, int, int, bool], start: int, end: int, shown: str, written: str) -> str:
    """What a stretch of shown text left alone in the box stands for: the written text where the
    two agree; an escape left whole, what it escapes; part of one, the characters as they stand."""
    shown_start, shown_end, written_start, written_end, agrees = segment
    if agrees:
        return written[written_start + max(start, shown_start) - shown_start:
                       written_start + min(end, shown_end) - shown_start]
    if start <= shown_start and shown_end <= end:
        return written[written_start:written_end]
    return shown[max(start, shown_start):min(end, shown_end)]

"""A conversation as specchat keeps it, and the pure views of it: what the model sees, what the
chat shows, and the exports people download. What is rendered (the chat, the Markdown export) goes
through `inert_markdown`: no message may make the reader's browser load anything.

A user message: {"role": "user", "content": question as typed, "document": None or
{"name": str, "text": str, "tokens": int, or None when sent while the model loaded and the tab
closed before it was counted, "note": str}}.
An assistant message: {"role": "assistant", "content": str, "partial": bool, "stats": dict or None,
"origins": list or None, "finish_reason": "stop" | "length" | "cancelled" | "repeating" | "error" (an error cut it
short after its first words), "error": str, why, in a few words (only with "error"), "context_full": bool,
"new_tokens": int, "continued": int, how many times Continue carried it on (absent: never)}; `partial`
stays True while it streams and after a crash cut it short: the views tell the two apart by whether
this process is still writing it (`live_answers`), which their caller says. The last answer may
also carry its other versions (Retry keeps them): "versions": [the fields above, for each],
"version": the shown one's place among all of them (`chat_versions`).
Either kind may carry "left_out": True: the user chose to leave it out of what the model reads, to
make room (it stays in the chat; a left-out question's document is still read).
`settings`: the sampling and decoding settings the conversation last answered with, restored when
it is reopened (names as in `chat_view.Settings`). `revision`: how many times it was written, so
that a copy read before the last write is known as stale (`history`).
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field, fields

from .documents import user_turn
from .safe_markdown import inert_markdown
from .terminal_text import for_terminal, json_escaped

NEW_TITLE = "New chat"
TITLE_LENGTH = 48
INTERRUPTED = "*(interrupted)*"
WRITING = "*(still being written: open the conversation again for the rest)*"
PASTED_NAME = "pasted document"  # the name of a document pasted rather than uploaded
LAST_SHOWABLE_TIME = 253402300799  # 9999-12-31 23:59:59 UTC: time.localtime's last year on every platform
LEFT_OUT = "*(left out of what the model reads, to make room)*"
# A message's own fields; an answer's others are those of the version it shows (`chat_versions`).
MESSAGE_FIELDS = ("role", "left_out", "versions", "version")


@dataclass
class Conversation:
    id: str  # uuid4 hex: also the file name, so it must stay path-safe
    title: str
    created: float
    updated: float
    system: str = ""
    preset: str = "free"
    messages: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    revision: int = 0


def model_messages(conversation: Conversation) -> list[dict]:
    """The chat the model is given: the system prompt, then each turn with its document inlined.
    An answer stopped before its first word is left out: it says nothing to continue from. So is
    a turn the user left out, except a question's document, which stays."""
    system = conversation.system.strip()
    messages = [{"role": "system", "content": system}] if system else []
    for message in conversation.messages:
        left_out = message.get("left_out", False)
        if message["role"] == "user":
            document = message.get("document")
            if left_out and not document:
                continue
            content = user_turn("" if left_out else message["content"], document["text"] if document else None)
        elif left_out or not message["content"]:  # stopped before its first word: nothing to continue from
            continue
        else:
            content = message["content"]
        messages.append({"role": message["role"], "content": content})
    return messages


def shown_messages(conversation: Conversation, streaming: bool = False, pending: str = "",
                   writing: bool = False) -> list[dict]:
    """The chat as the Chatbot shows it. `streaming`: the last answer is still being written (a
    question another tab asked meanwhile may follow it), so it is not marked as interrupted; while
    it has no text yet its bubble shows `pending` (Markdown of ours: the model loading, the document
    being read). `writing`: this process is writing the last answer, shown here from a copy
    (another tab's answer, the conversation reopened)."""
    shown = []
    streamed = last_answer_at(conversation) if streaming else None
    written = last_answer_at(conversation) if writing else None
    for index, message in enumerate(conversation.messages):
        live = index == streamed
        if message["role"] == "user":
            label = [attachment_label(message["document"])] if message.get("document") else []
            question = [message["content"]] if message["content"].strip() else []
            content = inert_markdown("\n\n".join(label + question))
        elif live and not message["content"] and pending:
            content = pending
        else:
            content = inert_markdown(answer_text(message, live=live, writing=index == written))
        if message.get("left_out"):
            content = f"{content}\n\n{LEFT_OUT}"
        shown.append({"role": message["role"], "content": content})
    return shown


def attachment_label(document: dict) -> str:
    """One line naming an attached document: "📎 *report.pdf · 7,402 tokens · cut …*"."""
    name, *rest = _document_details(document)
    return f"📎 *{' · '.join([_escape_markdown(name), *rest])}*"


def _document_details(document: dict) -> list[str]:
    counted = f"{document['tokens']:,} tokens" if document.get("tokens") is not None else "counted once the model loads"
    details = [document["name"], counted]
    return details + [document["note"]] if document.get("note") else details


def last_answer_at(conversation: Conversation) -> int | None:
    """The index of the conversation's last answer, the one an answer being written is written
    into (a question asked after it from another tab may follow it); None: no answer."""
    return next((index for index in range(len(conversation.messages) - 1, -1, -1)
                 if conversation.messages[index]["role"] == "assistant"), None)


def answer_text(message: dict, live: bool = False, writing: bool = False) -> str:
    """An answer's text, marked where it did not end on its own: a crash, an error or a stop cut it
    short, or it ran into the answer limit or the end of the context. `live`: shown as it streams, so
    unmarked; `writing`: still being written in this process, shown from a copy (`ending_mark`)."""
    if live:
        return message["content"]
    mark = ending_mark(message, writing)
    return f"{message['content']}\n\n{mark}" if mark and message["content"] else mark or message["content"]


def ending_mark(message: dict, writing: bool = False) -> str:
    """How an answer that did not end on its own ended, in a few words ("" when it did). A partial
    one is still being written when `writing` says this process writes it, else a crash cut it."""
    if message.get("partial"):
        return WRITING if writing else INTERRUPTED
    reason = message.get("finish_reason")
    if reason == "cancelled":
        return "*(stopped)*"
    if reason == "repeating":
        return "*(stopped: repeating itself)*"
    if reason == "error":
        why = _escape_markdown(one_line(message.get("error") or ""))
        return f"*(cut short by an error{': ' + why if why else ''}. Continue carries it on, or Retry answers again)*"
    if reason == "length" and message.get("context_full"):
        return "*(cut off: the model's context is full. Start a new conversation, or leave out earlier turns)*"
    if reason == "length":
        count = message.get("new_tokens")
        limit = f" of {count:,} tokens" if isinstance(count, int) else ""
        if limit and message.get("continued"):  # the count sums every part; the limit is each part's
            limit = f" ({count:,} tokens in all)"
        return f"*(cut off at the answer limit{limit}: Continue carries it on, or raise the limit in Settings)*"
    return ""


def title_from(question: str, document: dict | None = None) -> str:
    """A list title from the first question: its first line, cut at a word near 48 characters.
    With a document, the document's name (or a pasted text's first line) comes first, so that
    the same question about different documents gives different titles."""
    first = _first_line(question)
    if document:
        named = one_line(document["name"]) if document["name"] != PASTED_NAME else _first_line(document["text"])
        first = " — ".join(part for part in (_shortened(named, TITLE_LENGTH * 2 // 3), first) if part)
    return _shortened(first, TITLE_LENGTH) or NEW_TITLE


def _shortened(line: str, length: int) -> str:
    """`line` cut at a word near `length` characters, with an ellipsis when cut."""
    if len(line) <= length:
        return line
    cut = line[:length - 1]
    # Prefer ending on a whole word, unless that leaves too little of the line.
    if line[len(cut)] != " " and " " in cut[length // 2:]:
        cut = cut[:cut.rindex(" ")]
    return cut.rstrip(" ,.;:-—") + "…"


def _first_line(text: str) -> str:
    lines = (one_line(line) for line in text.splitlines())
    return next((line for line in lines if line), "")


def one_line(title: str) -> str:
    """`title` as the list shows it: runs of spaces as one, and no control character or direction
    override, which would show a title other than the one written (or act on a terminal it is
    printed to)."""
    return " ".join(for_terminal(title).split())


def to_json(conversation: Conversation) -> str:
    """The full record, documents included: what the store writes and the JSON export. Lossless,
    with what a terminal would act on escaped, so the file is safe to print."""
    return json_escaped(json.dumps(asdict(conversation), ensure_ascii=False, indent=1))


def from_json(text: str) -> Conversation:
    """The conversation `to_json` wrote; `ValueError` when the text is not one (truncated, edited,
    nested too deeply for the parser, a field of the wrong type anywhere)."""
    try:
        data = json.loads(text)  # JSONDecodeError is a ValueError
    except RecursionError:
        raise ValueError("nested too deeply to be a conversation") from None
    if not isinstance(data, dict):
        raise ValueError("a conversation is a JSON object")
    # A field this version does not know (a newer specchat wrote it) is left out, as within messages.
    known = {known_field.name for known_field in fields(Conversation)}
    try:
        conversation = Conversation(**{name: value for name, value in data.items() if name in known})
    except TypeError as error:
        raise ValueError(f"not a conversation: {error}") from None
    _check_types(conversation)
    conversation.title = one_line(conversation.title) or NEW_TITLE  # one saved before titles were cleaned, or edited
    return conversation


def to_markdown(conversation: Conversation, writing: bool = False) -> str:
    """A readable export: title, system prompt, then each turn; documents fold away in <details>.
    Each text is made inert in the form it is written in (heading, quote), so no title, prompt,
    question or answer renders as HTML or loads an image wherever the file is opened; nor acts on a
    terminal it is printed to, or shows text other than what was written (direction overrides).
    `writing`: this process is still writing the last answer (exported mid-answer)."""
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(conversation.created))
    parts = [inert_markdown(f"# {conversation.title}"), f"*specchat conversation · started {started}*"]
    if conversation.system.strip():
        parts.append("**System prompt:**\n\n" + inert_markdown(_quote(conversation.system.strip())))
    parts.append("---")
    written = last_answer_at(conversation) if writing else None
    for index, message in enumerate(conversation.messages):
        if message["role"] == "user":
            parts.append("**You:**")
            if message.get("document"):
                parts.append(_folded_document(message["document"]))
            if message["content"].strip():
                parts.append(inert_markdown(message["content"].strip()))
        else:
            parts.append("**specchat:**")
            parts.append(inert_markdown(answer_text(message, writing=index == written)))
            if message.get("versions"):
                parts.append(_other_versions(message["versions"]))
    return for_terminal("\n\n".join(parts)) + "\n"


def _other_versions(versions: list[dict]) -> str:
    """Retry's other versions of an answer, folded away under the one shown."""
    count = f"{len(versions)} other version{'s' if len(versions) > 1 else ''}"
    texts = "\n\n---\n\n".join(inert_markdown(answer_text(version)) for version in versions)
    return f"<details><summary>{count} of this answer (Retry)</summary>\n\n{texts}\n\n</details>"


def _folded_document(document: dict) -> str:
    # The fence must be longer than any run of backticks in the document, or the text ends it early.
    longest_run = max((len(run) for run in re.findall(r"`+", document["text"])), default=0)
    fence = "`" * max(3, longest_run + 1)
    summary = html.escape("📎 " + " · ".join(_document_details(document)))
    return (f"<details><summary>{summary}</summary>\n\n"
            f"{fence}text\n{document['text'].rstrip()}\n{fence}\n\n</details>")


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" if line else ">" for line in text.splitlines())


def _escape_markdown(text: str) -> str:
    return re.sub(r"([\\`*_\[\]<>])", r"\\\1", text)


# Stats fields the views format as numbers (speculation_view): a string there would fail each render.
NUMERIC_STATS = ("target_forwards", "drafted_tokens", "accepted_draft_tokens", "mean_accepted_per_forward",
                 "tokens_per_second", "prefill_seconds", "reused_prompt_tokens", "decode_seconds")
OPTIONAL_STATS = ("predicted_tokens_per_second",)  # a number, or null where there is no prediction


def _check_types(conversation: Conversation) -> None:
    """Reject a record whose fields the views would trip over later, so it fails here, once."""
    fields = {"id": str, "title": str, "created": (int, float), "updated": (int, float),
              "system": str, "preset": str, "messages": list, "settings": dict, "revision": int}
    for name, kind in fields.items():
        if not isinstance(getattr(conversation, name), kind) or isinstance(getattr(conversation, name), bool):
            raise ValueError(f"field {name!r} has the wrong type")
    if not (_is_time(conversation.created) and _is_time(conversation.updated)):
        raise ValueError("the times must be dates between 1970 and 9999")
    if not all(value is None or isinstance(value, (str, int, float)) and not isinstance(value, bool)
               for value in conversation.settings.values()):
        raise ValueError("the settings hold numbers and words")
    for message in conversation.messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError("a message needs text content")
        if not isinstance(message.get("left_out", False), bool):
            raise ValueError("a message's `left_out` is true or false")
        if message.get("role") == "user":
            _check_document(message.get("document"))
        elif message.get("role") == "assistant":
            _check_answer(message)
        else:
            raise ValueError(f"unknown message role {message.get('role')!r}")


def _check_document(document) -> None:
    if document is None:
        return
    tokens = document.get("tokens") if isinstance(document, dict) else None
    if not (isinstance(document, dict) and isinstance(document.get("name"), str)
            and isinstance(document.get("text"), str) and (tokens is None or _is_number(tokens, int))
            and isinstance(document.get("note", ""), (str, type(None)))):
        raise ValueError("a document needs a name, text and a token count (or null: not counted yet)")


def _check_answer(message: dict) -> None:
    _check_versions(message)
    if not isinstance(message.get("partial", False), bool):
        raise ValueError("an answer's `partial` is true or false")
    if not (_is_number(message.get("continued", 0), int) and message.get("continued", 0) >= 0):
        raise ValueError("an answer's `continued` is a count")
    if not isinstance(message.get("error", ""), str):  # shown in its mark
        raise ValueError("an answer's `error` is a line of text")
    origins = message.get("origins")
    if origins is not None and not (isinstance(origins, list) and all(
            isinstance(piece, list) and len(piece) == 2 and all(isinstance(part, str) for part in piece)
            for piece in origins)):
        raise ValueError("an answer's origins are [text, origin] pairs")
    stats = message.get("stats")
    if stats is None:
        return
    if not isinstance(stats, dict) or not all(_is_number(stats[key]) for key in NUMERIC_STATS if key in stats) \
            or not all(stats.get(key) is None or _is_number(stats[key]) for key in OPTIONAL_STATS):
        raise ValueError("an answer's stats hold numbers")
    stages = stats.get("stages", {})
    if not (isinstance(stages, dict) and all(
            isinstance(counts, dict) and all(_is_number(count) for count in counts.values())
            for counts in stages.values())):
        raise ValueError("an answer's stages hold counts")


def _check_versions(message: dict) -> None:
    """An answer's other versions, each an answer of its own (with no versions), and the shown one's place."""
    earlier = message.get("versions", [])
    if not isinstance(earlier, list):
        raise ValueError("an answer's versions are a list")
    at = message.get("version", len(earlier))
    if not (_is_number(at, int) and 0 <= at <= len(earlier)):
        raise ValueError("an answer's `version` is its place among its versions")
    for version in earlier:
        if not (isinstance(version, dict) and isinstance(version.get("content"), str)
                and not any(name in version for name in MESSAGE_FIELDS)):
            raise ValueError("an answer's version holds an answer's fields")
        _check_answer(version)


def _is_number(value, kind: type | tuple = (int, float)) -> bool:
    """A number the views can show: an integer too large for a float counts as none (formatting
    it would raise OverflowError where no one catches it)."""
    if not isinstance(value, kind) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_time(value) -> bool:
    """Seconds since 1970 that `time.localtime` can show (the list labels repeated titles with it)."""
    return _is_number(value) and 0 <= value <= LAST_SHOWABLE_TIME

"""What a person has started in a conversation and not sent: the message box's text (a preset's
question included), the attached document and the pasted text. Each conversation keeps its own
(a `gr.State`, keyed by conversation id, kept on disk for the browser by `draft_store`): leaving a
conversation keeps its draft, coming back brings it back, and a new conversation starts with
nothing attached elsewhere: the draft left in a new conversation when another was opened, else the
chosen preset's question. New, clicked on a new conversation, starts afresh."""

from __future__ import annotations

import dataclasses

from .chat_view import View
from .conversation import Conversation

NEW = ""  # the key of the conversation not started yet


def kept(drafts: dict | None, conversation: Conversation | None, message: str, attachment: dict | None,
         pasted: str | None) -> dict:
    """`drafts` with the draft of the conversation being left (none when nothing is in it)."""
    key = conversation.id if conversation is not None else NEW
    drafts = {other: draft for other, draft in (drafts or {}).items() if other != key}
    if (message or "").strip() or attachment is not None or (pasted or "").strip():
        drafts[key] = {"message": message or "", "attachment": attachment, "pasted": pasted or ""}
    return drafts


def restored(view: View, drafts: dict, preset_question: str, left_new: bool) -> tuple[View, dict]:
    """The view with the draft of the conversation it shows in the box, and the drafts kept. For a
    new conversation: the draft left in one, taken out of `drafts` (the box holds it now), unless
    the page was on a new conversation already (`left_new`: New starts afresh); else the preset's
    question. A view that shows no other conversation is left as it is."""
    if view.clear_conversation:
        drafts = dict(drafts)
        left_in_new = drafts.pop(NEW, None)
        draft = left_in_new if left_in_new and not left_new else {"message": preset_question}
    elif view.conversation is not None:
        draft = drafts.get(view.conversation.id, {})
    else:
        return view, drafts
    attachment = draft.get("attachment")
    # The status line spoke of the conversation left ("Attached notes.txt."): it goes unless the view has its own.
    return dataclasses.replace(view, message=draft.get("message", ""), attachment=attachment,
                               clear_attachment=attachment is None, pasted=draft.get("pasted", ""),
                               status="" if view.status is None else view.status), drafts

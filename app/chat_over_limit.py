"""The choices offered when a question does not fit the model's context: cut the document, leave
earlier turns out, a shorter answer limit, summarize the document in parts, or switch to a pair
with a longer context; each offered only where it makes room. Nothing is cut without one of them
being chosen; earlier turns are left out unasked only as the settings say (`chat_follow_up`)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Iterator

from ..core.errors import InputError
from .answer_job import ConversationKv
from .chat_view import Settings, View
from .chat_follow_up import leave_out, turns_to_leave_out
from .context_meter import CUT_MARGIN, CUTS, Meter, cut_document, cut_marker, split_document
from .conversation import Conversation, title_from
from .documents import user_turn
from .engine_handle import EngineHandle
from .parts_clock import Pace, estimate_before, estimate_during
from .read_progress import ReadProgress

if TYPE_CHECKING:
    from .ui_chat import ChatLogic

PART_ANSWER_TOKENS = 256  # each part's summary, when a document is summarized in parts (an eighth of a short context)
PART_SYSTEM = ("You summarize one part of a longer document faithfully: its main points in order, with names, "
               "numbers and dates exact, adding nothing it does not say.")


def offer(chat: ChatLogic, meter: Meter, attachment: dict | None, question: str, conversation: Conversation | None,
          settings: Settings) -> View:
    """The view that says by how much the question is over and offers the choices that make room."""
    engine = chat.handle.get()
    makes_room = _cut_makes_room(engine.tokenizer, meter.excess, attachment)
    cuts = _cut_labels(meter.excess, attachment) if makes_room else None
    can_leave_out = bool(turns_to_leave_out(chat, conversation, attachment, question, settings))
    parts = _parts(chat, attachment) if attachment is not None and meter.document > meter.context // 2 else None
    in_parts = parts is not None and _summaries_fit(chat, conversation, question, settings, *parts)
    pairs = longer_pairs(chat.registry_file, meter.needed, chat.handle.model)
    text = (f"**This does not fit.** The prompt is {meter.prompt:,} tokens and the answer limit keeps "
            f"{meter.reserve:,} for the answer, but {engine.name} reads at most {meter.context:,}: "
            f"{meter.excess:,} too many. ")
    if in_parts:
        before = estimate_before([engine.count_tokens(part) for part in parts[0]], parts[1], chat.pace)
        text += (f"Summarized in parts, it is read as {len(parts[0])} parts"
                 + (f", {before} on this machine before the answer" if before else "") + ". ")
    if cuts or can_leave_out or in_parts or pairs or meter.answer_room:
        text += "Nothing is cut or left out without your choice:"
    else:
        text += ("Nothing here can make room for it: start a new conversation, or ask with a shorter question "
                 "or document.")
    return View(over_limit=text, attachment=attachment, cuts=cuts, answer_room=meter.answer_room,
                can_leave_out=can_leave_out, in_parts=in_parts, longer_pairs=pairs,
                status="⚠️ Too long for this model: see the choices below.")


def longer_pairs(registry_file: str | None, needed: int, current: str) -> list[tuple[str, str]]:
    """Pairs whose context holds `needed` tokens and that this machine can run (the plan's
    verdict at their full context, as the Models tab shows it), each labelled with its context,
    its download (size, and whether it is here) and the plan's speed on this machine."""
    from ..core.model_cache import model_status
    from ..core.files import human_size
    from ..core.registry import load_registry
    from .models_cmd import listing_profile, plan_fit

    registry = load_registry(registry_file)
    candidates = [pair for pair in registry.pairs.values() if pair.context_length >= needed and pair.id != current]
    if not candidates:
        return []
    profile = listing_profile()
    labels = []
    for pair in candidates:
        fit = plan_fit(pair, profile, registry)
        if not fit.fits:
            continue
        words = [f"{pair.context_length:,} tokens"]
        if pair.source == "hub":
            here = all(model_status(model).complete for model in pair.models)
            words.append(f"{human_size(pair.download_bytes)}, " + ("downloaded" if here else "to download"))
        if fit.tokens_per_second:
            words.append(f"about {fit.tokens_per_second:.0f} tokens/s here")
        labels.append((f"{pair.name} ({' · '.join(words)})", pair.id))
    return labels


def cut(chat: ChatLogic, where: str, message: str, attachment: dict | None, pasted: str,
        conversation: Conversation | None, settings: Settings) -> View:
    """Cut the document by what is too much, from its start, middle or end."""
    attachment = chat.with_pasted(attachment, pasted)
    if attachment is None:
        raise InputError("there is no document to cut")
    meter = chat.meter(conversation, attachment, "", message, settings)
    text, removed = cut_document(chat.handle.get().tokenizer, attachment["text"], meter.excess, where)
    shorter = chat.attach(attachment["name"], text, f"cut {removed:,} tokens from the {where}")
    return View(attachment=shorter, pasted="", over_limit="",
                status=f"Cut {removed:,} tokens from the {where} of the document.")


def leave_out_turns(chat: ChatLogic, message: str, attachment: dict | None, pasted: str,
                    conversation: Conversation | None, settings: Settings) -> View:
    """Leave the fewest oldest turns out of what the model reads for the next question to fit; every
    document stays, and the turns stay in the chat, marked."""
    attachment = chat.with_pasted(attachment, pasted)
    indexes = turns_to_leave_out(chat, conversation, attachment, message, settings)
    if not indexes:
        raise InputError("leaving out every earlier turn is still not enough: cut the document, shorten the "
                         "answer limit, or start a new conversation")
    note = leave_out(conversation, indexes)
    chat.store.save(conversation)
    return View(conversation=conversation, over_limit="", status=note)


def summarize_in_parts(chat: ChatLogic, message: str, attachment: dict | None, pasted: str,
                       conversation: Conversation | None, settings: Settings, session: str = "") -> Iterator[View]:
    """For a document the model cannot read whole: summarize each part that fits, then ask the
    question about those summaries, which the chat labels as such (not the whole text)."""
    attachment = chat.with_pasted(attachment, pasted)
    if attachment is None:
        raise InputError("there is no document to summarize in parts")
    parts, summary_tokens = _parts(chat, attachment)
    question = (message or "").strip()
    if not _summaries_fit(chat, conversation, question, settings, parts, summary_tokens):
        raise InputError(f"even the summaries of its {len(parts)} parts would not fit beside the conversation: "
                         "cut the document first, or start a new conversation")
    shown_turn = chat.shown_turn(conversation, question, attachment)
    summaries, started = [], time.monotonic()
    before = estimate_before([chat.handle.get().count_tokens(part) for part in parts], summary_tokens, chat.pace)
    with chat.waiting(session) as stopped:  # Stop between two parts' jobs too
        for number, part in enumerate(parts, 1):
            left = estimate_during(number - 1, len(parts), time.monotonic() - started) or (
                f"{before} left" if before else "")
            doing = (f"⏳ *Summarizing part {number} of {len(parts)} (the document is too long to read whole)…*"
                     + (f" {left} for the parts" if left else ""))
            yield View(conversation=shown_turn, streaming=True, message="", over_limit="", pending=doing, status="")
            summary = yield from _part_summary(chat, part, number, len(parts), summary_tokens, settings,
                                               session, shown_turn, doing, stopped)
            if summary is None or stopped.is_set():
                yield View(conversation=conversation, clear_conversation=conversation is None, message=question,
                           status="Stopped while summarizing the parts: your question and document are kept.")
                return
            summaries.append(f"Part {number} of {len(parts)}, summarized:\n{summary.strip()}")
    combined = chat.attach(title_from("", attachment), "\n\n".join(summaries),
                           f"summaries of its {len(parts)} parts, not the whole text")
    yield from chat.send(question, combined, "", conversation, settings, session)


def _part_summary(chat: ChatLogic, part: str, number: int, count: int, summary_tokens: int, settings: Settings,
                  session: str, shown_turn: Conversation, doing: str, stopped: threading.Event) -> Iterator[View]:
    """One part's summary (None when stopped), the bubble showing the part's read meanwhile."""
    from ..core.engine import Finished, PrefillProgress

    # One KV for all the parts, each taking the last one's back: N parts never leave N copies in memory.
    ticket = chat.submit(session, _part_messages(part, number, count), summary_tokens, settings,
                         ConversationKv(conversation=f"{shown_turn.id}:parts"))
    if stopped.is_set():  # a Stop that came before the ticket could be cancelled
        ticket.cancel()
    reading = ReadProgress()
    try:
        for event in ticket:
            if isinstance(event, PrefillProgress):
                progress = reading.update(event.done, event.total, time.monotonic())
                yield View(conversation=shown_turn, streaming=True, pending=f"{doing}\n\n{progress}")
            elif isinstance(event, Finished):
                chat.pace = Pace.of(event.result) or chat.pace
                return None if event.result.finish_reason == "cancelled" else event.result.text
        return None  # taken out of the line by Stop before it started
    finally:
        chat.release(session, ticket)


def shorter_answer(chat: ChatLogic, message: str, attachment: dict | None, pasted: str,
                   conversation: Conversation | None, settings: Settings) -> View:
    """Lower the answer limit to what the prompt leaves."""
    meter = chat.meter(conversation, chat.with_pasted(attachment, pasted), "", message, settings)
    if not meter.answer_room:
        raise InputError("no useful answer fits after this prompt: shorten the question, or cut the document")
    return View(over_limit="", settings={"max_new_tokens": meter.answer_room},
                status=f"The answer limit is now {meter.answer_room:,} tokens for this conversation.")


def switch_pair(handle: EngineHandle, registry_file: str | None, pair_id: str | None) -> View:
    from ..core.model_cache import model_status
    from ..core.files import human_size
    from ..core.registry import load_registry

    if not pair_id:
        return View(status="Choose a pair first.")
    pair = load_registry(registry_file).get(pair_id)
    missing = pair.source == "hub" and not all(model_status(model).complete for model in pair.models)
    if missing:
        return View(status=f"{pair.name} is not downloaded yet: download it ({human_size(pair.download_bytes)}) "
                           "in the Models & hardware tab, then switch. Your question and document are kept.")
    handle.switch(pair_id)
    return View(over_limit="", status=f"Loading {pair.name}… send again when it is ready; your question "
                                      "and document are kept.")


def _parts(chat: ChatLogic, attachment: dict) -> tuple[list[str], int]:
    """The document's parts, each summarized alone, and the tokens each part's summary may take."""
    engine = chat.handle.get()
    summary_tokens = min(PART_ANSWER_TOKENS, engine.context_length // 8)
    overhead = len(engine.chat_ids(_part_messages("", 99, 99)))
    parts = split_document(engine.tokenizer, attachment["text"],
                           engine.context_length - summary_tokens - overhead - CUT_MARGIN)
    return parts, summary_tokens


def _summaries_fit(chat: ChatLogic, conversation: Conversation | None, question: str, settings: Settings,
                   parts: list[str], summary_tokens: int) -> bool:
    """Whether the parts' summaries fit beside the conversation and the question."""
    unread = chat.meter(conversation, None, "", question, settings)
    return unread.needed + len(parts) * (summary_tokens + CUT_MARGIN) <= unread.context


def _cut_makes_room(tokenizer, excess: int, attachment: dict | None) -> bool:
    """Whether cutting `excess` tokens (and the marker in their place) leaves some of the document."""
    if attachment is None or not attachment.get("tokens"):
        return False
    marker = len(tokenizer.encode(f"\n\n{cut_marker(attachment['tokens'])}\n\n", add_special_tokens=False))
    return excess + marker + CUT_MARGIN < attachment["tokens"]


def _part_messages(part: str, number: int, count: int) -> list[dict]:
    return [{"role": "system", "content": PART_SYSTEM},
            {"role": "user", "content": user_turn(f"Summarize part {number} of {count} of a longer document.", part)}]


def _cut_labels(excess: int, attachment: dict) -> dict[str, str]:
    """Each cut's button label, saying how much of the document goes."""
    share = min(1.0, excess / max(attachment["tokens"], 1))
    percent = "under 1%" if share < 0.005 else f"{share:.0%}"  # "0%" would read as cutting nothing
    return {where: f"✂ Cut {excess:,} tokens ({percent} of the document) from its {where}" for where in CUTS}

"""The conversation list: each label says when the conversation last changed, and the search finds
conversations by title, by what was said and by an attached document's name."""

from __future__ import annotations

import time

from specchat.app.chat_list import ConversationList, when
from specchat.app.history import HistoryStore


def saved(store: HistoryStore, title: str, messages: list[dict]):
    conversation = store.new()
    conversation.title, conversation.messages = title, messages
    store.save(conversation)
    return conversation


def test_the_search_finds_titles_messages_and_document_names_in_any_case(tmp_path):
    store = HistoryStore(tmp_path)
    lease = saved(store, "Flat contract", [{"role": "user", "content": "When does the LEASE end?"},
                                           {"role": "assistant", "content": "In March."}])
    manual = saved(store, "Questions", [{"role": "user", "content": "Summarize it.",
                                         "document": {"name": "Dishwasher-manual.pdf", "text": "...", "tokens": 3}}])
    listing = ConversationList(store)

    def found(query):
        return [conversation_id for _, conversation_id in listing.choices(query)]

    assert found("") == [manual.id, lease.id]  # newest first
    assert found("lease") == [lease.id] and found("march") == [lease.id]
    assert found("CONTRACT") == [lease.id]
    assert found("dishwasher") == [manual.id]
    assert found("  summarize ") == [manual.id]
    assert found("nowhere") == []


def test_labels_say_when_and_repeats_are_numbered(tmp_path):
    store = HistoryStore(tmp_path)
    first, second = saved(store, "Same", [{"role": "user", "content": "a"}]), saved(store, "Same", [
        {"role": "user", "content": "b"}])
    labels = dict((conversation_id, label) for label, conversation_id in ConversationList(store).choices())
    stamp = time.strftime("%H:%M", time.localtime(first.updated))
    assert labels[first.id].startswith("Same · ") and len(set(labels.values())) == 2
    if time.strftime("%H:%M", time.localtime(second.updated)) == stamp:  # the same minute: numbered
        assert {labels[first.id], labels[second.id]} == {f"Same · {stamp} (1)", f"Same · {stamp} (2)"}


def test_when_is_the_time_today_the_day_this_year_else_the_date():
    now = time.mktime((2026, 11, 28, 15, 0, 0, 0, 0, -1))
    assert when(time.mktime((2026, 11, 28, 9, 5, 0, 0, 0, -1)), now) == "09:05"
    assert when(time.mktime((2026, 3, 2, 9, 5, 0, 0, 0, -1)), now) == "Mar 02"
    assert when(time.mktime((2025, 12, 31, 23, 0, 0, 0, 0, -1)), now) == "Dec 31 2025"

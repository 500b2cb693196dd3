"""The last answer's versions and continuations. Retry writes a new version of the last answer and
keeps the earlier ones, to page through ("‹ 2/3 ›"); Continue carries an answer that was cut (at
the answer limit, stopped, or cut short by an error) on from its last word, in the same message.

An assistant message holds the version shown in its own fields (`conversation`'s answer format):
that is the one the model, the exports and the figures read, so the conversation goes on from the
version shown. The others wait in its `versions`, each an answer's fields and nothing else, with
`version` the place of the shown one among all of them (0-based; absent: the last).
"""

from __future__ import annotations

from ..core.errors import InputError
from .conversation import MESSAGE_FIELDS, Conversation
from .speculation_view import colored_tokens, ending, stage_table, stats_line

def all_versions(message: dict) -> list[dict]:
    """Every version of an answer, oldest first, the shown one in its place."""
    others = message.get("versions") or []
    shown = {name: value for name, value in message.items() if name not in MESSAGE_FIELDS}
    at = shown_at(message)
    return [*others[:at], shown, *others[at:]]


def shown_at(message: dict) -> int:
    """The place of the shown version among all of an answer's versions."""
    return message.get("version", len(message.get("versions") or []))


def retried(message: dict) -> dict:
    """The start of a new version of `message` (an answer), the earlier ones kept before it."""
    earlier = all_versions(message)
    return {"role": "assistant", "content": "", "partial": True, "stats": None, "origins": [],
            **({"left_out": True} if message.get("left_out") else {}), "versions": earlier, "version": len(earlier)}


def paged(message: dict, step: int) -> dict:
    """`message` showing the version `step` places after the shown one (within the first and last)."""
    versions = all_versions(message)
    at = min(max(shown_at(message) + step, 0), len(versions) - 1)
    kept = {name: message[name] for name in ("role", "left_out") if name in message}
    return {**kept, **versions[at], "versions": versions[:at] + versions[at + 1:], "version": at}


def last_answer(conversation: Conversation | None) -> dict | None:
    """The conversation's last message when it is an answer, else None."""
    if conversation is None or not conversation.messages or conversation.messages[-1]["role"] != "assistant":
        return None
    return conversation.messages[-1]


def pager(conversation: Conversation | None) -> tuple[int, int]:
    """(the shown version's number from 1, how many) of the last answer; (1, 1) with one version."""
    answer = last_answer(conversation)
    if answer is None:
        return 1, 1
    return shown_at(answer) + 1, len(answer.get("versions") or []) + 1


def can_continue(conversation: Conversation | None) -> bool:
    """The last answer was cut, with something to go on from: at the answer limit (not with the
    context full: nothing more fits), stopped, or by an error. One that stopped repeating itself
    is not offered."""
    answer = last_answer(conversation)
    if answer is None or not answer["content"] or answer.get("partial") or answer.get("left_out"):
        return False
    reason = answer.get("finish_reason")
    return reason in ("cancelled", "error") or (reason == "length" and not answer.get("context_full"))


def continued_ids(engine, messages: list[dict]) -> list[int]:
    """Token ids of the conversation with its last answer left open: the chat template's
    `continue_final_message`, so that the model carries the answer on from its last word rather
    than answering the question again."""
    try:
        encoded = engine.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    except ValueError:  # the template drops or rewrites the answer's text (its message quotes the whole chat)
        raise InputError(f"{engine.name}'s chat template cannot continue an answer: ask it to go on instead") from None
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def continued_note(message: dict) -> str:
    """What the figures line adds for an answer that was continued ("" for one that was not)."""
    times = message.get("continued", 0)
    if not times:
        return ""
    return f" · continued {'once' if times == 1 else f'{times} times'} (these figures: the last part)"


def figures(message: dict | None) -> dict:
    """The figures line, the stage table and the colored tokens of an answer, as a `View`'s fields."""
    stats = (message or {}).get("stats")
    if not stats:
        return {"stats": "", "stages": "", "tokens": colored_tokens((message or {}).get("origins") or [])}
    line = stats_line(stats, message.get("mode", ""), message.get("new_tokens"), ending(message))
    return {"stats": line + continued_note(message), "stages": stage_table(stats),
            "tokens": colored_tokens(message.get("origins") or [])}

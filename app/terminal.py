"""`specchat chat`: a conversation in the terminal, streamed, with Ctrl-C to stop an answer."""

from __future__ import annotations

import sys

from ..core.engine import Finished, Notice, PrefillProgress, TextDelta
from ..core.errors import InputError, SpecchatError
from .documents import document_tokens, read_document_or_text, user_turn
from .session import cut_off_note, request_from_args, sampling_params
from .terminal_text import for_terminal

HELP = "Type a message. /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops an answer."


def read_chat_document(args) -> str | None:
    if getattr(args, "cache_document", False) and not getattr(args, "document", None):
        raise InputError("--cache-document needs --document FILE")
    if not getattr(args, "document", None):
        return None
    document = read_document_or_text(args.document)
    if not document.strip():
        raise InputError(f"{args.document} is empty")
    return document


def run_chat(engine, args, document: str | None = None, stdin=sys.stdin, stdout=sys.stdout, triforce=None) -> int:
    """The conversation opens with `document` (if any) ahead of the first question; each turn
    resends the whole conversation and the engine reuses the KV of what it has seen. `triforce`:
    the --triforce-* settings (`generate_cmd.checked_options`), sized for the opening's length."""
    from .generate_cmd import triforce_options

    params = sampling_params(args)
    opening = (engine.count_tokens(document) if document else 0) + args.max_new_tokens
    options = triforce_options(engine, args, triforce, opening) if triforce is not None else None
    system = [{"role": "system", "content": args.system}] if args.system else []
    saved_tokens = document_tokens(engine, system, document) if document and args.cache_document else 0
    history: list[dict] = []
    about = f" about {args.document} ({engine.count_tokens(document):,} tokens)" if document else ""
    print(for_terminal(f"specchat chat on {engine.name}{about}. {HELP}"), file=stdout)
    while True:
        stdout.write("\nyou> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        message = line.strip()
        if not message:
            continue
        if message == "/reset":
            history.clear()
            print("(conversation cleared" + ("; the document stays)" if document else ")"), file=stdout)
            continue
        turn = [{"role": "user", "content": user_turn(message, document) if not history else message}]
        answer = _answer(engine, system + history + turn, args, params, stdout, saved_tokens, options)
        if answer is not None:
            history += turn + [{"role": "assistant", "content": answer}]


def _answer(engine, messages, args, params, stdout, saved_tokens: int = 0, options=None) -> str | None:
    """Stream one answer; returns its text (partial if stopped), or None if it could not start.
    Any failure ends the turn, never the conversation."""
    text, reading = "", False
    stdout.write("specchat> ")
    events = None
    try:
        events = engine.generate(engine.chat_ids(messages), request_from_args(args, params, saved_tokens, options))
        for event in events:
            if isinstance(event, TextDelta):
                if reading:  # clear the progress note
                    stdout.write("\rspecchat> \033[K")
                    reading = False
                text += event.text
                stdout.write(for_terminal(event.text))
                stdout.flush()
            elif isinstance(event, PrefillProgress) and event.total > 2048 and stdout.isatty():
                stdout.write(f"\rspecchat> (reading {event.done:,} of {event.total:,} tokens)\033[K")
                stdout.flush()
                reading = True
            elif isinstance(event, Notice):
                stdout.write(f"\n(note: {for_terminal(event.text)})\n")
            elif isinstance(event, Finished):
                stats = event.result.stats
                reused = f", {stats.reused_prompt_tokens:,} prompt tokens reused" if stats.reused_prompt_tokens else ""
                stdout.write(f"\n[{stats.tokens_per_second:.1f} tok/s, "
                             f"{stats.mean_accepted_per_forward:.2f} tokens per target forward, "
                             f"first token after {stats.prefill_seconds:.2f} s{reused}{cut_off_note(event.result)}]\n")
    except KeyboardInterrupt:
        stdout.write("\n(stopped)\n")
    except SpecchatError as error:
        stdout.write(f"\n(error: {for_terminal(str(error))}; /reset starts a new conversation)\n")
        return None
    except Exception as error:  # a failed turn must not end the conversation
        stdout.write(f"\n(unexpected error: {type(error).__name__}: {for_terminal(str(error))})\n")
        return None
    finally:
        if events is not None:
            events.close()  # releases the engine at once, also after Ctrl-C
    return text

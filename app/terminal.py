"""`specchat chat`: a conversation in the terminal, streamed, with Ctrl-C to stop an answer."""

from __future__ import annotations

import sys

from ..core.engine import Finished, TextDelta
from ..core.errors import SpecchatError

HELP = "Type a message. /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops an answer."


def run_chat(engine, args, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from .cli import sampling_params

    params = sampling_params(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print(f"specchat chat on {engine.name}. {HELP}", file=stdout)
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
            print("(conversation cleared)", file=stdout)
            continue
        turn = [{"role": "user", "content": message}]
        answer = _answer(engine, system + history + turn, args, params, stdout)
        if answer is not None:
            history += turn + [{"role": "assistant", "content": answer}]


def _answer(engine, messages, args, params, stdout) -> str | None:
    """Stream one answer; returns its text (partial if stopped), or None if it could not start.
    Any failure ends the turn, never the conversation."""
    text = ""
    stdout.write("specchat> ")
    events = None
    try:
        events = engine.generate(engine.chat_ids(messages), args.max_new_tokens, params, args.mode)
        for event in events:
            if isinstance(event, TextDelta):
                text += event.text
                stdout.write(event.text)
                stdout.flush()
            elif isinstance(event, Finished):
                stats = event.result.stats
                stdout.write(f"\n[{stats.tokens_per_second:.1f} tok/s, "
                             f"{stats.mean_accepted_per_forward:.2f} tokens per target forward]\n")
    except KeyboardInterrupt:
        stdout.write("\n(stopped)\n")
    except SpecchatError as error:
        stdout.write(f"\n(error: {error}; /reset starts a new conversation)\n")
        return None
    except Exception as error:  # a failed turn must not end the conversation
        stdout.write(f"\n(unexpected error: {type(error).__name__}: {error})\n")
        return None
    finally:
        if events is not None:
            events.close()  # releases the engine at once, also after Ctrl-C
    return text

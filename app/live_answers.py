"""Which conversations have an answer being written in this process: running, or waiting in the
engine's line. A saved answer stays `partial` both while it streams and after a crash cut it short;
only this process can tell the two apart, and only while it runs (a restart empties it), so another
tab, a reopened conversation or an export can say "being written" instead of "interrupted".

The chat's answer (`ChatLogic._answer`) is the one writer: it enters `writing` as it starts and
leaves it, whatever the ending (done, Stop, an error, the page gone), after its last save. In the
order they entered, so that an answer asked while another is written in the same conversation
(a second tab's question) can wait for it (`answer_turns`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class LiveAnswers:
    def __init__(self):
        self._lock = threading.Lock()  # each tab's answer runs on a thread of its own
        # Conversation id -> answers being written in it, oldest first (a second tab may ask while the first answers).
        self._writing: dict[str, list[object]] = {}

    @contextlib.contextmanager
    def writing(self, conversation_id: str) -> Iterator[object]:
        """An answer in `conversation_id` is being written for as long as the block runs; the block
        gets the answer's place in the line (`ahead_of`)."""
        answer = object()
        with self._lock:
            self._writing.setdefault(conversation_id, []).append(answer)
        try:
            yield answer
        finally:
            with self._lock:
                self._writing[conversation_id].remove(answer)
                if not self._writing[conversation_id]:
                    del self._writing[conversation_id]

    def ahead_of(self, conversation_id: str, answer: object) -> int:
        """How many answers in the conversation, begun before `answer` (`writing`'s), are still being written."""
        with self._lock:
            return self._writing[conversation_id].index(answer)

    def __contains__(self, conversation_id: object) -> bool:
        with self._lock:
            return conversation_id in self._writing

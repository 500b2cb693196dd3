"""Which conversations have an answer being written in this process: running, or waiting in the
engine's line. A saved answer stays `partial` both while it streams and after a crash cut it short;
only this process can tell the two apart, and only while it runs (a restart empties it), so another
tab, a reopened conversation or an export can say "being written" instead of "interrupted".

The chat's answer (`ChatLogic._answer`) is the one writer: it enters `writing` as it starts and
leaves it, whatever the ending (done, Stop, an error, the page gone), after its last save.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator


class LiveAnswers:
    def __init__(self):
        self._lock = threading.Lock()  # each tab's answer runs on a thread of its own
        # Conversation id -> answers being written in it (a second tab may ask while the first answers).
        self._writing: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def writing(self, conversation_id: str) -> Iterator[None]:
        """An answer in `conversation_id` is being written for as long as the block runs."""
        with self._lock:
            self._writing[conversation_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing[conversation_id] -= 1
                if not self._writing[conversation_id]:
                    del self._writing[conversation_id]

    def __contains__(self, conversation_id: object) -> bool:
        with self._lock:
            return conversation_id in self._writing

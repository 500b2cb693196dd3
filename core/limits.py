"""Size limits on what people and clients hand to specchat, each configurable by an environment
variable and named in the error that enforces it.

Bad input must never cost memory: every reader checks its limit before it reads (file sizes,
declared sizes) and while it reads (decompressed text), so a 1 MB archive that inflates to 1 GB
stops at the limit, not at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from .env_settings import env_number
from .errors import InputError
from .files import human_size

MB = 10**6


@dataclass(frozen=True)
class Limit:
    name: str  # what is limited, for the message: "document file", "API request body", ...
    variable: str  # the environment variable that changes it, in MB
    default_mb: float

    @property
    def bytes(self) -> int:
        """The limit in force: the variable's value (MB) when set (InputError naming it when bad)."""
        return int(env_number(self.variable, self.default_mb, wanted="a positive number of MB") * MB)

    def check(self, size: int, what: str = "") -> None:
        """An `InputError` naming the limit and how to raise it when `size` bytes exceed it."""
        if size > self.bytes:
            subject = what or f"the {self.name}"
            raise InputError(f"{subject} is {human_size(size)}, over the {self.name} limit of "
                             f"{human_size(self.bytes)} (set {self.variable} in MB to change it)")


# A document file as uploaded or given with --document (a PDF or .docx counts compressed).
DOCUMENT_FILE = Limit("document file", "SPECCHAT_MAX_DOCUMENT_MB", 50)
# The text a document yields once read (decompressed, UTF-8): no context holds more than ~1 MB.
DOCUMENT_TEXT = Limit("document text", "SPECCHAT_MAX_DOCUMENT_TEXT_MB", 8)
# One HTTP request body (the /v1 API, Gradio's events).
REQUEST_BODY = Limit("request body", "SPECCHAT_MAX_REQUEST_MB", 8)
# One file uploaded through the page.
UPLOAD = Limit("upload", "SPECCHAT_MAX_UPLOAD_MB", 50)
# One saved conversation file (documents included): what the meter counts within ~10 s on a
# 2-core CPU the first time (4 MB: 6-7 s; 60 MB took 145 s and 11 GB). A sent document fits a
# context (128K tokens: ~0.5 MB of text); larger ones are cut or summarized in parts first.
CONVERSATION_FILE = Limit("conversation file", "SPECCHAT_MAX_CONVERSATION_MB", 4)

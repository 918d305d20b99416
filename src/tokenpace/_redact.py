"""Secrets out of every log line and message: one helper for URLs, keys and tokens.

``redact(text)`` replaces with ``***``:

- the password of a URL's user information (``postgresql://user:PASSWORD@host``,
  ``redis://:PASSWORD@host``), up to the last ``@`` before a space or a quote;
- the value of a ``password=``, ``passwd=``, ``pwd=``, ``api_key=``, ``secret=`` or
  ``access_token=`` pair (a libpq connection string, a query string, a dict's repr);
- the token of a ``Bearer`` credential;
- every literal registered with ``add_secrets`` (an engine's API key, the passwords of the
  configured URLs), wherever it appears.

``install_log_redaction`` makes every log record of the process (tokenpace's, uvicorn's,
a library's) pass its message, exception text and stack through ``redact`` when it is
formatted. Cost: four regular-expression scans of each formatted line (a few microseconds
for a log line); a record with an exception formats its traceback once, as the formatter
would.
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

MASK = "***"

# The password runs to the last "@" before a space or a quote: one with a raw "@" or "/"
# in it (not percent-encoded) is masked whole.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^\s:/@'\"]*):[^\s'\"]*@")
_PAIRS = re.compile(r"(?i)\b(password|passwd|pwd|api[_-]?key|secret|access[_-]?token)"
                    r"(['\"]?\s*[=:]\s*['\"]?)[^\s&;,'\"}]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\",}]+")

MIN_SECRET_CHARS = 4
"""Registered literals shorter than this are not replaced (they would match ordinary text)."""

_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()
_literal: re.Pattern[str] | None = None


def redact(text: str) -> str:
    """``text`` with the secrets it shows replaced by ``***`` (see the module's doc)."""
    if _literal is not None:
        text = _literal.sub(MASK, text)
    if "://" in text:
        text = _USERINFO.sub(rf"\1:{MASK}@", text)
    text = _PAIRS.sub(rf"\1\2{MASK}", text)
    return _BEARER.sub(rf"\1{MASK}", text)


def url_password(url: str | None) -> str | None:
    """The password of ``url``'s user information (as given and percent-decoded), if any."""
    if not url or "://" not in url:
        return None
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return password or None


def add_secrets(values: Iterable[str | None]) -> None:
    """Register literals that ``redact`` replaces wherever they appear (and their
    percent-decoded forms). Registering is cumulative for the life of the process."""
    global _secrets, _literal
    found = {v for v in values if v and len(v) >= MIN_SECRET_CHARS}
    found |= {unquote(v) for v in found if len(unquote(v)) >= MIN_SECRET_CHARS}
    with _lock:
        merged = _secrets | found
        if merged == _secrets:
            return
        _secrets = frozenset(merged)
        # Longest first: a secret that contains another is replaced whole.
        _literal = re.compile("|".join(re.escape(s) for s in sorted(merged, key=len,
                                                                    reverse=True)))


class _RedactedRecord(logging.LogRecord):
    """A log record whose message, exception and stack text come out redacted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.exc_info and self.exc_info[0] is not None:
            # What logging.Formatter.formatException makes, redacted; the formatter uses
            # a record's exc_text when it is set.
            self.exc_text = redact("".join(traceback.format_exception(*self.exc_info))
                                   .rstrip("\n"))
        if self.stack_info:
            self.stack_info = redact(self.stack_info)

    def getMessage(self) -> str:
        return redact(super().getMessage())


def install_log_redaction() -> None:
    """Make every log record of this process come out redacted (idempotent)."""
    current = logging.getLogRecordFactory()
    if current is _RedactedRecord:
        return
    if current is not logging.LogRecord:
        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = current(*args, **kwargs)
            plain = _RedactedRecord.__new__(_RedactedRecord)
            plain.__dict__.update(record.__dict__)
            if plain.exc_info and plain.exc_info[0] is not None:
                plain.exc_text = redact("".join(traceback.format_exception(*plain.exc_info))
                                        .rstrip("\n"))
            return plain

        factory._tokenpace_redacts = True  # type: ignore[attr-defined]
        if not getattr(current, "_tokenpace_redacts", False):
            logging.setLogRecordFactory(factory)
        return
    logging.setLogRecordFactory(_RedactedRecord)

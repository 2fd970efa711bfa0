"""Bearer tokens at the edges: what one may hold, how it is read from an
``authorization`` value, and keeping every credential out of the logs.

A token is compared exactly as sent. It holds visible ASCII only: a control
character, a space or a byte that is not ASCII anywhere in it makes it no
valid token, so ``tok\\n`` never passes for ``tok``. The same rule refuses a
configured token that breaks it, naming where it is set and never the token.

The services' own code never logs a token. grpcio does: a metadata value that
is not UTF-8 is logged whole at ERROR (``Invalid encoding on b'Bearer ...'``),
so a client that appends one bad byte to a valid token puts the token in the
log. ``keep_credentials_out_of_logs`` installs a filter on grpc's loggers that
rewrites such records before any handler sees them; every process that serves
(the gRPC services, the gateway, ``dagnats dev``) calls it at start.
"""

from __future__ import annotations

import logging
import re

from dagnats.core.errors import InvalidArgument

BEARER = "bearer"

# What follows a scheme that carries a credential in a message: up to the
# next space, quote or comma (a bytes literal, a tuple of metadata, a header).
_IN_TEXT = re.compile(r"(?i)\b(bearer|basic)(?:\s|\\x20|%20)+[^\s'\",)]+")
REDACTED = "[redacted]"
# grpcio's message for a metadata value that is not UTF-8: the value follows.
_INVALID_ENCODING = "Invalid encoding on"


def is_bearer_token(text: str) -> bool:
    """Whether ``text`` can be a token: not empty, visible ASCII only."""
    return bool(text) and text.isascii() and text.isprintable() and " " not in text


def bearer_token(value: str) -> str:
    """The token of an ``authorization`` value ``Bearer <token>``, exactly as
    sent, or ``""`` (a credential that is not valid) for another scheme and
    for a token that ``is_bearer_token`` refuses. One or more spaces separate the
    scheme from the token (RFC 9110); nothing else is taken off."""
    scheme, _, token = value.partition(" ")
    token = token.lstrip(" ")
    if scheme.lower() != BEARER or not is_bearer_token(token):
        return ""
    return token


def check_bearer_token(token: str, *, source: str) -> str:
    """``token``, checked as a configured token.

    Raises:
        InvalidArgument: it is not a token (``is_bearer_token``); the message names
            ``source`` and never the token.
    """
    if not is_bearer_token(token):
        raise InvalidArgument(
            f"{source}: a token is visible ASCII characters only, with no space "
            "or control character (a newline left in a file or variable?)",
            field=source,
        )
    return token


def redact(text: str) -> str:
    """``text`` with what follows a ``Bearer`` or ``Basic`` scheme replaced."""
    return _IN_TEXT.sub(lambda m: f"{m.group(1)} {REDACTED}", text)


class CredentialFilter(logging.Filter):
    """Rewrites a record that would carry a credential: grpcio's message of a
    metadata value that is not UTF-8 loses the value (it may be any header,
    a token or not), and a ``Bearer``/``Basic`` credential in any message or
    traceback is redacted. Records are never dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_INVALID_ENCODING):
            record.msg = f"{_INVALID_ENCODING} a metadata value (left out: it may be a credential)"
            record.args = None
        else:
            try:
                message = record.getMessage()
            except (TypeError, ValueError):  # a malformed record: logging reports it
                return True
            cleaned = redact(message)
            if cleaned != message:
                record.msg, record.args = cleaned, None
        if record.exc_info is not None and record.exc_text is None:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


_FILTER = CredentialFilter()


# The logger of grpcio's C extension, which logs metadata values; made here
# if grpc is not imported yet, and taken by grpc when it is.
GRPC_EXTENSION_LOGGER = "grpc._cython.cygrpc"


def keep_credentials_out_of_logs() -> None:
    """Install ``CredentialFilter`` on grpc's loggers: its C extension's and
    every other one made so far (a filter applies to the records of its own
    logger, not of its children). Idempotent."""
    names = [n for n in logging.root.manager.loggerDict if n == "grpc" or n.startswith("grpc.")]
    for name in {*names, GRPC_EXTENSION_LOGGER}:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)

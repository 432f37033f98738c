"""Cursors: where a client asks a stream or a list to go on from, checked before a store sees it.

Every route that resumes takes its cursor through here, so a store only ever
reads from a place that exists: an event cursor is a whole number from 0 (the
beginning) to ``MAX_EVENT``, and a list cursor is an id of bounded length.
A value outside that is the client's mistake, a 400 naming the parameter.
"""

from __future__ import annotations

from api.errors import bad_request

MAX_EVENT = 2**53 - 1  # the largest whole number every JSON reader keeps exactly
MAX_ID_LENGTH = 256


def event_cursor(value: str | None, name: str) -> int:
    """The event number to resume after (0 when absent): digits only, at most ``MAX_EVENT``."""
    if value is None or value == "":
        return 0
    number = int(value) if value.isascii() and value.isdigit() and len(value) <= 16 else -1
    if not 0 <= number <= MAX_EVENT:
        raise bad_request(
            f"{name} must be an event number from this stream (0 to {MAX_EVENT}), got {value!r}",
            name,
        )
    return number


def id_cursor(value: str | None, name: str) -> str | None:
    """An object id to list after (None when absent), at most ``MAX_ID_LENGTH`` characters."""
    if value is not None and len(value) > MAX_ID_LENGTH:
        raise bad_request(
            f"{name} must be an id from a previous page (at most {MAX_ID_LENGTH} characters), "
            f"got {len(value)} characters",
            name,
        )
    return value


__all__ = ["MAX_EVENT", "MAX_ID_LENGTH", "event_cursor", "id_cursor"]

"""User-facing errors: bad input exits 2 with a message naming the file, the field and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class InputError(Exception):
    """Bad input a user can fix: names the file (when known), the field path and what is allowed.

    The CLI turns it into ``moesim: error: FILE: FIELD: MESSAGE`` on stderr and exit status 2.
    """

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None):
        self.message = message
        self.file = file
        self.field = field
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.field) if p]
        return ": ".join([*parts, self.message])

    def with_file(self, file: str) -> InputError:
        """The same error, naming ``file`` if it did not name one yet."""
        if self.file is None:
            self.file = file
        return self


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""

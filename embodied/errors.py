"""Errors a user can fix: shown as one paragraph and exit code 2, no traceback."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Bad input (config, names, paths): the message says what is wrong and how to fix it."""


def unknown_name_error(what: str, name: str, known: list[str]) -> UserError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    listed = ", ".join(sorted(known)[:40]) + (" ..." if len(known) > 40 else "")
    return UserError(f"Unknown {what} {name!r}.{hint} Known: {listed}.")

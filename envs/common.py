"""What every layer needs: the user-facing error and the name registry.

It lives on the ground floor (``envs/``, see docs/architecture.md "Layers") and imports nothing of
the project, so that ``policies/``, ``scheduler/`` and ``embodied/`` can all use it without an
upward import.

    LOSSES = Registry("loss (algorithm.loss)")

    @LOSSES.register("ppo")
    def ppo_loss(...): ...

    LOSSES.get("ppo")   # unknown names raise a UserError listing the known ones
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """Bad input (config, names, paths) a user can fix: the message says what is wrong and how to
    fix it. The CLI shows it as one paragraph and exits with code 2, without a traceback."""


def unknown_name_error(what: str, name: str, known: list[str]) -> UserError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    listed = ", ".join(sorted(known)[:40]) + (" ..." if len(known) > 40 else "")
    return UserError(f"Unknown {what} {name!r}.{hint} Known: {listed}.")


class Registry(dict):
    """Names -> objects, filled by the :meth:`register` decorator; :meth:`get` of an unknown name
    raises a :class:`UserError` that lists the known ones."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what  # how error messages name an entry, with the config key that picks it

    def register(self, name: str) -> Callable:
        def decorator(obj: Any) -> Any:
            self[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> Any:  # type: ignore[override]
        if name not in self:
            raise unknown_name_error(self.what, name, list(self))
        return self[name]

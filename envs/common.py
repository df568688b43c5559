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
import importlib
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
    raises a :class:`UserError` that lists the known ones.

    ``modules`` (name -> the module whose import registers it) makes entries lazy: :meth:`get` imports
    a name's module the first time it is asked for, so a process imports only what it uses (pi0's
    module pulls in transformers, 2.6 s of every policy worker's start-up for an MLP run)."""

    def __init__(self, what: str, modules: dict[str, str] | None = None):
        super().__init__()
        self.what = what  # how error messages name an entry, with the config key that picks it
        self.modules = dict(modules or {})

    def knows(self, name: str) -> bool:
        """Registered, or to be by its module."""
        return name in self or name in self.modules

    def names(self) -> list[str]:
        return sorted(set(self) | set(self.modules))

    def register(self, name: str) -> Callable:
        def decorator(obj: Any) -> Any:
            self[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> Any:  # type: ignore[override]
        if name not in self and name in self.modules:
            importlib.import_module(self.modules[name])
        if name not in self:
            raise unknown_name_error(self.what, name, self.names())
        return self[name]

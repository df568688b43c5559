"""A name -> object registry filled by a decorator, as ManiSkill registers its tasks.

    LOSSES = Registry("loss (algorithm.loss)")

    @LOSSES.register("ppo")
    def ppo_loss(...): ...

    LOSSES.get("ppo")   # unknown names raise a UserError listing the known ones
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from embodied.errors import unknown_name_error


class Registry(dict):
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

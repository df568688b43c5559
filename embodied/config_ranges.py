"""The range every numeric config key is checked against: :func:`ranged` declares a key's default
and range in the schema (embodied/config.py), :func:`check_ranges` checks a composed config."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from envs.common import UserError


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: from ``low`` (excluded when ``above``) to ``high``; None: open."""

    low: float | None = None
    high: float | None = None
    above: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.high is None:
            return f"{'>' if self.above else '>='} {self.low:g}"
        return f"in {'(' if self.above else '['}{self.low:g}, {self.high:g}]"


def ranged(default, low: float | None = None, high: float | None = None, *, above: bool = False):
    """A numeric key's default and the range its values must lie in (:func:`check_ranges`; None is
    always allowed where the type allows it)."""
    return field(default=default, metadata={"range": Range(low, high, above)})


def check_ranges(cfg, prefix: str = "") -> None:
    """A UserError for the first numeric key of ``cfg`` (a ``TrainConfig``, or a section of one under
    ``prefix``) outside its range (its ``ranged`` fields), in nested sections too (``policy.vla``)."""
    for key in fields(cfg):
        allowed, value = key.metadata.get("range"), getattr(cfg, key.name)
        if is_dataclass(value):
            check_ranges(value, f"{prefix}{key.name}.")
        elif allowed is not None and value is not None and not allowed.holds(value):
            raise UserError(f"{prefix}{key.name}={value} is out of range: it must be {allowed.describe()} "
                            f"({type(cfg).__name__} in {defining_file(type(cfg))} says what it means). Fix the "
                            "override or the yaml file that sets it.")


def defining_file(schema: type) -> str:
    """The file that declares a config section, from the project's root: ``embodied/algorithm_config.py``."""
    path = Path(inspect.getsourcefile(schema)).resolve()
    root = Path(__file__).resolve().parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

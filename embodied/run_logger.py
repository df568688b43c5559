"""Run output a person watches: a progress bar (env-steps/s, ETA) and TensorBoard scalars."""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm


class RunLogger:
    """TensorBoard scalars under ``<run_dir>/tb`` (namespaces env/, train/, time/, eval/)
    and a tqdm bar over env steps.

    A run stops at whichever budget binds first, ``total_steps`` or ``max_seconds`` of training: where
    the time limit would stop it first, the bar's total is the steps it will have run by then, so its
    ETA is the time limit's, not that of steps the run will never reach."""

    def __init__(self, run_dir: Path, total_steps: int, initial_steps: int = 0, progress: bool = True,
                 max_seconds: float | None = None, elapsed_s: float = 0.0):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))
        self.total_steps, self.max_seconds = total_steps, max_seconds
        self.steps, self.expected_steps = initial_steps, total_steps
        self._since = (initial_steps, elapsed_s)  # where this process's rate is measured from
        self.description = "train" if max_seconds is None else f"train ({max_seconds / 60:g} min cap)"
        self.bar = tqdm(total=total_steps, initial=initial_steps, unit="step", unit_scale=True,
                        dynamic_ncols=True, disable=not progress, file=sys.stderr, desc=self.description)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def note(self, tag: str, text: str) -> None:
        """A line on stderr (above the bar) and a TensorBoard text entry."""
        self.bar.write(f"{tag}: {text}", file=sys.stderr)
        self.writer.add_text(tag, text)

    def text(self, tag: str, text: str) -> None:
        """A TensorBoard text entry only (for lines already printed)."""
        self.writer.add_text(tag, text)

    def advance(self, steps: int, success: float | None = None, elapsed_s: float | None = None) -> None:
        """``steps`` more done; ``elapsed_s``: the run's training seconds so far (for a time limit)."""
        if success is not None:
            self.bar.set_postfix(success_once=f"{success:.2f}", refresh=False)
        self.steps += steps
        if self.max_seconds is not None and elapsed_s is not None:
            self.expected_steps = self.bar.total = self.steps_by_the_end(self.steps, elapsed_s)
        self.bar.update(steps)

    def steps_by_the_end(self, steps: int, elapsed_s: float) -> int:
        """The env steps the run will have done when it stops, at the rate it has run so far: the time
        limit's share or ``total_steps``, whichever is fewer."""
        first_steps, first_s = self._since
        if elapsed_s <= first_s or steps <= first_steps:
            return self.total_steps
        rate = (steps - first_steps) / (elapsed_s - first_s)
        by_the_limit = steps + rate * max(0.0, self.max_seconds - elapsed_s)
        return int(min(self.total_steps, by_the_limit))

    def close_progress(self) -> None:
        self.bar.close()

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


def read_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(env step, value)`` of every TensorBoard scalar ``tag`` a run wrote under ``run_dir/tb``
    (none: an empty list)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []

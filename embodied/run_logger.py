"""Run output a person watches: a progress bar (env-steps/s, ETA) and TensorBoard scalars."""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm


class RunLogger:
    """TensorBoard scalars under ``<run_dir>/tb`` (namespaces env/, train/, time/, eval/)
    and a tqdm bar over env steps."""

    def __init__(self, run_dir: Path, total_steps: int, initial_steps: int = 0, progress: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))
        self.bar = tqdm(total=total_steps, initial=initial_steps, unit="step", unit_scale=True,
                        dynamic_ncols=True, disable=not progress, file=sys.stderr, desc="train")

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

    def advance(self, steps: int, success: float | None = None) -> None:
        if success is not None:
            self.bar.set_postfix(success_once=f"{success:.2f}", refresh=False)
        self.bar.update(steps)

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

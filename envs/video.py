"""Episode videos (mp4 through imageio-ffmpeg) with step, reward and success drawn on each frame."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def annotate(frame: np.ndarray, lines: list[str], success: bool) -> np.ndarray:
    """Draw ``lines`` top-left on ``frame`` [H, W, 3] uint8; a green border marks success."""
    image = Image.fromarray(np.ascontiguousarray(frame))
    draw = ImageDraw.Draw(image)
    y = 4
    for line in lines:
        draw.text((5, y + 1), line, fill=(0, 0, 0))
        draw.text((4, y), line, fill=(255, 255, 255))
        y += 12
    if success:
        w, h = image.size
        draw.rectangle([0, 0, w - 1, h - 1], outline=(0, 220, 0), width=4)
    return np.asarray(image)


class VideoRecorder:
    """Collects annotated frames of one episode and writes them as an mp4."""

    def __init__(self, path: str | Path, fps: int = 20):
        self.path = Path(path)
        self.fps = fps
        self.frames: list[np.ndarray] = []
        self.total_reward = 0.0

    def add(self, frame: np.ndarray, step: int, reward: float | None = None, success: bool = False,
            caption: str = "") -> None:
        if reward is not None:
            self.total_reward += reward
        lines = ([caption] if caption else []) + [f"step {step}"]
        if reward is not None:
            lines.append(f"reward {reward:+.3f}  return {self.total_reward:.2f}")
        lines.append("success" if success else "")
        self.frames.append(annotate(frame, lines, success))

    def save(self) -> Path:
        import imageio.v2 as imageio

        self.path.parent.mkdir(parents=True, exist_ok=True)
        imageio.mimwrite(self.path, self.frames, fps=self.fps, codec="libx264", quality=7,
                         macro_block_size=1)
        return self.path

"""What pi0 / pi0.5 see, built as their reference pre-processing builds it (lerobot 0.6.1):
images resized with padding to the vision size and mapped to [-1, 1], the state normalised (pi0:
mean/std; pi0.5: quantiles) and padded, the prompt (pi0: the task and a newline; pi0.5: the task and
the normalised state cut into 256 bins), and the actions un-normalised on the way out.

Shapes: images ``[B, 3, H, W]`` float in [0, 1]; states ``[B, S]``; actions ``[B, H, A]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import nn

STATE_BINS = 256  # pi0.5's prompt: the normalised state in [-1, 1] as bin indices 0 .. 255


def resize_with_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, 3, H, W]`` in [0, 1] -> ``[B, 3, size, size]``: scaled (bilinear) so the longer side fits,
    clamped to [0, 1], then centred on black (the odd pixel of padding at the bottom / right)."""
    h, w = images.shape[-2:]
    if (h, w) == (size, size):
        return images
    ratio = max(w / size, h / size)
    new_h, new_w = int(h / ratio), int(w / ratio)
    resized = nn.functional.interpolate(images.float(), size=(new_h, new_w), mode="bilinear",
                                        align_corners=False).clamp(0.0, 1.0)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    return nn.functional.pad(resized, (left, size - new_w - left, top, size - new_h - top), value=0.0)


def vision_input(images: torch.Tensor, size: int) -> torch.Tensor:
    """The vision tower's input: resized with padding, then mapped from [0, 1] to [-1, 1]."""
    return resize_with_pad(images, size) * 2.0 - 1.0


def pil_resize_with_pad(frames: torch.Tensor, size: int) -> torch.Tensor:
    """openpi's client-side resize (``openpi_client.image_tools.resize_with_pad``): uint8 frames
    ``[B, H, W, 3]`` -> uint8 ``[B, size, size, 3]``, each scaled by PIL's bilinear filter (which widens
    when it shrinks: antialiased, unlike :func:`resize_with_pad`) so the longer side fits, then centred
    on black. Frames already ``size`` square pass through."""
    h, w = frames.shape[1:3]
    if (h, w) == (size, size):
        return frames
    ratio = max(w / size, h / size)
    new_w, new_h = int(w / ratio), int(h / ratio)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    out = torch.zeros(frames.shape[0], size, size, 3, dtype=torch.uint8)
    for i, frame in enumerate(frames.cpu().numpy()):
        resized = Image.fromarray(frame).resize((new_w, new_h), resample=Image.BILINEAR)
        out[i, top:top + new_h, left:left + new_w] = torch.from_numpy(np.asarray(resized))
    return out.to(frames.device)


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the last dimension to ``width`` (never truncates)."""
    return nn.functional.pad(x, (0, max(width - x.shape[-1], 0)))


def pi0_prompt(task: str) -> str:
    """pi0's prompt: the task, ending in a newline."""
    return task if task.endswith("\n") else task + "\n"


def clean_task(task: str) -> str:
    """pi0.5's task text: stripped, ``_`` and newlines as spaces."""
    return task.strip().replace("_", " ").replace("\n", " ")


def pi05_prompt(task: str, state: torch.Tensor | None) -> str:
    """pi0.5's prompt for one normalised state ``[S]``: ``Task: <task>, State: <bins>;\\nAction: ``, each
    number its bin of ``[-1, 1]`` cut in 256 (below -1: -1; at or above the last edge: 255). Without a
    state (openpi's pi05_libero): the cleaned task and a newline."""
    if state is None:
        return clean_task(task) + "\n"
    edges = torch.linspace(-1.0, 1.0, STATE_BINS + 1, dtype=torch.float64)[:-1]
    bins = torch.bucketize(state.double().cpu(), edges, right=True) - 1
    return f"Task: {clean_task(task)}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "


@dataclass
class Normalizer:
    """A feature's statistics and the rule the checkpoint trained with: ``mean_std`` (pi0) or
    ``quantiles`` (pi0.5: ``q01 .. q99`` to ``[-1, 1]``, no clipping), in one of two conventions:

    - ``lerobot``: ``(x - mean) / (std + eps)``, back ``y * std + mean``; quantile width ``q99 - q01``,
      ``eps`` where it is 0 (eps 1e-8, the processor's);
    - ``openpi`` (``transforms.Normalize``): ``eps = 1e-6`` added to ``std`` and to the quantile width,
      both ways."""

    mode: str
    stats: dict[str, torch.Tensor]
    eps: float = 1e-8
    convention: str = "lerobot"

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        s = {k: v.to(x.device, x.dtype) for k, v in self.stats.items()}
        if self.mode == "mean_std":
            return (x - s["mean"]) / (s["std"] + self.eps)
        return 2 * (x - s["q01"]) / self._width(s) - 1

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        s = {k: v.to(y.device, y.dtype) for k, v in self.stats.items()}
        if self.mode == "mean_std":
            scale = s["std"] + self.eps if self.convention == "openpi" else s["std"]
            return y * scale + s["mean"]
        return (y + 1) * self._width(s) / 2 + s["q01"]

    def _width(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        width = s["q99"] - s["q01"]
        if self.convention == "openpi":
            return width + self.eps
        return torch.where(width == 0, torch.full_like(width, self.eps), width)

"""How a checkpoint family wants its observations and actions: the settings of its authors' eval script.

A published VLA checkpoint only reproduces its numbers when it sees frames prepared as its
training data was, and when its actions are post-processed as its authors' eval script does.
:class:`InputAdapter` holds those settings (``policy.vla.mirror_images``, ``dataset_resize``, ``center_crop``,
``gripper``; each family's
policy config file sets them, docs/vla_checkpoints.md lists which), applied in the policy, so
training rollouts, evaluation and recording all see the same inputs:

- ``mirror``: LIBERO-trained OpenVLA / OFT checkpoints saw LIBERO's raw renders rotated by 180
  degrees (``img[::-1, ::-1]``). Our LIBERO env returns upright frames (``raw[::-1]``), so that
  rotation is a left-right mirror of ours.
- ``dataset_resize``: the JPEG round trip and lanczos3 resize of the RLDS data pipeline
  (:func:`policies.vla.image_ops.dataset_resize`), before the checkpoint's own processor.
- ``center_crop``: the central fraction of the area, resized back (random-crop augmentation).
- ``gripper``: the last action dimension's post-processing (:data:`GRIPPERS`).

Shapes: frames uint8 ``[B, H, W, 3]``; actions ``[..., A]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from envs.common import unknown_name_error
from policies.vla import image_ops


def _libero_gripper(gripper: torch.Tensor) -> torch.Tensor:
    """OpenVLA / OFT's LIBERO post-processing: ``[0, 1] -> [-1, 1]``, binarised (``sign``), then
    inverted (their data has 0 = close, LIBERO's controller -1 = open)."""
    return -torch.sign(2.0 * gripper - 1.0)


GRIPPERS: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {"none": None, "libero": _libero_gripper}


@dataclass(frozen=True)
class InputAdapter:
    mirror: bool = False
    dataset_resize: int | None = None
    center_crop: float | None = None
    gripper: str = "none"

    @classmethod
    def from_config(cls, cfg) -> InputAdapter:
        """The policy config's adapter fields; an unknown gripper mode is a UserError (the crop's range,
        (0, 1], is checked with every numeric key when the config is read: embodied/config.py)."""
        if cfg.vla.gripper not in GRIPPERS:
            raise unknown_name_error("gripper post-processing (policy.vla.gripper)", cfg.vla.gripper, list(GRIPPERS))
        return cls(bool(cfg.vla.mirror_images), cfg.vla.dataset_resize, cfg.vla.center_crop, cfg.vla.gripper)

    @property
    def changes_frames(self) -> bool:
        return self.mirror or self.dataset_resize is not None or self.center_crop is not None

    def frames(self, rgb: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` -> the frames the checkpoint's processor should see (uint8 ``[B, H', W', 3]``)."""
        if not self.changes_frames:
            return rgb
        return torch.from_numpy(np.stack([self._frame(f) for f in rgb.detach().cpu().numpy()])).to(rgb.device)

    def _frame(self, frame: np.ndarray) -> np.ndarray:
        if self.mirror:
            frame = frame[:, ::-1]
        if self.dataset_resize is not None and frame.shape[:2] != (self.dataset_resize, self.dataset_resize):
            frame = image_ops.dataset_resize(np.ascontiguousarray(frame), self.dataset_resize)
        if self.center_crop is not None:
            frame = image_ops.center_crop(np.ascontiguousarray(frame), self.center_crop)
        return np.ascontiguousarray(frame)

    def actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Continuous actions ``[..., A]`` -> what the env is given (the gripper post-processed)."""
        post = GRIPPERS[self.gripper]
        if post is None:
            return actions
        return torch.cat([actions[..., :-1], post(actions[..., -1:])], dim=-1)

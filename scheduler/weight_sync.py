"""Weight sync from the actor to rollout workers.

Two ways, chosen by ``placement.weight_sync`` (``auto`` picks the first when actor and
rollout workers share a node):

- ``shared_memory``: the actor copies its weights into one flat buffer in
  ``/dev/shm``; rollout workers on CPU use views of that buffer as their parameters
  (in place: nothing to copy on their side), rollout workers on a GPU copy from it.
- ``object_store``: the actor's weights go through Ray's object store (any node).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch

WEIGHT_SYNC_METHODS = ("auto", "shared_memory", "object_store")
_ALIGN = 64  # bytes: every tensor starts on a cache line


@dataclass(frozen=True)
class SharedLayout:
    """Where each tensor of a state dict sits in the shared buffer."""

    path: str
    nbytes: int
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]  # name, dtype, shape, offset


def plan_layout(state_dict: dict[str, torch.Tensor], directory: str = "/dev/shm") -> SharedLayout:
    entries, offset = [], 0
    for name, t in state_dict.items():
        entries.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return SharedLayout(os.path.join(directory, f"embodied-weights-{uuid.uuid4().hex}"), max(offset, _ALIGN),
                        tuple(entries))


class SharedWeights:
    """A state dict living in a shared file: ``views[name]`` are tensors backed by it."""

    def __init__(self, layout: SharedLayout):
        self.layout = layout
        flat = torch.from_file(layout.path, shared=True, size=layout.nbytes, dtype=torch.uint8)
        self.views: dict[str, torch.Tensor] = {}
        for name, dtype, shape, offset in layout.entries:
            numel = int(torch.Size(shape).numel())
            size = numel * torch.empty(0, dtype=dtype).element_size()
            self.views[name] = flat[offset:offset + size].view(dtype).view(shape)

    def write(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in state_dict.items():
                self.views[name].copy_(t)

    def unlink(self) -> None:
        """Remove the file name; mappings already made stay valid until their processes end."""
        try:
            os.unlink(self.layout.path)
        except FileNotFoundError:
            pass


def use_views_as_parameters(module: torch.nn.Module, views: dict[str, torch.Tensor]) -> int:
    """Point ``module``'s CPU parameters and buffers at ``views`` (in place, no copy) or
    copy into them on another device. Returns the bytes copied (0 when in place)."""
    copied = 0
    with torch.no_grad():
        for name, t in _named_tensors(module):
            view = views[name]
            if t.device.type == "cpu":
                if t.data_ptr() != view.data_ptr():
                    t.data = view
            else:
                t.copy_(view, non_blocking=True)
                copied += view.numel() * view.element_size()
    return copied


def _named_tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if b is not None)

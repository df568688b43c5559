"""Weight sync from the actor to rollout workers.

Three ways, chosen by ``placement.weight_sync`` (``auto``: ``shared_memory`` when actor
and rollout workers share a node, else ``object_store``):

- ``shared_memory``: the actor copies its weights into one flat buffer in
  ``/dev/shm``; rollout workers on CPU use views of that buffer as their parameters
  (in place: nothing to copy on their side), rollout workers on a GPU copy from it.
- ``object_store``: the actor's weights go through Ray's object store (any node).
- ``broadcast``: one collective broadcast from the actor (rank 0) to every rollout
  worker over torch.distributed (NCCL between GPUs, gloo on CPU), any node: the
  fast path between split GPUs.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import torch

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
    persistent = set(module.state_dict(keep_vars=True))  # not e.g. rotary tables rebuilt on load
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if b is not None and n in persistent)


# -- process groups: the weight broadcast, and the actor ranks (scheduler/runtime/data_parallel.py) ----
def group_address() -> str:
    """``ip:port`` on this node for rank 0 of a torch.distributed process group to listen on."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def join_process_group(address: str, rank: int, world_size: int, device: torch.device) -> None:
    """Join the group rank 0 opened at ``address`` (every member must call this at once): this
    process's default group, NCCL on GPUs, gloo on CPUs (a process is in one such group)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world_size)


def broadcast_module(module: torch.nn.Module, src: int = 0) -> int:
    """Send (on ``src``) or receive (elsewhere) ``module``'s parameters and buffers in one
    collective over a flat byte buffer. Returns the bytes broadcast."""
    import torch.distributed as dist

    tensors = [t for _, t in _named_tensors(module)]
    device = tensors[0].device
    with torch.no_grad():
        if dist.get_rank() == src:
            flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src)
        if dist.get_rank() != src:
            offset = 0
            for t in tensors:
                size = t.numel() * t.element_size()
                t.view(-1).view(torch.uint8).copy_(flat[offset:offset + size])
                offset += size
    return flat.numel()

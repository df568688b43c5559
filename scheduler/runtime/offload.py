"""Context switching: park what a worker holds on its device in host memory, and bring it back.

Groups that share a device take turns on it (see :class:`~scheduler.runtime.context_switch.ContextSwitcher`);
the group whose turn it is not offloads. :class:`DeviceState` moves a module's
parameters, buffers and gradients and an optimizer's state to host memory (pinned,
for fast copies back, when the device is a GPU) and frees their device storage;
:meth:`DeviceState.onload` restores them bit for bit. Parameter objects keep their
identity, so the optimizer and any references to them stay valid.

A module sharded with FSDP2 (data-parallel actor ranks, ``scheduler/runtime/data_parallel.py``)
keeps references of its own to each rank's shard (padded flat buffers the all-gathers read),
which swapping ``param.data`` would leave stale: its shards move with ``module.to`` instead,
which FSDP2 re-registers; the optimizer's state (DTensor shards) is parked like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SwitchReport:
    """What an offload or onload moved, and the device memory around it (CUDA only)."""

    bytes_moved: int = 0
    device_bytes_before: int | None = None
    device_bytes_after: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "to_local"):  # a DTensor: its local shard moves
        return t.to("cpu", copy=True)
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=False)
    return t.detach().clone()


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor on ``t``'s device, so the original's storage is freed."""
    return torch.empty(0, dtype=t.dtype, device=t.device)


class DeviceState:
    """The device-resident state of one worker: ``module`` (+ ``optimizer``)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        from torch.distributed.fsdp import FSDPModule

        self.module = module
        self.optimizer = optimizer
        self.offloaded = False
        self.sharded = isinstance(module, FSDPModule)  # its shards move with module.to (see the module doc)
        self._home: torch.device | None = None
        # (owner, attribute or key, host copy, device) for every tensor parked
        self._parked: list[tuple[object, str, torch.Tensor, torch.device]] = []

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device if not self.offloaded else self._home

    def _tensor_slots(self):
        """Every (owner, name, tensor) this state parks itself (FSDP: the optimizer's alone)."""
        if not self.sharded:
            yield from self._module_slots()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for name, value in state.items():
                    if torch.is_tensor(value) and value.device.type == self.device.type:
                        yield state, name, value

    def _module_slots(self):
        for param in self.module.parameters():
            yield param, "data", param.data
            if param.grad is not None:
                yield param, "grad", param.grad
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None:
                    yield mod._buffers, name, buf

    def _move_shards(self, to: torch.device) -> int:
        """FSDP: move the module's shards (parameters, grads, buffers) to ``to``; the bytes moved
        (none between CPU slots: host memory is where they are)."""
        if not self.sharded or next(self.module.parameters()).device == to:
            return 0
        moved = sum(_local(t).numel() * t.element_size() for _, _, t in self._module_slots())
        self.module.to(to)
        return moved

    def offload(self) -> SwitchReport:
        """Copy every device tensor to host memory and free the device copies."""
        if self.offloaded:
            return SwitchReport()
        device = self.device
        report = SwitchReport(device_bytes_before=_device_bytes(device))
        report.bytes_moved = self._park_all()
        report.bytes_moved += self._move_shards(torch.device("cpu"))
        self._home = device
        self.offloaded = True
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.device_bytes_after = _device_bytes(device)
        return report

    def _park_all(self) -> int:
        """Copy every slot to host first (a failure leaves the device state intact), then free."""
        slots = list(self._tensor_slots())
        self._parked = [(owner, name, _to_host(t), t.device) for owner, name, t in slots]
        for owner, name, t in slots:
            _assign(owner, name, None if name == "grad" else _placeholder(t))
        return sum(_local(host).numel() * host.element_size() for _, _, host, _ in self._parked)

    def onload(self) -> SwitchReport:
        """Bring every parked tensor back to its device, bit for bit."""
        if not self.offloaded:
            return SwitchReport()
        device = self._home
        report = SwitchReport(device_bytes_before=_device_bytes(device))
        for owner, name, host, dev in self._parked:
            _assign(owner, name, host.to(dev, copy=True))
            report.bytes_moved += _local(host).numel() * host.element_size()
        self._parked = []
        report.bytes_moved += self._move_shards(device)
        self.offloaded = False
        report.device_bytes_after = _device_bytes(device)
        return report

    def resident_bytes(self) -> int:
        """Bytes this state holds on its device now (0 while offloaded; FSDP: this rank's shards)."""
        if self.offloaded:
            return 0
        slots = [*self._tensor_slots(), *(self._module_slots() if self.sharded else ())]
        return sum(_local(t).numel() * t.element_size() for _, _, t in slots)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _assign(owner: object, name: str, tensor: torch.Tensor) -> None:
    if isinstance(owner, dict):
        owner[name] = tensor
    elif name == "data":
        owner.data = tensor
    else:
        setattr(owner, name, tensor)

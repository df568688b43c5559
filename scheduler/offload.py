"""Context switching: park what a worker holds on its device in host memory, and bring it back.

Groups that share a device take turns on it (see :class:`~embodied.runner.ContextSwitcher`);
the group whose turn it is not offloads. :class:`DeviceState` moves a module's
parameters, buffers and gradients and an optimizer's state to host memory (pinned,
for fast copies back, when the device is a GPU) and frees their device storage;
:meth:`DeviceState.onload` restores them bit for bit. Parameter objects keep their
identity, so the optimizer and any references to them stay valid.
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
        self.module = module
        self.optimizer = optimizer
        self.offloaded = False
        # (owner, attribute or key, host copy, device) for every tensor parked
        self._parked: list[tuple[object, str, torch.Tensor, torch.device]] = []

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device if not self.offloaded else self._parked[0][3]

    def _tensor_slots(self):
        """Every (owner, name, tensor) this state holds on the device."""
        for param in self.module.parameters():
            yield param, "data", param.data
            if param.grad is not None:
                yield param, "grad", param.grad
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None:
                    yield mod._buffers, name, buf
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for name, value in state.items():
                    if torch.is_tensor(value) and value.device.type == self.device.type:
                        yield state, name, value

    def offload(self) -> SwitchReport:
        """Copy every device tensor to host memory and free the device copies."""
        if self.offloaded:
            return SwitchReport()
        device = self.device
        report = SwitchReport(device_bytes_before=_device_bytes(device))
        report.bytes_moved = self._park_all()
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
        return sum(host.numel() * host.element_size() for _, _, host, _ in self._parked)

    def onload(self) -> SwitchReport:
        """Bring every parked tensor back to its device, bit for bit."""
        if not self.offloaded:
            return SwitchReport()
        device = self._parked[0][3]
        report = SwitchReport(device_bytes_before=_device_bytes(device))
        for owner, name, host, dev in self._parked:
            _assign(owner, name, host.to(dev, copy=True))
            report.bytes_moved += host.numel() * host.element_size()
        self._parked = []
        self.offloaded = False
        report.device_bytes_after = _device_bytes(device)
        return report

    def resident_bytes(self) -> int:
        """Bytes this state holds on its device now (0 while offloaded)."""
        return sum(t.numel() * t.element_size() for _, _, t in self._tensor_slots())


def _assign(owner: object, name: str, tensor: torch.Tensor) -> None:
    if isinstance(owner, dict):
        owner[name] = tensor
    elif name == "data":
        owner.data = tensor
    else:
        setattr(owner, name, tensor)

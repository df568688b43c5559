"""ActorWorker: holds the trainable policy and optimizer; turns trajectories into updates."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from embodied.algorithms.ppo import critic_warmup_update, optimizer_groups, ppo_update
from envs.messages import Trajectory
from envs.seeds import Purpose, RunSeeds
from policies.registry import make_policy
from scheduler.offload import DeviceState
from scheduler.weight_sync import (
    SharedLayout,
    SharedWeights,
    broadcast_address,
    broadcast_module,
    join_broadcast_group,
    plan_layout,
)
from scheduler.worker import Worker


class ActorWorker(Worker):
    def __init__(self, policy_cfg, algorithm_cfg, obs_spec: dict, action_dim: int, seed: int,
                 update_threads: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.update_threads = update_threads
        seeds = RunSeeds(seed)
        torch.manual_seed(seeds.generator(Purpose.INIT))
        self.cfg = algorithm_cfg
        self.policy = make_policy(policy_cfg, obs_spec, action_dim).to(self.device)
        # only trainable parameters (LoRA: adapters + value head); the critic's in a group of its own with critic_lr
        self.optimizer = torch.optim.Adam(optimizer_groups(self.policy, algorithm_cfg), lr=algorithm_cfg.lr, eps=1e-5)
        self.generator = torch.Generator().manual_seed(seeds.generator(Purpose.MINIBATCH))
        self.device_state = DeviceState(self.policy, self.optimizer)
        self.shared: SharedWeights | None = None
        # algorithm.kl_coef > 0: a frozen copy of the starting weights that the KL penalty holds the policy near
        self.reference: nn.Module | None = None

    # -- weights out ----------------------------------------------------------------------
    def get_weights(self) -> dict:
        return _cpu_state(self.policy)

    def share_weights(self) -> SharedLayout:
        """Create the shared buffer rollout workers on this node read weights from."""
        self.shared = SharedWeights(plan_layout(self.policy.state_dict()))
        return self.shared.layout

    def unlink_shared_weights(self) -> None:
        self.shared.unlink()

    def publish_weights(self) -> None:
        self.shared.write(self.policy.state_dict())

    def open_broadcast_group(self) -> str:
        return broadcast_address()

    def join_broadcast_group(self, address: str, world_size: int) -> None:
        join_broadcast_group(address, rank=0, world_size=world_size, device=self.device)

    def broadcast_weights(self) -> int:
        return broadcast_module(self.policy, src=0)

    def set_lr(self, lr: float) -> None:
        """Set ``algorithm.lr``'s current value; a critic group keeps its ratio to it."""
        for group in self.optimizer.param_groups:
            # optimizer states saved before critic_lr existed carry no lr_scale: one group at lr
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def freeze_reference(self) -> None:
        """Keep the current weights (the warm start), frozen, as the KL penalty's reference policy."""
        if self.cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)

    def update(self, *trajectories: Trajectory, critic_only: bool = False) -> dict[str, float]:
        """One PPO update on the trajectories of every rollout worker (``critic_only``: a critic
        warm-up update, the value function's alone)."""
        batch = _to(Trajectory.concat(list(trajectories)), self.device)
        self.policy.train()
        torch.set_num_threads(self.update_threads)
        with self.all_cores():  # env and rollout workers wait for the new weights: their cores are free
            if critic_only:
                return critic_warmup_update(self.policy, self.optimizer, batch, self.cfg, generator=self.generator)
            return ppo_update(self.policy, self.optimizer, batch, self.cfg, generator=self.generator,
                              reference=self.reference)

    def state(self) -> dict:
        """Everything a checkpoint needs to continue training exactly."""
        state = {"policy": self.get_weights(), "optimizer": self.optimizer.state_dict(),
                 "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state()}
        if self.reference is not None:
            state["reference"] = _cpu_state(self.reference)
        return state

    def load_state(self, state: dict, weights_only: bool = False) -> None:
        self.policy.load_state_dict(state["policy"])
        if weights_only:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if self.cfg.kl_coef > 0:  # a resumed run keeps its original reference (older checkpoints: these weights)
            self.freeze_reference()
            if "reference" in state:
                self.reference.load_state_dict(state["reference"])


def _cpu_state(module: nn.Module) -> dict:
    """``module``'s state dict on the CPU (on a CPU device: the live tensors, not copies)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _to(batch: Trajectory, device) -> Trajectory:
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch) if f.name != "obs"}
    return Trajectory(obs={k: v.to(device) for k, v in batch.obs.items()}, **moved)

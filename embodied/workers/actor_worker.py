"""ActorWorker: holds the trainable policy, the run's algorithm and its optimizer; turns
trajectories into updates."""

from __future__ import annotations

import copy

import torch
from torch import nn

from embodied.algorithms.registry import make_algorithm
from embodied.algorithms.replay import Transitions
from embodied.allocation import GROUP_SETTINGS, allocations_are_config_errors
from envs.messages import Trajectory
from envs.seeds import Purpose, RunSeeds
from policies.registry import make_policy
from scheduler.runtime.data_parallel import SINGLE, DataParallel, join_group, resolve_strategy
from scheduler.runtime.offload import DeviceState
from scheduler.runtime.weight_sync import (
    SharedLayout,
    SharedWeights,
    broadcast_module,
    group_address,
    join_process_group,
    plan_layout,
)
from scheduler.runtime.worker import Worker


class ActorWorker(Worker):
    """Rank ``rank`` of ``world_size`` actor ranks (``placement.actor_workers``). One rank trains
    from construction on; several first meet in a process group (:meth:`group_address` on
    rank 0, then :meth:`join_data_parallel` on all at once) and train data-parallel
    (scheduler/runtime/data_parallel.py)."""

    def __init__(self, policy_cfg, algorithm_cfg, obs_spec: dict, action_dim: int, seed: int,
                 update_threads: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.update_threads = update_threads
        seeds = RunSeeds(seed)
        torch.manual_seed(seeds.generator(Purpose.INIT))  # the same initial weights on every rank
        self.cfg = algorithm_cfg
        self.algorithm = make_algorithm(algorithm_cfg)
        self.policy_cfg, self.obs_spec, self.action_dim = policy_cfg, obs_spec, action_dim
        with self._allocating("building the policy"):
            self.policy = make_policy(policy_cfg, obs_spec, action_dim).to(self.device)
        # every rank draws the same minibatches: they train on the same global ones
        self.generator = torch.Generator().manual_seed(seeds.generator(Purpose.MINIBATCH))
        self.shared: SharedWeights | None = None
        # algorithm.kl_coef > 0: a frozen copy of the starting weights that the KL penalty holds the policy near
        self.reference: nn.Module | None = None
        if self.world_size == 1:
            self._start_training(SINGLE)

    def _start_training(self, dp: DataParallel) -> None:
        """Shard the policy (fsdp), then make the algorithm's optimizer: over the parameters training steps."""
        self.dp = dp
        self.policy = dp.wrap(self.policy)
        self.optimizer = self.algorithm.make_optimizer(self.policy)
        self.device_state = DeviceState(self.policy, self.optimizer)

    def group_address(self) -> str:
        """Rank 0: where a process group it opens meets (the actor ranks', or the weight broadcast's)."""
        return group_address()

    def join_data_parallel(self, address: str, strategy: str, fsdp_from: int) -> str:
        """Join the actor ranks' process group (all ranks at once) and start training with
        ``placement.data_parallel`` = ``strategy`` (``auto``: fsdp from ``fsdp_from`` =
        ``placement.fsdp_from_parameters`` parameters on); returns the strategy it resolved to."""
        parameters = sum(p.numel() for p in self.policy.parameters())
        resolved = resolve_strategy(strategy, parameters, fsdp_from)
        self._start_training(join_group(address, self.rank, self.world_size, self.device, resolved))
        return resolved

    # -- weights out (FSDP gathers the shards: every rank calls; rank 0 answers) -----------------
    def get_weights(self) -> dict | None:
        return self.dp.whole_state(self.policy)

    def share_weights(self) -> SharedLayout | None:
        """Create the shared buffer rollout workers on this node read weights from."""
        weights = self.dp.whole_state(self.policy)
        if weights is None:
            return None
        self.shared = SharedWeights(plan_layout(weights))
        return self.shared.layout

    def unlink_shared_weights(self) -> None:
        if self.shared is not None:
            self.shared.unlink()

    def publish_weights(self) -> None:
        weights = self.dp.full_state(self.policy) if self.dp.sharded else self.policy.state_dict()
        if self.shared is not None:
            self.shared.write(weights)

    def join_broadcast_group(self, address: str, world_size: int) -> None:
        join_process_group(address, rank=0, world_size=world_size, device=self.device)

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
            self.reference = self._frozen_copy()

    def _frozen_copy(self) -> nn.Module:
        """The policy as it is now, frozen (sharded like it: FSDP modules cannot be deep-copied)."""
        if not self.dp.sharded:
            return copy.deepcopy(self.policy).eval().requires_grad_(False)
        weights = self.dp.full_state(self.policy)
        with torch.random.fork_rng():  # building a policy draws initial weights: leave the run's stream alone
            frozen = make_policy(self.policy_cfg, self.obs_spec, self.action_dim).to(self.device)
        frozen.load_state_dict(weights)
        return self.dp.wrap(frozen).eval().requires_grad_(False)

    def load_demos(self, demos: Transitions) -> None:
        """Give the algorithm demonstrations to train on (RLPD), on this worker's device."""
        self.algorithm.load_demos(demos.map(lambda x: x.to(self.device)))

    def update(self, envs: slice, *trajectories: Trajectory, iteration: int = 0) -> dict[str, float]:
        """The algorithm's update of training ``iteration`` on the rollout workers' ``trajectories``
        (``envs``: this rank's envs of their concatenation)."""
        batch = Trajectory.concat(list(trajectories)).envs(envs).to(self.device)
        self.policy.train()
        torch.set_num_threads(self.update_threads)
        with self.all_cores(), self._allocating(f"updating (iteration {iteration})"):  # others wait: cores are free
            return self.algorithm.update(self.policy, self.optimizer, batch, iteration=iteration,
                                         generator=self.generator, reference=self.reference, dp=self.dp)

    def _allocating(self, doing: str):
        """A failed allocation while ``doing`` is the run's configuration (exit 2), not a fault to restart the
        worker for: raised as an AllocationUserError naming the actor's settings."""
        return allocations_are_config_errors(f"Actor rank {self.rank}, {doing} on {self.device},",
                                             GROUP_SETTINGS["actor"])

    def state(self) -> dict | None:
        """Everything a checkpoint needs to continue training exactly, whole (not sharded): a run on
        any number of ranks resumes from it. Every rank calls; rank 0 answers."""
        state = {"policy": self.dp.whole_state(self.policy),
                 "optimizer": self.dp.full_optimizer_state(self.policy, self.optimizer),
                 "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                 "algorithm": self.algorithm.state_dict()}
        if self.reference is not None:
            state["reference"] = self.dp.whole_state(self.reference)
        return state if self.rank == 0 else None

    def load_state(self, state: dict, weights_only: bool = False) -> None:
        self.dp.load_full_state(self.policy, state["policy"])
        if weights_only:
            return
        self.dp.load_full_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        with self._allocating("loading the checkpoint's algorithm state"):  # a saved replay buffer, refilled whole
            self.algorithm.load_state_dict(state.get("algorithm", {}))  # checkpoints before algorithm state: none
        if self.cfg.kl_coef > 0:  # a resumed run keeps its original reference (older checkpoints: these weights)
            self.freeze_reference()
            if "reference" in state:
                self.dp.load_full_state(self.reference, state["reference"])

"""RolloutWorker: runs policy inference for its env workers and assembles trajectories.

It serves the env ranks and micro-batches its :class:`~scheduler.runtime.layout.BatchLayout` names
(``layout.streams(rank, world_size)``). The :class:`~envs.messages.Trajectory` it returns has
the micro-batches joined back in env order.
"""

from __future__ import annotations

import time

import torch

from embodied.algorithms.registry import make_algorithm
from embodied.workers.recorder import TrajectoryRecorder
from envs.messages import StepMessage, Trajectory
from envs.seeds import Purpose, RunSeeds, episode_noise_seed
from policies.base import set_batch_invariant
from policies.registry import make_policy
from scheduler.runtime.channel import Channel, InOrder, action_key, observation_key
from scheduler.runtime.layout import BatchLayout
from scheduler.runtime.offload import DeviceState
from scheduler.runtime.weight_sync import (
    SharedLayout,
    SharedWeights,
    broadcast_module,
    join_process_group,
    use_views_as_parameters,
)
from scheduler.runtime.worker import Worker


class RolloutWorker(Worker):
    def __init__(self, policy_cfg, algorithm_cfg, obs_spec: dict, action_dim: int, layout: BatchLayout, seed: int,
                 **kwargs):
        super().__init__(**kwargs)
        self.algorithm = make_algorithm(algorithm_cfg)
        self.collection = self.algorithm.collection  # what the algorithm's update needs of a step
        self.policy = make_policy(policy_cfg, obs_spec, action_dim).to(self.device).eval()
        # micro-batches must get the actions the whole batch would: same kernels per row ...
        set_batch_invariant(self.policy)
        self.device_state = DeviceState(self.policy)
        self.layout = layout
        self.streams = layout.streams(self.rank, self.world_size)
        self.env_ranks = sorted({r for r, _ in self.streams})
        self.action_shape = (layout.envs_per_worker, self.policy.noise_dim)
        # ... and the same noise: one generator per env rank, one draw per step for its whole slice,
        # seeded anew each iteration (a redone iteration, on a new worker too, samples as the first try)
        self.seeds = RunSeeds(seed)
        self.generators: dict[int, torch.Generator] = {}
        self.shared: SharedWeights | None = None
        self._start_timing()

    # -- weights and context switching ------------------------------------------------
    def set_weights(self, state_dict: dict) -> None:
        self.policy.load_state_dict(state_dict)
        self.policy.weights_updated()

    def attach_shared_weights(self, layout: SharedLayout) -> None:
        self.shared = SharedWeights(layout)

    def use_shared_weights(self) -> int:
        """Sync from the actor's shared buffer; returns bytes copied (0 on CPU: in place)."""
        copied = use_views_as_parameters(self.policy, self.shared.views)
        self.policy.weights_updated()
        return copied

    def join_broadcast_group(self, address: str, world_size: int) -> None:
        join_process_group(address, rank=1 + self.rank, world_size=world_size, device=self.device)

    def receive_broadcast(self) -> int:
        received = broadcast_module(self.policy, src=0)
        self.policy.weights_updated()
        return received

    # -- inference ----------------------------------------------------------------------
    def _obs(self, obs: dict) -> dict:
        return {k: v.to(self.device) for k, v in obs.items()}

    def _noise(self, env_rank: int, stage: int, step_noise: dict) -> torch.Tensor:
        if stage == 0:
            step_noise[env_rank] = torch.randn(self.action_shape, generator=self.generators[env_rank])
        return step_noise[env_rank][self.layout.stage_slice(stage)]

    def _act(self, obs: dict, deterministic: bool, noise: torch.Tensor):
        obs = self._obs(obs)
        actions, logprob, value = self.policy.act(obs, deterministic=deterministic, noise=noise)
        # what the simulator gets (a Gaussian's sample clipped to the box, a VLA's tokens decoded);
        # the policy's own ``actions`` are what was scored
        return actions, logprob, value, self.policy.to_env(actions, obs).cpu()

    def _uniform(self, obs: dict, deterministic: bool, noise: torch.Tensor):
        """Uniform actions in the [-1, 1] box from the step's standard-normal noise (``policy=random``'s
        map), log-prob and value 0."""
        actions = 2 * torch.special.ndtr(noise[:, :self.policy.action_dim]) - 1
        zeros = torch.zeros(len(actions))
        return actions, zeros, zeros, actions.clone()

    def _get(self, incoming: InOrder) -> StepMessage:
        """Wait for the next micro-batch; the time until the next ``_get`` counts as busy (``infer``)."""
        t0 = time.perf_counter()
        self._end_busy()
        with self.waiting():
            msg = incoming.next()
        self.times["wait_s"] += time.perf_counter() - t0
        self._busy_since = time.time()
        return msg

    def _end_busy(self) -> None:
        if self._busy_since is not None:
            self.trace.append(("infer", self._busy_since, time.time()))
            self._busy_since = None

    def _observations(self, channel: Channel, num_steps: int) -> InOrder:
        """The ``num_steps + 1`` observation messages of every served micro-batch, in serving order."""
        return InOrder(channel, [observation_key(r, s) for _ in range(num_steps + 1) for r, s in self.streams])

    def _start_timing(self) -> None:
        self.trace = []
        self.times = {"infer_s": 0.0, "wait_s": 0.0}
        self._busy_since: float | None = None
        self._started = time.perf_counter()

    def _stop_timing(self) -> None:
        self._end_busy()
        self.times["infer_s"] = time.perf_counter() - self._started - self.times["wait_s"]

    def last_trace(self) -> list[tuple[str, float, float]]:
        return self.trace

    def last_times(self) -> dict[str, float]:
        return self.times

    @torch.no_grad()
    def collect(self, num_steps: int, channel: Channel, iteration: int) -> Trajectory:
        """Drive ``num_steps`` env steps on each served micro-batch with training iteration
        ``iteration``'s noise; returns the trajectory."""
        self._start_timing()
        self.generators = {r: torch.Generator().manual_seed(self.seeds.generator(Purpose.ROLLOUT_NOISE, r, iteration))
                           for r in self.env_ranks}
        trajectories: dict[tuple[int, int], Trajectory] = {}
        recorders = {stream: TrajectoryRecorder(self.collection, self._value) for stream in self.streams}
        incoming = self._observations(channel, num_steps)
        # e.g. SAC before its updates start: uniform actions fill the replay buffer
        warm_up = self.algorithm.uniform_actions(self.layout.env_steps(iteration * num_steps))
        act = self._uniform if warm_up else self._act
        for t in range(num_steps + 1):
            step_noise: dict[int, torch.Tensor] = {}
            for env_rank, stage in self.streams:
                msg = self._get(incoming)
                recorder = recorders[env_rank, stage]
                if t > 0:
                    recorder.outcome(msg)
                if t == num_steps:
                    trajectories[env_rank, stage] = recorder.finish(msg.obs)
                    continue
                noise = self._noise(env_rank, stage, step_noise)
                actions, logprob, value, env_actions = act(msg.obs, False, noise)
                channel.put(env_actions, key=action_key(env_rank, stage))
                recorder.decision(msg.obs, actions.cpu(), logprob.cpu(), value.cpu())
        self._stop_timing()
        return Trajectory.concat([trajectories[stream] for stream in self.streams])

    def _value(self, obs: dict) -> torch.Tensor:
        return self.policy.value(self._obs(obs)).cpu()

    @torch.no_grad()
    def serve_eval(self, num_steps: int, channel: Channel, deterministic: bool,
                   episode_seeds: dict[int, list[int]]) -> None:
        """Answer ``num_steps`` steps of evaluation episodes (no trajectory kept).
        ``episode_seeds``: env rank -> the seed of each of its envs' episodes; a sampled action
        uses noise of its episode's own stream, so it does not depend on the batch or on training."""
        self._start_timing()
        incoming = self._observations(channel, num_steps)
        noise_of = {(r, s): [torch.Generator().manual_seed(episode_noise_seed(seed))
                             for seed in episode_seeds[r][self.layout.stage_slice(s)]]
                    for r, s in self.streams}
        for t in range(num_steps + 1):
            for env_rank, stage in self.streams:
                msg = self._get(incoming)
                if t < num_steps:
                    noise = torch.stack([torch.randn(self.action_shape[1:], generator=g)
                                         for g in noise_of[env_rank, stage]])
                    channel.put(self._act(msg.obs, deterministic, noise)[3], key=action_key(env_rank, stage))
        self._stop_timing()

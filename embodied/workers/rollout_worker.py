"""RolloutWorker: runs policy inference for its env workers and assembles trajectories.

It serves env ranks ``r`` with ``r % world_size == rank``. The trajectory it
returns is time-major: ``obs[k]: [T, B, ...]``, ``actions: [T, B, A]``,
``logprobs / values / rewards / dones: [T, B]`` and ``next_value: [B]``.
"""

from __future__ import annotations

import torch

from embodied.registry import Registry
from policies.registry import make_policy
from scheduler.channel import Channel
from scheduler.worker import Worker

# which finished episodes get their final observation's value added to the last reward
BOOTSTRAP_MASKS = Registry("bootstrap rule (algorithm.bootstrap)")
BOOTSTRAP_MASKS.update({
    "all_ends": lambda terminated, truncated: terminated | truncated,
    "time_limit": lambda terminated, truncated: truncated & ~terminated,
    "none": lambda terminated, truncated: torch.zeros_like(terminated),
})


class RolloutWorker(Worker):
    def __init__(self, policy_cfg, algorithm_cfg, obs_spec: dict, action_dim: int,
                 num_env_workers: int, seed: int, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(seed + 7919 * (self.rank + 1))  # action sampling: seeded runs repeat exactly
        self.cfg = algorithm_cfg
        self.policy = make_policy(policy_cfg, obs_spec, action_dim).to(self.device).eval()
        self.env_ranks = [r for r in range(num_env_workers) if r % self.world_size == self.rank]

    def set_weights(self, state_dict: dict) -> None:
        self.policy.load_state_dict(state_dict)

    def _obs(self, obs: dict) -> dict:
        return {k: v.to(self.device) for k, v in obs.items()}

    def _act(self, obs: dict, deterministic: bool):
        actions, logprob, value = self.policy.act(self._obs(obs), deterministic=deterministic)
        # the simulator's action box is [-1, 1]; the unclipped sample is what was scored
        return actions, logprob, value, actions.clamp(-1.0, 1.0).cpu()

    @torch.no_grad()
    def collect(self, num_steps: int, channel: Channel) -> dict:
        """Drive ``num_steps`` env steps on each served env rank; returns the trajectory."""
        per_rank = [_empty_buffer() for _ in self.env_ranks]
        for t in range(num_steps + 1):
            for slot, env_rank in enumerate(self.env_ranks):
                msg = channel.get(key=("obs", env_rank))
                buf = per_rank[slot]
                if t > 0:
                    buf["rewards"].append(self._bootstrapped_reward(msg))
                    buf["dones"].append(msg["terminated"] | msg["truncated"])
                if t == num_steps:
                    buf["next_value"] = self.policy.value(self._obs(msg["obs"])).cpu()
                    continue
                actions, logprob, value, env_actions = self._act(msg["obs"], deterministic=False)
                channel.put(env_actions, key=("act", env_rank))
                for k, v in msg["obs"].items():
                    buf["obs"].setdefault(k, []).append(v)
                buf["actions"].append(actions.cpu())
                buf["logprobs"].append(logprob.cpu())
                buf["values"].append(value.cpu())
        return merge_trajectories([_stack(buf) for buf in per_rank])

    def _bootstrapped_reward(self, msg: dict) -> torch.Tensor:
        """Where an episode ended only because the env was reset (a time limit, or with
        ``bootstrap=all_ends`` also a success), add ``gamma * V(final_obs)`` so the cut
        does not read as a zero-value terminal state."""
        reward = msg["reward"].clone()
        cut = BOOTSTRAP_MASKS.get(self.cfg.bootstrap)(msg["terminated"], msg["truncated"])
        if bool(cut.any()):
            final_value = self.policy.value(self._obs(msg["final_obs"])).cpu()
            reward[cut] += self.cfg.gamma * final_value[cut]
        return reward

    @torch.no_grad()
    def serve_eval(self, num_steps: int, channel: Channel, deterministic: bool) -> None:
        """Answer ``num_steps`` steps of evaluation episodes (no trajectory kept)."""
        for t in range(num_steps + 1):
            for env_rank in self.env_ranks:
                msg = channel.get(key=("obs", env_rank))
                if t < num_steps:
                    channel.put(self._act(msg["obs"], deterministic)[3], key=("act", env_rank))


def _empty_buffer() -> dict:
    return {"obs": {}, "actions": [], "logprobs": [], "values": [], "rewards": [], "dones": []}


def _stack(buf: dict) -> dict:
    out = {k: torch.stack(buf[k]) for k in ("actions", "logprobs", "values", "rewards", "dones")}
    out["obs"] = {k: torch.stack(v) for k, v in buf["obs"].items()}
    out["next_value"] = buf["next_value"]
    return out


def merge_trajectories(parts: list[dict]) -> dict:
    """Concatenate time-major trajectories along the batch axis (dim 1; dim 0 for next_value)."""
    if len(parts) == 1:
        return parts[0]
    out = {k: torch.cat([p[k] for p in parts], dim=1)
           for k in ("actions", "logprobs", "values", "rewards", "dones")}
    out["obs"] = {k: torch.cat([p["obs"][k] for p in parts], dim=1) for k in parts[0]["obs"]}
    out["next_value"] = torch.cat([p["next_value"] for p in parts], dim=0)
    return out

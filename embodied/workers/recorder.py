"""TrajectoryRecorder: what a rollout worker keeps of one micro-batch's steps, as the run's
algorithm asks (:class:`~embodied.algorithms.base.Collection`), stacked into a
:class:`~envs.messages.Trajectory` at the end of the rollout.

A rollout of ``T`` decisions sees ``T + 1`` messages per micro-batch: the first brings only an
observation, each later one the outcome of the decision before (reward, ends, final
observations) and the next observation. Per message the worker calls :meth:`outcome` (all but
the first), then :meth:`decision` (all but the last), and :meth:`finish` once with the last.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embodied.algorithms.base import BOOTSTRAP_MASKS, Collection
from envs.base import Obs
from envs.messages import StepMessage, Trajectory


class TrajectoryRecorder:
    """``value_of(obs [B, ...] per key) -> [B]``: the policy's value (bootstrapping, ``next_value``)."""

    def __init__(self, collection: Collection, value_of: Callable[[Obs], torch.Tensor]):
        self.collection = collection
        self.value_of = value_of
        self.cut = BOOTSTRAP_MASKS.get(collection.bootstrap)
        self.obs: dict[str, list[torch.Tensor]] = {}
        self.next_obs: dict[str, list[torch.Tensor]] = {}
        self.steps: dict[str, list[torch.Tensor]] = {"actions": [], "logprobs": [], "values": [], "rewards": [],
                                                     "dones": [], "terminated": []}

    def outcome(self, msg: StepMessage) -> None:
        """The previous decision's result: its reward (bootstrapped where the collection says) and
        ends; with ``next_obs``, the observation it led to and whether the episode terminated."""
        self.steps["rewards"].append(self._reward(msg))
        self.steps["dones"].append(msg.done)
        if self.collection.next_obs:
            self.steps["terminated"].append(msg.terminated)
            for k, v in _led_to(msg).items():
                self.next_obs.setdefault(k, []).append(v)

    def decision(self, obs: Obs, actions: torch.Tensor, logprob: torch.Tensor, value: torch.Tensor) -> None:
        """What the policy did on ``obs`` (all ``[B, ...]``, on the CPU)."""
        for k, v in obs.items():
            self.obs.setdefault(k, []).append(v)
        self.steps["actions"].append(actions)
        self.steps["logprobs"].append(logprob)
        self.steps["values"].append(value)

    def finish(self, last_obs: Obs) -> Trajectory:
        """The trajectory, ``next_value`` the value of ``last_obs`` (the observation after the last step)."""
        stacked = {k: torch.stack(v) if v else None for k, v in self.steps.items()}
        return Trajectory(obs=_stack(self.obs), next_obs=_stack(self.next_obs) if self.collection.next_obs else None,
                          next_value=self.value_of(last_obs), **stacked)

    def _reward(self, msg: StepMessage) -> torch.Tensor:
        """Where an episode ended only because the env was reset (a time limit, or with
        ``bootstrap=all_ends`` also a success), add ``gamma * V(final_obs)`` so the cut does not
        read as a zero-value terminal state."""
        reward = msg.reward.clone()
        cut = self.cut(msg.terminated, msg.truncated)
        if bool(cut.any()):
            reward[cut] += self.collection.gamma * self.value_of(msg.final_obs)[cut]
        return reward


def _led_to(msg: StepMessage) -> Obs:
    """The observation each env's step led to: ``msg.obs``, except where the episode ended (the
    env has reset since): there its final observation."""
    if msg.final_obs is None:
        return msg.obs
    done = msg.done
    return {k: torch.where(done.view(-1, *[1] * (v.dim() - 1)), msg.final_obs[k], v) for k, v in msg.obs.items()}


def _stack(obs: dict[str, list[torch.Tensor]]) -> Obs:
    return {k: torch.stack(v) for k, v in obs.items()}

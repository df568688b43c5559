"""GRPO (``algorithm=grpo``): PPO's clipped update on group-relative outcome advantages, no critic.

Every iteration resets the envs, ``algorithm.group_size`` envs per initial state; each env's
first episode is scored by its return against its group's (``grpo_advantages`` in
advantages.py). What differs from PPO is what an iteration holds and the rules that follow from
it (groups inside one micro-batch and one actor rank, episodes that end within an iteration);
the update itself is :func:`~embodied.algorithms.ppo.ppo_update`.
"""

from __future__ import annotations

from embodied.algorithms.advantages import GRPO_WEIGHTINGS
from embodied.algorithms.base import ALGORITHMS
from embodied.algorithms.ppo import PPO
from envs.chunking import episode_decisions
from envs.common import UserError
from envs.registry import env_episode_steps
from scheduler.runtime.layout import BatchLayout


@ALGORITHMS.register("grpo")
class GRPO(PPO):
    episodic = True
    has_critic = False  # returns = values: nothing trains or uses a value function
    nothing_trained = ("every sample was filtered out (algorithm.filter_uniform_groups drops groups whose "
                       "episodes all scored the same; all successes or all failures give no signal). Larger "
                       "groups, more envs or a denser reward give mixed groups.")

    @property
    def group_size(self) -> int:
        return self.cfg.group_size

    def check(self, run_cfg, rollout_only: bool = False) -> None:
        super().check(run_cfg, rollout_only)
        GRPO_WEIGHTINGS.get(run_cfg.algorithm.grpo_weighting)
        if run_cfg.placement.mode != "auto":  # auto: the planner keeps groups whole
            _check_groups(run_cfg)
        if not rollout_only:
            _check_episode_fits(run_cfg)


def _check_groups(cfg) -> None:
    """GRPO compares the envs of a group: at least two, all in one micro-batch and one actor rank."""
    algo, placement = cfg.algorithm, cfg.placement
    micro_batch = BatchLayout(cfg.env.num_envs, placement.env_workers, placement.pipeline_stages).stage_size
    if algo.group_size >= 2 and micro_batch < algo.group_size:  # too few envs for one group: add envs
        envs = algo.group_size * placement.env_workers * placement.pipeline_stages
        raise UserError(f"algorithm.group_size={algo.group_size}: GRPO compares the {algo.group_size} envs of a group, "
                        f"all in one micro-batch, but env.num_envs={cfg.env.num_envs} over placement.env_workers="
                        f"{placement.env_workers} x placement.pipeline_stages={placement.pipeline_stages} gives "
                        f"{micro_batch} env(s) per micro-batch. Set env.num_envs={envs} (or a multiple), or a "
                        f"smaller algorithm.group_size (>= 2).")
    if algo.group_size < 2 or micro_batch % algo.group_size:
        raise UserError(f"algorithm.group_size={algo.group_size}: GRPO compares the envs of a group, so it "
                        f"needs at least 2 per group, and groups must not span env workers or pipeline "
                        f"stages ({micro_batch} envs each here). Pick a group size >= 2 that divides {micro_batch}.")
    actor_share = cfg.env.num_envs // placement.actor_workers
    if actor_share % algo.group_size:
        raise UserError(f"algorithm.group_size={algo.group_size} does not divide the {actor_share} envs each of "
                        f"placement.actor_workers={placement.actor_workers} actor ranks trains on: a GRPO group "
                        "must not span actor ranks. Pick a group size that divides it, or change the rank count.")


def _check_episode_fits(cfg) -> None:
    """GRPO scores whole episodes: each must end within one iteration (counted in decisions, as a
    chunking policy's env counts them)."""
    steps = env_episode_steps(cfg.env)
    if steps is None or cfg.algorithm.rollout_steps is None:
        return
    decisions = episode_decisions(steps, cfg.policy.chunk_size)
    if cfg.algorithm.rollout_steps < decisions:
        raise UserError(f"algorithm.rollout_steps={cfg.algorithm.rollout_steps} is shorter than an episode "
                        f"({decisions} steps): GRPO needs every episode to end within an iteration. "
                        "Set algorithm.rollout_steps=null (one whole episode) or raise it.")

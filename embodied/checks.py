"""The checks of a run's config beyond its keys and types (``embodied/config.py`` checks those
when it composes): names in the registries, the env and policy (a checkpoint's files, its action
size), placement, and the rules that tie sections together. One pass, before any worker starts:
:func:`check_run_config`, which ``start_workers`` calls."""

from __future__ import annotations

from embodied.algorithms.advantages import ADVANTAGES, GRPO_WEIGHTINGS, OUTCOME_ADVANTAGES
from embodied.algorithms.logprob_levels import LOGPROB_LEVELS
from embodied.algorithms.losses import LOSSES
from embodied.config import TrainConfig
from embodied.workers.rollout_worker import BOOTSTRAP_MASKS
from envs.chunking import episode_decisions
from envs.common import UserError, unknown_name_error
from envs.registry import check_env_config, env_action_dim, env_episode_steps, env_obs_keys, seed_scheme
from policies.registry import check_policy_config, check_policy_observations
from scheduler.data_parallel import resolve_strategy
from scheduler.layout import BatchLayout
from scheduler.placement import check_placement


def check_run_config(cfg: TrainConfig) -> list[str]:
    """Raise a UserError for the first thing wrong with ``cfg`` (its message names the fix). Returns
    the lines the run log shows about choices a checkpoint left to the config."""
    check_env_config(cfg.env)
    seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)  # eval.tasks is checked now, not after training
    _check_camera_is_the_trained_one(cfg)  # before the checkpoint is read: a config-only mistake
    notes = check_policy_config(cfg.policy, env_action_dim(cfg.env))
    _check_policy_sees_what_it_needs(cfg)
    for registry, name in ((ADVANTAGES, cfg.algorithm.advantage), (LOSSES, cfg.algorithm.loss),
                           (BOOTSTRAP_MASKS, cfg.algorithm.bootstrap),
                           (LOGPROB_LEVELS, cfg.algorithm.logprob_level),
                           (GRPO_WEIGHTINGS, cfg.algorithm.grpo_weighting)):
        registry.get(name)
    check_placement(cfg.placement, cfg.env.num_envs)
    resolve_strategy(cfg.placement.data_parallel, parameters=0)
    _check_groups(cfg)
    _check_final_weights(cfg)
    _check_critic(cfg)
    _check_episode_fits(cfg)
    return notes


def _check_policy_sees_what_it_needs(cfg: TrainConfig) -> None:
    """The policy against the observation keys the env will have (its cameras, a proprio state of the
    checkpoint's size), where the backend knows them without building an env; ``Workers`` checks the
    full spec again once the env workers report it."""
    keys = env_obs_keys(cfg.env)
    if keys is not None:
        check_policy_observations(cfg.policy, {k: (shape, None) for k, shape in keys.items()}, env_action_dim(cfg.env))


def _check_camera_is_the_trained_one(cfg: TrainConfig) -> None:
    """A checkpoint sees the images it was trained on: its config's ``policy.camera_size`` and
    ``policy.camera_rendering`` against the env's (the public-checkpoint configs set the env to match;
    this refuses an override that would feed it other pixels without a word)."""
    policy, env = cfg.policy, cfg.env
    if env.obs_mode != "rgb":
        return
    opt_out = "or, to run this checkpoint on other images knowingly, policy.{key}=null"
    if policy.camera_size is not None and env.image_size != policy.camera_size:
        raise UserError(f"env.image_size={env.image_size}, but this checkpoint was trained on {policy.camera_size} px "
                        f"camera images (policy.camera_size={policy.camera_size}, its authors' render size): its "
                        f"processor would resize other frames, and it would see pixels it never saw. Set "
                        f"env.image_size={policy.camera_size}, {opt_out.format(key='camera_size')}.")
    if policy.camera_rendering is not None and env.rendering != policy.camera_rendering:
        raise UserError(f"env.rendering={env.rendering}, but this checkpoint was trained on images rendered with "
                        f"'{policy.camera_rendering}' (policy.camera_rendering; reference = robosuite's defaults, as "
                        f"its authors render). Set env.rendering={policy.camera_rendering}, "
                        f"{opt_out.format(key='camera_rendering')}.")


def _check_groups(cfg: TrainConfig) -> None:
    """GRPO compares the envs of a group: at least two, all in one micro-batch."""
    algo = cfg.algorithm
    if algo.advantage not in OUTCOME_ADVANTAGES or cfg.placement.mode == "auto":  # auto: the planner checks
        return
    placement = cfg.placement
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
    actor_share = cfg.env.num_envs // cfg.placement.actor_workers
    if actor_share % algo.group_size:
        raise UserError(f"algorithm.group_size={algo.group_size} does not divide the {actor_share} envs each of "
                        f"placement.actor_workers={cfg.placement.actor_workers} actor ranks trains on: a GRPO group "
                        "must not span actor ranks. Pick a group size that divides it, or change the rank count.")


def _check_final_weights(cfg: TrainConfig) -> None:
    """``runner.final_weights=best`` picks among periodic validations: there must be some."""
    choice = cfg.runner.final_weights
    if choice not in ("last", "best"):
        raise unknown_name_error("final weights (runner.final_weights)", choice, ["last", "best"])
    if choice == "best" and not cfg.runner.eval_every:
        raise UserError("runner.final_weights=best keeps the weights of the best periodic validation, but "
                        "runner.eval_every=0 runs none. Set runner.eval_every=N (validate every N iterations) "
                        "or runner.final_weights=last.")


def _check_critic(cfg: TrainConfig) -> None:
    """Critic warm-up trains a value function: GRPO (and vf_coef 0) has none. (Its count, critic_lr
    and kl_coef are range-checked with every numeric key: embodied/config.py.)"""
    algo = cfg.algorithm
    if algo.critic_warmup_iterations and (algo.vf_coef == 0 or algo.advantage in OUTCOME_ADVANTAGES):
        raise UserError(f"algorithm.critic_warmup_iterations={algo.critic_warmup_iterations} trains only the "
                        f"value function, but algorithm={algo.name} (advantage {algo.advantage}, vf_coef "
                        f"{algo.vf_coef}) uses none: those updates would change nothing. Set "
                        "algorithm.critic_warmup_iterations=0, or use PPO (algorithm=ppo).")


def _check_episode_fits(cfg: TrainConfig) -> None:
    """GRPO scores whole episodes: each must end within one iteration (counted in decisions, as a
    chunking policy's env counts them)."""
    steps = env_episode_steps(cfg.env)
    if cfg.algorithm.advantage not in OUTCOME_ADVANTAGES or steps is None or cfg.algorithm.rollout_steps is None:
        return
    decisions = episode_decisions(steps, cfg.policy.chunk_size)
    if cfg.algorithm.rollout_steps < decisions:
        raise UserError(f"algorithm.rollout_steps={cfg.algorithm.rollout_steps} is shorter than an episode "
                        f"({decisions} steps): GRPO needs every episode to end within an iteration. "
                        "Set algorithm.rollout_steps=null (one whole episode) or raise it.")

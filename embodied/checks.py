"""The checks of a run's config beyond its keys and types (``embodied/config.py`` checks those
when it composes): names in the registries, the env and policy (a checkpoint's files, its action
size), placement, and the rules that tie sections together. One pass, before any worker starts:
:func:`check_run_config`, which ``start_workers`` calls."""

from __future__ import annotations

from embodied.algorithms.base import BOOTSTRAP_MASKS
from embodied.algorithms.registry import make_algorithm
from embodied.config import TrainConfig
from envs.common import UserError, unknown_name_error
from envs.registry import check_env_config, env_action_dim, env_obs_keys, env_render_problem, seed_scheme
from policies.registry import check_policy_config, check_policy_observations
from scheduler.placement import check_placement
from scheduler.runtime.data_parallel import resolve_strategy


def check_run_config(cfg: TrainConfig, rollout_only: bool = False) -> list[str]:
    """Raise a UserError for the first thing wrong with ``cfg`` (its message names the fix). Returns
    the lines the run log shows about choices a checkpoint left to the config. ``rollout_only``:
    the workers will only roll out (auto placement's probes): the algorithm's update rules wait."""
    check_env_config(cfg.env)
    seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)  # eval.tasks is checked now, not after training
    _check_camera_is_the_trained_one(cfg)  # before the checkpoint is read: a config-only mistake
    notes = check_policy_config(cfg.policy, env_action_dim(cfg.env))
    _check_policy_sees_what_it_needs(cfg)
    BOOTSTRAP_MASKS.get(cfg.algorithm.bootstrap)
    check_placement(cfg.placement, cfg.env.num_envs)
    resolve_strategy(cfg.placement.data_parallel, parameters=0)
    make_algorithm(cfg.algorithm).check(cfg, rollout_only)  # its names, and the rules it puts on the run
    _check_collection(cfg)
    _check_final_weights(cfg)
    if not rollout_only:
        _check_videos_can_be_recorded(cfg)
    return notes


def _check_videos_can_be_recorded(cfg: TrainConfig) -> None:
    """An env that cannot render is refused now when the run would record videos, not at its end."""
    if not (cfg.eval.video_episodes or cfg.eval.videos_per_task):
        return
    problem = env_render_problem(cfg.env)
    if problem:
        raise UserError(f"{problem} This run would record videos (eval.video_episodes={cfg.eval.video_episodes}: "
                        f"train's and record's; eval.videos_per_task={cfg.eval.videos_per_task}: eval's): set both "
                        "to 0, or make the env render (for gymnasium's classic-control envs: pip install "
                        "'gymnasium[classic_control]').")


def _check_policy_sees_what_it_needs(cfg: TrainConfig) -> None:
    """The policy against the observation keys the env will have (its cameras, a proprio state of the
    checkpoint's size), where the backend knows them without building an env; ``Workers`` checks the
    full spec again once the env workers report it."""
    keys = env_obs_keys(cfg.env)
    if keys is not None:
        check_policy_observations(cfg.policy, {k: (shape, None) for k, shape in keys.items()}, env_action_dim(cfg.env))


def _check_camera_is_the_trained_one(cfg: TrainConfig) -> None:
    """A checkpoint sees the images it was trained on: its config's ``policy.vla.camera_size`` and
    ``policy.vla.camera_rendering`` against the env's (the public-checkpoint configs set the env to match;
    this refuses an override that would feed it other pixels without a word)."""
    policy, env = cfg.policy, cfg.env
    if env.obs_mode != "rgb":
        return
    opt_out = "or, to run this checkpoint on other images knowingly, policy.vla.{key}=null"
    trained = policy.vla
    if trained.camera_size is not None and env.image_size != trained.camera_size:
        raise UserError(f"env.image_size={env.image_size}, but this checkpoint was trained on {trained.camera_size} px "
                        f"camera images (policy.vla.camera_size={trained.camera_size}, its authors' render size): its "
                        f"processor would resize other frames, and it would see pixels it never saw. Set "
                        f"env.image_size={trained.camera_size}, {opt_out.format(key='camera_size')}.")
    if trained.camera_rendering is not None and env.rendering != trained.camera_rendering:
        raise UserError(f"env.rendering={env.rendering}, but this checkpoint was trained on images rendered with "
                        f"'{trained.camera_rendering}' (policy.vla.camera_rendering; reference = robosuite's defaults, "
                        f"as its authors render). Set env.rendering={trained.camera_rendering}, "
                        f"{opt_out.format(key='camera_rendering')}.")


def _check_final_weights(cfg: TrainConfig) -> None:
    """``runner.final_weights=best`` picks among periodic validations: there must be some."""
    choice = cfg.runner.final_weights
    if choice not in ("last", "best"):
        raise unknown_name_error("final weights (runner.final_weights)", choice, ["last", "best"])
    if choice == "best" and not cfg.runner.eval_every:
        raise UserError("runner.final_weights=best keeps the weights of the best periodic validation, but "
                        "runner.eval_every=0 runs none. Set runner.eval_every=N (validate every N iterations) "
                        "or runner.final_weights=last.")


COLLECTIONS = ("sync", "async")  # runner.collection (embodied/collection.py)


def _check_collection(cfg: TrainConfig) -> None:
    """Asynchronous collection trains on data of older weights: off-policy algorithms only."""
    runner = cfg.runner
    if runner.collection not in COLLECTIONS:
        raise unknown_name_error("runner.collection", runner.collection, list(COLLECTIONS))
    algorithm = make_algorithm(cfg.algorithm)
    if runner.collection == "async" and not algorithm.off_policy:
        raise UserError(f"runner.collection=async lets the envs collect with older weights while the actor "
                        f"updates, but algorithm={cfg.algorithm.name} learns only from the weights that collected "
                        "its data. Use an off-policy algorithm (algorithm=sac), or runner.collection=sync.")
    if runner.weight_sync_every > 1 and runner.collection != "async":
        raise UserError(f"runner.weight_sync_every={runner.weight_sync_every} spaces the weight syncs of "
                        "asynchronous collection; with runner.collection=sync every rollout uses the latest "
                        "weights. Set runner.collection=async (off-policy algorithms), or drop the key.")
    if runner.collection == "async" and cfg.placement.offload == "always":
        raise UserError("runner.collection=async runs the rollout and the update at once, so neither can give "
                        "its devices to the other: placement.offload=always cannot be kept. Set "
                        "placement.offload=never (or auto).")

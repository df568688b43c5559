"""The configuration schema: every key a run reads, with its meaning and default.

The defaults here are the default run's (``embodied train``: PPO on ManiSkill3 PushCube-v1 from
state), and this is the one place they are written. Hydra composes ``configs/train.yaml`` and
its groups, whose files hold only how an option differs from these defaults
(``tests/test_config.py`` checks it); the result is merged into these dataclasses, so a
misspelled key is an error naming the key and the nearest valid one, never a silently ignored
setting.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from embodied.algorithm_config import AlgorithmConfig
from embodied.config_ranges import check_ranges, ranged
from embodied.policy_config import PolicyConfig, moved_policy_key, upgrade_saved_policy
from envs.common import UserError, unknown_name_error

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class EnvConfig:
    backend: str = "maniskill"  # env backend registered in envs/registry.py
    task: str = "PushCube-v1"  # simulator task id
    obs_mode: str = "state"  # "state" or "rgb" (camera image + proprioception)
    control_mode: str = "pd_joint_delta_pos"
    reward_mode: str = "normalized_dense"
    max_episode_steps: int | None = ranged(None, 1)  # None: the task's own limit
    num_envs: int = ranged(128, 1)  # parallel envs in total (split over placement.env_workers)
    num_procs: int = ranged(0, 0)  # sim processes per env worker; 0 = step in the worker itself
    sim_backend: str = "auto"  # "physx_cpu" | "physx_cuda" | "auto" (cuda if available)
    image_size: int = ranged(128, 8)  # camera resolution for obs_mode=rgb
    render_size: int = ranged(256, 8)  # resolution of recorded videos
    # LIBERO: "fast" (no reflections, no multisampling: ~2x the env-steps/s on a CPU renderer) or
    # "reference" (robosuite's defaults, as the public checkpoints' authors render: their pixels);
    # speeds in docs/libero_protocol.md. MetaWorld: "fast" (no shadows either) or "reference" (MetaWorld's own).
    # ManiSkill renders one way: "fast"
    rendering: str = "fast"
    # LIBERO: how episodes start and end, as a reference evaluation does (docs/libero_protocol.md, "Protocols"):
    # "default" (soft resets, seeds task*1000+init, OpenVLA's / openpi's step limits), "lerobot" (lerobot-eval:
    # hard resets, seeds 1000+k, libero_spatial 280 steps) or "openpi" (examples/libero/main.py: hard resets).
    # MetaWorld (docs/metaworld_protocol.md): "default" (lerobot-eval's 500 steps) or "rlinf" (100 steps after 15
    # zero-action steps)
    protocol: str = "default"
    # MetaWorld: the Python interpreter of its env processes (None: .venv-metaworld, which `make setup` builds;
    # metaworld pins mujoco 3.3.0, LIBERO needs 2.3.7, so they never share one: docs/design/metaworld.md)
    python: str | None = None
    timeout_s: float = ranged(120.0, 0, above=True)  # an env process silent this long is reported as hung
    # ... except while it builds its envs (at start, and a replacement's), which may take max(this, timeout_s)
    startup_timeout_s: float = ranged(300.0, 0, above=True)
    # replace an env process that dies or hangs: its episodes end as failed (error) and the run
    # goes on; False: the run stops with a checkpoint and a message (exit code 3)
    restart_crashed: bool = False
    # success ends a training episode (ManiSkill's default), or not: each runs the whole horizon, as
    # evaluations do. None: true for PPO, false for GRPO, which scores an episode by its return, so a
    # quick success must not score a shorter, smaller dense return than a failure that lasts
    success_ends_episode: bool | None = None


@dataclass
class PlacementConfig:
    """Which devices each worker group uses, and how groups share them (scheduler/placement.py)."""

    # "colocated" | "disaggregated" | "hybrid" (see scheduler/placement.py), or "auto": profile the
    # stages, plan with the cost model and run the fastest plan (scheduler/auto.py)
    mode: str = "colocated"
    profile_dir: str = "runs/profiles"  # mode auto: where measured profiles are cached
    env_workers: int = ranged(2, 1)  # Ray actors that step simulators
    rollout_workers: int = ranged(1, 1)  # Ray actors that run policy inference
    # Ray actors that train, data-parallel (one device each, scheduler/runtime/data_parallel.py)
    actor_workers: int = ranged(1, 1)
    # how several actor ranks keep one policy: "replicate" (a whole copy each, gradients all-reduced),
    # "fsdp" (FSDP2: weights, gradients and Adam state sharded) or "auto" (fsdp from fsdp_from_parameters on)
    data_parallel: str = "auto"
    # data_parallel=auto: shard policies of this many parameters or more (fp32 training state: ~16 bytes a
    # parameter, 1.6 GB a replica at 100M), replicate smaller ones
    fsdp_from_parameters: int = ranged(100_000_000, 0)
    env: str = "0-1"  # device range for env workers: GPU ids, or CPU slots without GPUs
    rollout: str = "0"
    actor: str = "0"
    # micro-batches per env worker: the simulator steps one while the policy infers on another
    # (needs env and rollout on different devices: mode hybrid or disaggregated)
    pipeline_stages: int = ranged(1, 1)
    # move the actor's weights and optimizer state off a device it shares while the others run:
    # "auto" (on GPUs only: CPU slots share one host memory), "always" or "never"
    offload: str = "auto"
    # actor -> rollout weights: "auto" (shared_memory when on one node, else object_store),
    # "shared_memory" (in place through /dev/shm), "object_store" (Ray, across nodes) or
    # "broadcast" (one torch.distributed collective: NCCL between GPUs, gloo on CPU)
    weight_sync: str = "auto"
    # pin each worker to the core of its CPU slot (CPU clusters): a group then really has only
    # its devices, as on GPUs. Off by default: unpinned workers borrow idle cores
    pin_cpus: bool = False
    torch_threads: int = ranged(1, 1)  # intra-op threads per worker (2 cores: keep 1)
    # intra-op threads of the actor while it updates (the sims are idle then; CPU actor ranks on one node split them;
    # runner.collection=async: torch_threads instead, as the sims step meanwhile)
    actor_threads: int = ranged(2, 1)


@dataclass
class RayConfig:
    address: str | None = None  # None: start a local cluster; else join this one
    num_cpus: int | None = ranged(None, 1)  # CPU slots of the local cluster (default: all cores)
    num_gpus: int | None = ranged(None, 0)


@dataclass
class EvalConfig:
    # how many episodes; null: the protocol's (ManiSkill: 100, seeds seed, seed + 1, ...; a suite, LIBERO or
    # MetaWorld: trials_per_task of each task). On a suite, a number takes that many of the protocol's episodes
    # trial by trial across its tasks (trial 0 of every task, then trial 1, ...)
    episodes: int | None = ranged(None, 1)
    seed: int = ranged(1_000_000, 0)  # ManiSkill: episode k is reset with seed + k
    trials_per_task: int = ranged(50, 1)  # a suite: episodes per task (LIBERO: its first N stored inits, 50 = all)
    tasks: list[int] | None = None  # a suite: only these task indices (None: the whole suite, the published protocol)
    deterministic: bool = True  # mean action instead of a sample (else a sample from noise seeded by the episode)
    # rebuild each env's scene at every evaluation reset (ManiSkill's protocol), so an episode depends
    # only on its seed and the weights; false saves ~0.3 s per env and evaluation on CPU, but the
    # simulator's leftovers from training then change some episodes (docs/seeds.md)
    reconfigure: bool = True
    video_episodes: int = ranged(2, 0)  # videos recorded by `train` at its end and by `record`
    videos_per_task: int = ranged(1, 0)  # `eval`: videos of each task's first episodes, recorded during the eval


@dataclass
class SFTConfig:
    """``embodied sft``: supervised warm start on motion-planner demonstrations (envs/demos.py)."""

    demos: int = ranged(100, 1)  # successful demos to record (cached under demos_dir)
    demo_seed: int = ranged(2_000_000, 0)  # demo k is planned from reset seed demo_seed + k (disjoint from eval seeds)
    demos_dir: str = "runs/demos"
    epochs: int = ranged(10, 1)
    batch_size: int = ranged(64, 1)
    lr: float = ranged(3e-4, 0, above=True)


@dataclass
class RunnerConfig:
    total_env_steps: int = ranged(1_000_000, 1)
    max_minutes: float | None = ranged(28, 0, above=True)  # stop training after this wall-clock budget (None: no limit)
    # iterations between validation evaluations on episodes of their own seed stream, never the
    # final evaluation's or training's (envs/seeds.py; 0: only the final evaluation)
    eval_every: int = ranged(10, 0)
    validation_episodes: int | None = ranged(None, 1)  # episodes of each periodic evaluation (None: env.num_envs)
    # the weights train evaluates and records at its end: "last" (the final ones) or "best" (those
    # of the best periodic validation, kept as checkpoints/best.pt; needs eval_every > 0). RL on a
    # warm-started policy can peak mid-run: "best" picks the peak on seeds the final eval never sees
    final_weights: str = "last"
    # stop once periodic evaluations reach this success_once (None: never) ...
    stop_at_success: float | None = ranged(0.98, 0, 1, above=True)
    stop_patience: int = ranged(2, 1)  # ... this many times in a row (PPO oscillates: one lucky eval is not enough)
    # the first periodic evaluation whose success_once reaches this marks the run solved: its training time is
    # the time/solved_minutes scalar and eval.json's training.solved_minutes
    solved_success: float = ranged(0.9, 0, 1, above=True)
    # how iterations get their rollouts (embodied/collection.py): "sync" (weight sync, rollout, update, in
    # lockstep) or "async" (off-policy algorithms: the next rollout runs while the actor updates, with the
    # weights synced every weight_sync_every iterations; train/policy_lag says how many updates behind they were)
    collection: str = "sync"
    weight_sync_every: int = ranged(1, 1)  # collection=async: iterations between weight syncs
    checkpoint_every: int = ranged(10, 1)  # iterations between checkpoints
    # ckpt_<iteration>.pt files kept: older ones are deleted once a newer one is written (best.pt is never)
    keep_checkpoints: int = ranged(3, 1)
    seed: int = ranged(1, 0)  # every random stream of the run derives from it and its purpose (envs/seeds.py)
    run_dir: str | None = None  # None: runs/<task>-<policy>-<timestamp>
    progress: bool = True  # progress bar on stderr
    # a remote call the runner waits on (a rollout, an update, an evaluation round, ...) fails as hung after
    # max(call_deadline_floor_s, call_deadline_factor x its slowest recent duration), or after call_deadline_s
    # if set; a call not yet measured gets first_call_deadline_s (it pays for imports and renderer set-up)
    call_deadline_floor_s: float = ranged(60.0, 0, above=True)
    call_deadline_factor: float = ranged(5.0, 1)
    call_deadline_s: float | None = ranged(None, 0, above=True)
    # it is also every worker start's deadline (first or replacement): a constructor still running is hung
    first_call_deadline_s: float = ranged(900.0, 0, above=True)
    # while it waits on a call, the runner pings the workers this often: a dead one is found within this
    # time, not at the call's deadline
    probe_every_s: float = ranged(5.0, 0, above=True)
    # a worker that does not answer a ping within this long, once a call has outlived its deadline, is "hung"
    # (a stopped or deadlocked process); one that answers but is still busy is reported as such
    ping_timeout_s: float = ranged(10.0, 0, above=True)
    # a worker that dies or hangs is replaced (an actor rank: its group restarts from the last checkpoint)
    # and the run goes on; more than max_worker_restarts restarts of one group within restart_window_minutes
    # stop the run with a checkpoint written then and exit code 4
    max_worker_restarts: int = ranged(5, 0)
    restart_window_minutes: float = ranged(60.0, 0, above=True)
    # recovering: once the broken call's channel is renewed, the workers that survived the fault get this long
    # to end their part of the call; one still busy then is taken as hung and replaced too
    recovery_settle_s: float = ranged(30.0, 0, above=True)
    # before any worker starts, add up what each will hold (replay buffer, envs, policy and optimizer: estimates,
    # embodied/memory_plan.py) against this machine's memory: "on" refuses a run that cannot fit (exit 2, naming the
    # settings that would), "warn" says so and starts it, "off" skips the plan
    memory_check: str = "on"


@dataclass
class TrainConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    checkpoint: str | None = None  # a checkpoint file or run dir: eval/record it, or warm-start train
    resume: str | None = None  # a run directory to continue training


def config_groups() -> dict[str, list[str]]:
    """Group name -> available options, read from configs/<group>/*.yaml."""
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in CONFIG_DIR.iterdir()
        if group.is_dir()
    }


GLOBAL_PACKAGE = "# @package _global_"


def group_option(group: str, option: str, inherited: bool = True) -> dict[str, DictConfig]:
    """``configs/<group>/<option>.yaml`` as the sections it sets: ``{group: its keys}``, or, for a file
    that starts with ``# @package _global_`` (a public checkpoint's policy config, which also sets the
    env its authors ran), every section it names; with ``inherited``, on top of those of the option it
    extends (:func:`group_option_parent`)."""
    path = CONFIG_DIR / group / f"{option}.yaml"
    raw = OmegaConf.load(path)
    if path.read_text().startswith(GLOBAL_PACKAGE):
        own = {str(section): raw[section] for section in raw if section != "defaults"}
    else:
        own = {group: raw}
    parent = group_option_parent(group, option) if inherited else None
    if parent is None:
        return own
    sections = group_option(group, parent)
    for section, settings in own.items():
        sections[section] = OmegaConf.merge(sections.get(section, OmegaConf.create({})), settings)
    return sections


def group_option_parent(group: str, option: str) -> str | None:
    """The option ``configs/<group>/<option>.yaml`` extends (its Hydra defaults list names a sibling), or None."""
    raw = OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml")
    parents = [str(d) for d in raw.get("defaults", []) if str(d) != "_self_"]
    return parents[0] if parents else None


def unknown_key_error(dotted: str) -> UserError:
    """'algorithm.lrr' -> "Unknown config key 'algorithm.lrr'. Did you mean 'algorithm.lr'? ..."."""
    moved = moved_policy_key(dotted)
    if moved:
        return UserError(f"Config key '{dotted}' is now '{moved}': the policy's keys are in one section per family "
                         "(policy.net: mlp, cnn, mlp_tokens; policy.vla: openvla, openvla_oft, qwen_vl; "
                         "embodied/policy_config.py). Write the override or yaml key as "
                         f"{moved}=... (a saved run's config is upgraded when loaded).")
    node = OmegaConf.structured(TrainConfig)
    known_path: list[str] = []
    for part in dotted.split("."):
        valid = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        if part not in valid:
            where = ".".join(known_path) or "the top level"
            nearest = nearest_key(dotted, known_path, valid)
            hint = f" Did you mean {nearest}?" if nearest else ""
            return UserError(
                f"Unknown config key '{dotted}'.{hint} Keys at {where}: {', '.join(valid)}. "
                "Fix the override or the yaml file that sets it (`embodied train --cfg job` prints every key)."
            )
        known_path.append(part)
        node = node[part]
    return UserError(f"Config key '{dotted}' cannot be set this way; see `embodied train --cfg job`.")


def every_key(node: DictConfig | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included: ``env``, ``env.task``, ..., ``algorithm.sac.tau``."""
    node = OmegaConf.structured(TrainConfig) if node is None else node
    keys = []
    for key in node.keys():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(node[key], DictConfig):
            keys += every_key(node[key], f"{dotted}.")
    return keys


def nearest_key(dotted: str, known_path: list[str], valid: list[str]) -> str | None:
    """The key(s) ``dotted`` most likely meant, quoted: those it is the tail of (``sac.buffer_size`` ->
    ``'algorithm.sac.buffer_size'``; ``lr`` -> ``'algorithm.lr' or 'sft.lr'``), a near spelling at the
    level it went wrong (``algorithm.lrr`` -> ``'algorithm.lr'``, ``evl.episodes`` -> ``'eval.episodes'``),
    else the nearest key with the same last name, or spelling, anywhere."""
    keys = every_key()
    tails = [k for k in keys if k.endswith(f".{dotted}")]
    if tails:
        return " or ".join(f"'{k}'" for k in tails[:3])
    parts = dotted.split(".")
    close = difflib.get_close_matches(parts[len(known_path)], valid, n=1)
    if close:
        respelled = ".".join([*known_path, *close, *parts[len(known_path) + 1:]])
        return f"'{respelled if respelled in keys else '.'.join(known_path + close)}'"
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == parts[-1]]
    nearest = (difflib.get_close_matches(dotted, same_leaf, n=1, cutoff=0.0)
               or difflib.get_close_matches(dotted, keys, n=1))
    return f"'{nearest[0]}'" if nearest else None


def unknown_group_option_error(group: str, option: str) -> UserError:
    """``env=maniskill_pushcub`` -> an error listing the files of configs/env/."""
    err = unknown_name_error(f"{group} config ({group}=...)", option, config_groups().get(group, []))
    return UserError(f"{err} Each option is a file configs/{group}/<name>.yaml.")


def _override_error(err: Exception, overrides: list[str]) -> UserError:
    """Turn Hydra's composition error into one paragraph that names the fix."""
    text = str(err)
    missing = re.search(r"Could not find '([\w/]+)/([\w.-]+)'", text)
    if missing:
        return unknown_group_option_error(missing.group(1), missing.group(2))
    key = re.search(r"Could not override '([\w.]+)'", text)
    if key:
        return unknown_key_error(key.group(1))
    return UserError(f"Could not compose the config from {overrides}: {text.splitlines()[0]}")


def _schema_override(override: str, schema: DictConfig) -> str:
    """``policy.vla.gripper=libero`` -> ``++policy.vla.gripper=libero`` when the schema has the key: a group's
    yaml file need not spell every key of its dataclass for the key to be set from the command line."""
    key, sep, _ = override.partition("=")
    if not sep or "." not in key or key[0] in "+~":
        return override
    node = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return override  # unknown: Hydra's error becomes unknown_key_error's paragraph
        node = node[part]
    return "++" + override


def compose(overrides: list[str] | None = None, config_name: str = "train") -> TrainConfig:
    """Compose ``configs/<config_name>.yaml`` with command-line overrides and validate it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema = OmegaConf.structured(TrainConfig)
    overrides = [_schema_override(o, schema) for o in overrides or []]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        try:
            raw = hydra_compose(config_name=config_name, overrides=overrides)
        except Exception as err:  # Hydra raises several types; all mean a bad override
            raise _override_error(err, overrides) from None
    return validate(raw)


def validate(raw: DictConfig | dict) -> TrainConfig:
    """Merge a plain config into the schema; unknown keys and wrong types are UserErrors."""
    schema = OmegaConf.structured(TrainConfig)
    try:
        merged = OmegaConf.merge(schema, raw)
    except (ConfigKeyError, ValidationError, OmegaConfBaseException) as err:
        key = getattr(err, "full_key", None) or ""
        if isinstance(err, ConfigKeyError) and key:
            raise unknown_key_error(key) from None
        raise UserError(f"Invalid config value for '{key}': {str(err).splitlines()[0]}. "
                        "Fix the override or the yaml file that sets it.") from None
    cfg = OmegaConf.to_object(merged)
    check_ranges(cfg)
    from policies.registry import resolve_policy_settings  # torch and the policy modules: only once composed

    resolve_policy_settings(cfg.policy)  # what a checkpoint records, where the config leaves it null
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load_yaml(path: Path) -> TrainConfig:
    """A saved config.yaml (one written before the policy sections too: :func:`upgrade_saved_policy`)."""
    return validate(upgrade_saved_policy(OmegaConf.load(path)))

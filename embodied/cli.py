"""``embodied``: train | sft | eval | evals | record | bench | plan | chaos | check-render | setup-render.

Arguments after the subcommand are Hydra overrides, e.g.
``embodied train env=maniskill_pickcube algorithm.lr=3e-4``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

from omegaconf import OmegaConf

from embodied.bench import BENCHES
from embodied.chaos import GROUP_OF, TARGETS, ChaosMonkey, compare, draw_schedule, markdown, report
from embodied.config import (
    compose,
    config_groups,
    file_overrides,
    group_option,
    to_yaml,
    unknown_group_option_error,
    validate,
)
from embodied.provenance import provenance
from envs.common import UserError
from envs.registry import check_env_config, env_action_dim, seed_scheme
from envs.rendering import check_render, install_lavapipe
from scheduler.cluster import cluster_devices, start_cluster
from scheduler.cost_model import Network
from scheduler.placement import to_placement
from scheduler.planner import plan

EXIT_USER_ERROR = 2
EXIT_ENV_CRASH = 3
EXIT_WORKER_FAULT = 3  # a worker failed more often than runner.max_worker_restarts allows


def _quiet() -> None:
    # SAPIEN warns on every import that it uses its bundled Vulkan loader: harmless
    warnings.filterwarnings("ignore", message=".*libvulkan.*")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning")


def _split(overrides: list[str], key: str) -> tuple[str | None, list[str]]:
    """Pull ``key=value`` out of the overrides."""
    value, rest = None, []
    for item in overrides:
        if item.startswith(f"{key}="):
            value = item.split("=", 1)[1] or None
        else:
            rest.append(item)
    return value, rest


def config_from_saved(saved_yaml: str, overrides: list[str]):
    """A run's saved config with command-line overrides on top.

    ``group=option`` replaces that section by ``configs/<group>/<option>.yaml``;
    ``a.b=value`` sets one key. Unknown keys are UserErrors, as for ``train``.
    """
    base = OmegaConf.create(saved_yaml)
    groups = config_groups()
    dotted = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key in groups:
            if value not in groups[key]:
                raise unknown_group_option_error(key, value)
            sections = group_option(key, value)
            base[key] = sections.pop(key)  # the group's own section is replaced; others take its settings
            for section, settings in sections.items():
                base[section] = OmegaConf.merge(base[section], settings)
        else:
            dotted.append(item)
    return validate(OmegaConf.merge(base, OmegaConf.from_dotlist(dotted)))


@contextlib.contextmanager
def _removed_if_failed_empty(path: Path):
    """A command that fails before writing anything into ``path`` leaves no directory behind."""
    try:
        yield
    except BaseException:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        raise


def cmd_train(overrides: list[str], print_cfg: bool, chaos: ChaosOptions | None = None) -> int:
    """Train; with ``chaos``, while a :class:`~embodied.chaos.ChaosMonkey` kills and stops workers."""
    from embodied.checkpoint import BEST, load_checkpoint, resolve_checkpoint
    from embodied.evaluate import write_eval, write_videos
    from embodied.run_dirs import claim_dir, file_away_final_eval, index_evaluation, protocol_digest
    from embodied.runner import Trainer
    from policies.registry import check_trainable

    resume, rest = _split(overrides, "resume")
    resume_state = None
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"resume={resume}: no config.yaml there. Pass the run directory that "
                            "`embodied train` printed as its last line.")
        resume_state, warm = load_checkpoint(run_dir), None
        cfg = config_from_saved((run_dir / "config.yaml").read_text(), rest)
        cfg.runner.run_dir = str(run_dir)
    else:
        # a warm start (checkpoint=, e.g. an SFT run) trains the checkpoint's env and policy config
        cfg, warm, ckpt_path = _checkpointed(rest)
        if ckpt_path is not None:
            cfg.checkpoint = str(ckpt_path)
    check_trainable(cfg.policy)
    if print_cfg:
        print(to_yaml(cfg))
        return 0
    if not resume:
        run_dir = claim_dir(cfg.runner.run_dir, Path("runs"), f"{cfg.env.task}-{cfg.policy.name}", "this training")
        cfg.runner.run_dir = str(run_dir)
    with _removed_if_failed_empty(run_dir):
        trainer = Trainer(cfg, run_dir, resume_from=resume_state, warm_start=warm)
    monkey = chaos.start(trainer) if chaos else None
    try:
        summary = trainer.train()
        if monkey is not None:
            monkey.stop()
        file_away_final_eval(run_dir)  # a resumed run's earlier final evaluation is kept, not replaced
        table = write_eval(run_dir, summary)
        seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
        evaluated = (run_dir / "checkpoints" / BEST if summary["evaluated"]["weights"] == "best"
                     else resolve_checkpoint(run_dir))
        index_evaluation(run_dir, run_dir, summary, "train", str(evaluated), protocol_digest(cfg.eval, cfg.env, seeds))
        write_videos(run_dir / "videos", trainer.final_videos, summary["rows"], cfg.env)  # filmed during the eval
    finally:
        if monkey is not None:
            monkey.stop()
        trainer.close()
    t, weights = summary["training"], summary["evaluated"]
    print(table)
    print(f"trained {t['env_steps']} env steps in {t['train_minutes']:.1f} min "
          f"({t['env_steps_per_s']:.0f} env-steps/s); eval of the {weights['weights']} weights (iteration "
          f"{weights['iteration']}) over {summary['episodes']} episodes: success_once {summary['success_once']:.3f}")
    if monkey is not None:
        chaos.finish(monkey, run_dir, summary, overrides)
    print(run_dir.resolve())
    return 0


@dataclasses.dataclass
class ChaosOptions:
    """``embodied chaos``: how many faults, drawn with which seed, into which targets."""

    faults: int
    seed: int
    targets: tuple[str, ...]
    reference: bool

    def start(self, trainer):
        self.schedule = draw_schedule(self.seed, self.faults, trainer.total_iterations, self.targets)
        per_group = Counter(GROUP_OF[i.target] for i in self.schedule)
        limit = trainer.cfg.runner.max_worker_restarts
        if max(per_group.values(), default=0) > limit:
            print(f"note: the schedule restarts a group up to {max(per_group.values())} times "
                  f"({dict(per_group)}; simulator faults restart env workers), beyond runner.max_worker_restarts="
                  f"{limit}: the run will stop there unless you raise it", file=sys.stderr)
        monkey = ChaosMonkey(trainer, self.schedule)
        monkey.start()
        return monkey

    def finish(self, monkey, run_dir: Path, summary: dict, overrides: list[str]) -> None:
        """Write chaos.json / chaos.md into the run and print the table; with ``reference``, train the
        same config without faults (into ``<run_dir>/reference``) and compare the final evaluations."""
        result = report(monkey.fired, self.schedule, summary["faults"])
        if self.reference:
            reference_dir = run_dir / "reference"
            print(f"training the same config without faults into {reference_dir}", file=sys.stderr)
            if cmd_train([*overrides, f"runner.run_dir={reference_dir}"], print_cfg=False) != 0:
                raise UserError(f"The reference run in {reference_dir} failed; its output is above.")
            reference = json.loads((reference_dir / "eval.json").read_text())
            result["reference"] = compare(summary["rows"], reference["rows"])
        (run_dir / "chaos.json").write_text(json.dumps(result, indent=1))
        (run_dir / "chaos.md").write_text(markdown(result) + "\n")
        print(markdown(result))


def cmd_chaos(overrides: list[str], faults: int, seed: int, targets: str, reference: bool) -> int:
    """``embodied chaos [overrides]``: train under a seeded schedule of worker kills and stops."""
    chosen = tuple(t.strip() for t in targets.split(",") if t.strip())
    unknown = [t for t in chosen if t not in TARGETS]
    if unknown or not chosen:
        raise UserError(f"--targets {targets!r}: name some of {', '.join(TARGETS)}, comma-separated "
                        "(simulator: the sim processes of env workers, with env.num_procs > 0).")
    return cmd_train(overrides, print_cfg=False, chaos=ChaosOptions(faults, seed, chosen, reference))


def _checkpointed(overrides: list[str]):
    """(config, checkpoint state or None, checkpoint path or None) for eval / record."""
    from embodied.checkpoint import load_checkpoint, resolve_checkpoint

    ckpt, rest = _split(overrides, "checkpoint")
    if ckpt is None:
        return compose(rest), None, None
    path = resolve_checkpoint(ckpt)
    state = load_checkpoint(path)
    cfg = config_from_saved(state["config_yaml"], rest)
    named_here, _ = _split(rest, "runner.run_dir")
    if named_here is None:  # where the checkpoint's run wrote is not where this command writes
        cfg.runner.run_dir = None
    return cfg, state, path


def _out_dir(cfg, ckpt_path: Path | None, kind: str, name: str) -> Path:
    """Where ``eval`` / ``record`` write: ``runner.run_dir`` (refused if it holds results), else a new
    ``<run>/<kind>/<name>-<time>`` beside the checkpoint's run, else ``runs/<kind>-<task>-<policy>-<time>``."""
    from embodied.run_dirs import claim_dir, make_unique_dir, run_of_checkpoint, stamp

    if cfg.runner.run_dir:
        return claim_dir(cfg.runner.run_dir, Path("runs"), kind, f"this {kind}")
    run = run_of_checkpoint(ckpt_path) if ckpt_path is not None else None
    if run is not None:
        return make_unique_dir(run / kind, f"{name}-{stamp()}")
    return make_unique_dir(Path("runs"), f"{kind}-{cfg.env.task}-{cfg.policy.name}-{stamp()}")


def _run_protocol(cfg, actor_state: dict | None, seeds: list[int], record: set[int] = frozenset()):
    """Evaluate ``actor_state`` (None: the policy as built) on ``seeds`` with fresh workers.
    Returns ``(rows, videos, simulator steps run)`` (padding episodes and whole chunks included)."""
    from embodied.runner import start_workers
    from scheduler.faults import WorkerFailure

    workers = start_workers(cfg)
    try:
        for attempt in range(cfg.runner.max_worker_restarts + 1):
            try:  # an evaluation depends only on its seeds and the weights: one a worker fault broke is redone
                if actor_state is not None:
                    workers.load_actor_state(actor_state, weights_only=True)
                rows, videos = workers.evaluate(seeds, cfg.eval.deterministic, record, progress=cfg.runner.progress)
                break
            except WorkerFailure as failure:
                if attempt == cfg.runner.max_worker_restarts:
                    raise
                print(f"note: {failure}; replacing the workers and evaluating again", file=sys.stderr)
                workers.recover(failure)
        layout = workers.layout
        return rows, videos, layout.env_steps(workers.max_episode_steps) * len(layout.evaluation_rounds(len(seeds)))
    finally:
        workers.shutdown()


def cmd_eval(overrides: list[str]) -> int:
    """Run the env backend's evaluation protocol; without a checkpoint, the policy as built
    (``policy=random``: the random baseline). Writes eval.json, eval.md and videos/."""
    from embodied.checkpoint import atomic_write
    from embodied.evaluate import summarize, video_episodes, write_eval, write_videos
    from embodied.run_dirs import check_claimable, index_evaluation, protocol_digest, run_of_checkpoint, written_whole

    cfg, state, path = _checkpointed(overrides)
    check_env_config(cfg.env)
    seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    digest = protocol_digest(cfg.eval, cfg.env, seeds)
    record = video_episodes(seeds, cfg.env, cfg.eval.videos_per_task)
    if state is None and not cfg.policy.model_path:
        print(f"note: no checkpoint given: evaluating policy={cfg.policy.name} as initialised", file=sys.stderr)
    check_claimable(cfg.runner.run_dir, "this eval")
    t0 = time.perf_counter()
    rows, videos, env_steps = _run_protocol(cfg, state["actor"] if state else None, seeds, record)
    summary = summarize(rows, cfg.env, cfg.eval.tasks)
    wall_s = time.perf_counter() - t0
    summary.update(checkpoint=str(path) if path else None, policy=cfg.policy.name, wall_s=wall_s,
                   env_steps=env_steps, env_steps_per_s=env_steps / wall_s, num_envs=cfg.env.num_envs,
                   provenance=provenance(cfg, path))
    # the directory is made only now, and filled whole: an evaluation stopped earlier leaves nothing
    out_dir = _out_dir(cfg, path, "evals", f"{path.stem if path else 'untrained'}-{digest}")
    with written_whole(out_dir) as staging:
        atomic_write(staging / "config.yaml", lambda f: f.write(to_yaml(cfg).encode()))  # what ran, every key
        table = write_eval(staging, summary)
        write_videos(staging / "videos", videos, rows, cfg.env)
    run = run_of_checkpoint(path) if path else None
    if run is not None:
        index_evaluation(run, out_dir, summary, "eval", str(path), digest)
    print(table)
    print(f"{len(rows)} episodes in {wall_s:.0f} s ({env_steps / wall_s:.1f} env-steps/s with "
          f"{cfg.env.num_envs} envs); {len(videos)} videos in {out_dir / 'videos'}")
    print(out_dir.resolve())
    return 0


def cmd_evals(overrides: list[str]) -> int:
    """``embodied evals <run_dir>``: every evaluation of the run's checkpoints, oldest first."""
    from embodied.run_dirs import read_index

    if len(overrides) != 1 or not (Path(overrides[0]) / "config.yaml").exists():
        raise UserError(f"embodied evals needs one training run directory (with a config.yaml), got {overrides}: "
                        "pass the directory `embodied train` printed as its last line.")
    print("| time | kind | checkpoint | protocol | episodes | success_once | success_at_end | return_mean | path |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for e in read_index(Path(overrides[0])):
        print(f"| {e['time']} | {e['kind']} | {Path(e['checkpoint']).name} | {e['protocol']} | {e['episodes']} | "
              f"{e['success_once']:.3f} | {e['success_at_end']:.3f} | {e['return_mean']:.2f} | {e['path']} |")
    return 0


def cmd_record(overrides: list[str]) -> int:
    """Film ``eval.video_episodes`` of the protocol's episodes (each task's first, then the
    protocol's order) through the evaluation's own path: the same workers, resets and noise, so a
    video shows exactly the episode ``eval`` scores. Without a checkpoint: ``policy.model_path``'s
    model as built (e.g. a public checkpoint), or with neither, uniform random actions."""
    from embodied.evaluate import recording_episodes, write_videos
    from embodied.run_dirs import check_claimable, written_whole

    cfg, state, path = _checkpointed(overrides)
    check_env_config(cfg.env)
    protocol = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    seeds = [protocol[k] for k in recording_episodes(protocol, cfg.env, max(cfg.eval.video_episodes, 1))]
    if state is None and not cfg.policy.model_path:  # nothing trained to film: the random baseline
        print("note: no checkpoint or policy.model_path given: filming uniform random actions", file=sys.stderr)
        cfg.policy = dataclasses.replace(cfg.policy, name="random", chunk_size=1)
    check_claimable(cfg.runner.run_dir, "this record")
    rows, videos, _ = _run_protocol(_filming(cfg, len(seeds)), state["actor"] if state else None, seeds,
                                    record=set(range(len(seeds))))
    out_dir = _out_dir(cfg, path, "records", path.stem if path else "untrained")  # made only now: see eval
    with written_whole(out_dir) as staging:
        names = [video.name for video in write_videos(staging, videos, rows, cfg.env)]
    for name in names:
        print((out_dir / name).resolve())
    print(out_dir.resolve())
    return 0


def _filming(cfg, episodes: int):
    """``cfg`` with just enough envs for ``episodes`` (a training config's 128 envs would all run)."""
    per_round = cfg.placement.env_workers * cfg.placement.pipeline_stages
    num_envs = per_round * math.ceil(episodes / per_round)
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, num_envs=num_envs))


def cmd_sft(overrides: list[str]) -> int:
    """``embodied sft [overrides]``: warm-start a VLA on motion-planner demos, then evaluate it."""
    from embodied.checkpoint import load_checkpoint, resolve_checkpoint
    from embodied.evaluate import summarize, write_eval
    from embodied.run_dirs import claim_dir, index_evaluation, protocol_digest
    from embodied.sft import train_sft
    from policies.registry import check_policy_config

    cfg = compose(overrides)
    check_env_config(cfg.env)
    check_policy_config(cfg.policy, env_action_dim(cfg.env))
    run_dir = claim_dir(cfg.runner.run_dir, Path("runs"), f"sft-{cfg.env.task}-{cfg.policy.name}", "this SFT run")
    cfg.runner.run_dir = str(run_dir)
    with _removed_if_failed_empty(run_dir):
        stats = train_sft(cfg, run_dir)
    seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
    rows, _, _ = _run_protocol(cfg, load_checkpoint(run_dir)["actor"], seeds)
    summary = summarize(rows, cfg.env, cfg.eval.tasks)
    summary["sft"] = stats
    print(write_eval(run_dir, summary))
    index_evaluation(run_dir, run_dir, summary, "sft", str(resolve_checkpoint(run_dir)),
                     protocol_digest(cfg.eval, cfg.env, seeds))
    print(f"SFT on {stats['demos']} demos ({stats['steps']} steps), {cfg.sft.epochs} epochs: "
          f"loss {stats['sft/loss']:.3f}, token accuracy {stats['sft/token_accuracy']:.3f}; "
          f"eval success_once {summary['success_once']:.3f}")
    print(run_dir.resolve())
    return 0


def cmd_check_render() -> int:
    works, message = check_render()
    print(message)
    return 0 if works else 1


def cmd_setup_render() -> int:
    """Make SAPIEN rendering work: nothing to do where a Vulkan driver works already."""
    works, message = check_render()
    if not works:
        print(f"No working Vulkan driver; installing lavapipe: {install_lavapipe(verbose=False)}")
        works, message = check_render()
    print(message)
    return 0 if works else 1


def cmd_bench(overrides: list[str], as_json: bool, iterations: int) -> int:
    """``embodied bench <name> [overrides]``: print the table (or JSON); files go to bench/<name>-<time>/."""
    from embodied.run_dirs import make_unique_dir, stamp

    if not overrides:
        raise UserError(f"embodied bench needs a benchmark name: one of {', '.join(BENCHES)}.")
    name, rest = overrides[0], overrides[1:]
    bench = importlib.import_module(BENCHES.get(name))
    out_dir = make_unique_dir(Path("bench"), f"{name}-{stamp()}")
    summary = bench.run(rest, iterations=iterations, out_dir=out_dir)  # progress goes to stderr
    print(json.dumps(summary, indent=2) if as_json else bench.markdown(summary) + f"\nfiles: {out_dir.resolve()}")
    return 0


def cmd_plan(overrides: list[str], devices: int | None, profile_path: str | None, as_json: bool,
             devices_per_node: int | None = None, network_gbps: float = 100.0) -> int:
    """``embodied plan [overrides]``: the candidate plans for a config, predicted from its profile
    (``--profile`` or the cache; measured now if neither has it), for this machine's devices or
    ``--devices N`` (what-if: size a cluster from a profile taken on one machine), on nodes of
    ``--devices-per-node`` devices joined by ``--network-gbps`` links."""
    from embodied.runner import STAGE_RUNNERS
    from scheduler.auto import profile_sizes, workload_of
    from scheduler.profiler import cached_profile, load

    if (devices_per_node is not None and devices_per_node < 1) or network_gbps <= 0:
        raise UserError(f"--devices-per-node {devices_per_node} / --network-gbps {network_gbps}: both must be "
                        "positive (e.g. --devices 64 --devices-per-node 8 --network-gbps 100).")
    network = Network(devices_per_node, network_gbps)
    cfg = compose(overrides)
    if profile_path is not None:
        if not Path(profile_path).exists():
            raise UserError(f"--profile {profile_path}: no such file. Profiles are written by `embodied plan` and "
                            f"`placement.mode=auto` runs under placement.profile_dir ({cfg.placement.profile_dir}).")
        profile, source = load(Path(profile_path)), Path(profile_path)
    else:
        start_cluster(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.num_gpus)
        here = cluster_devices()
        devices = devices or len(here.devices)
        profile, source, _ = cached_profile(cfg, profile_sizes(cfg.env.num_envs), len(here.devices),
                                            Path(cfg.placement.profile_dir), STAGE_RUNNERS,
                                            log=lambda m: print(m, file=sys.stderr))
    devices = devices or 1
    choice = plan(profile, workload_of(cfg, profile), devices, offload=profile.device_kind == "gpu", network=network)
    nodes = -(-devices // devices_per_node) if devices_per_node else 1
    if as_json:
        print(json.dumps({"profile": str(source), "devices": devices, "nodes": nodes,
                          "best": choice.best and choice.best.candidate.name(),
                          "candidates": [{"plan": p.candidate.name(), "predicted_s": p.iteration_s,
                                          "feasible": p.feasible, "why": p.infeasible} for p in choice.table]},
                         indent=2))
        return 0
    where = f" on {nodes} nodes ({network.gbps:g} Gb/s links)" if nodes > 1 else ""
    print(f"profile: {source}; {devices} device(s){where}; {cfg.env.num_envs} envs\n")
    print(choice.markdown())
    if choice.best is not None:
        best = to_placement(choice.best.candidate, cfg.placement)
        keys = ("mode", "env", "rollout", "actor", "env_workers", "rollout_workers", "pipeline_stages", "offload")
        print("\nrun it with: " + " ".join(f"placement.{k}={getattr(best, k)}" for k in keys))
    return 0


def _explain(err: BaseException) -> tuple[str, int] | None:
    """A user-facing (message, exit code) for errors we know how to explain."""
    from envs.subproc import EnvCrashedError
    from scheduler.faults import RestartBudgetExceeded, WorkerFailure

    if isinstance(err, RestartBudgetExceeded):
        return err.message(), EXIT_WORKER_FAULT
    if isinstance(err, WorkerFailure):  # outside a training run's loop, or beyond an evaluation's retries
        return (f"{err}. Check that worker's log lines above (Ray prints them) and the machine's memory; a training "
                "run continues from its last checkpoint with `embodied train resume=<run_dir>`.", EXIT_WORKER_FAULT)
    try:
        from ray.exceptions import ActorDiedError, RayTaskError

        if isinstance(err, RayTaskError) and err.cause is not None:
            err = err.cause
        if isinstance(err, ActorDiedError) and "creation task" in str(err):
            return _explain_failed_start(str(err))
    except ImportError:
        pass
    if isinstance(err, UserError):
        return str(err), EXIT_USER_ERROR
    if isinstance(err, EnvCrashedError):
        return f"{err}\nThe last checkpoint is kept; continue with `embodied train resume=<run_dir>`.", EXIT_ENV_CRASH
    return None


def _explain_failed_start(report: str) -> tuple[str, int]:
    """A worker's constructor raised (Ray's report of it is ``report``). Bad input found only there
    (a UserError) is a config error like any other: its own paragraph, exit 2. Anything else is a
    crash: an env worker's points at the simulator, a policy worker's at the policy."""
    user_error = re.search(r"UserError: (.*)", report, re.DOTALL)
    if user_error:
        return user_error.group(1).strip(), EXIT_USER_ERROR
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    if "EnvWorker" in report:
        check = ("the env on its own (`embodied check-render`, or build it with `embodied record` and the same "
                 "overrides)")
    else:
        check = "the policy on its own (`embodied record` with the same overrides builds it in one process)"
    return f"A worker failed to start: {lines[-1]}\nCheck {check}; the traceback is above.", EXIT_ENV_CRASH


def _commands(args) -> dict:
    """The command name -> what runs it, with the parsed arguments."""
    return {
        "train": lambda: cmd_train(args.overrides, print_cfg=args.cfg == "job"),
        "sft": lambda: cmd_sft(args.overrides),
        "eval": lambda: cmd_eval(args.overrides),
        "evals": lambda: cmd_evals(args.overrides),
        "record": lambda: cmd_record(args.overrides),
        "bench": lambda: cmd_bench(args.overrides, args.json, args.iterations),
        "plan": lambda: cmd_plan(args.overrides, args.devices, args.profile, args.json, args.devices_per_node,
                                 args.network_gbps),
        "chaos": lambda: cmd_chaos(args.overrides, args.faults, args.chaos_seed, args.targets, args.reference),
        "check-render": cmd_check_render,
        "setup-render": cmd_setup_render,
    }


COMPOSED_COMMANDS = ("train", "sft", "eval", "record", "plan", "chaos")  # the ones that run a composed config


def _config_file(command: str, path: str) -> list[str]:
    """``--config FILE`` as overrides, for the commands that run a composed config."""
    if command not in COMPOSED_COMMANDS:
        raise UserError(f"--config sets the config a command runs; `embodied {command}` runs none. Use it with "
                        f"{', '.join(COMPOSED_COMMANDS)}.")
    return file_overrides(path)


def cmd_print_config(command: str, overrides: list[str]) -> int:
    """``embodied <command> --cfg job``: print the config the command would run (every key), run nothing."""
    if command not in COMPOSED_COMMANDS:
        raise UserError(f"--cfg job prints the config a command runs; `embodied {command}` runs none. Use it with "
                        f"{', '.join(COMPOSED_COMMANDS)}.")
    cfg = _checkpointed(overrides)[0] if command in ("eval", "record") else compose(overrides)
    print(to_yaml(cfg))
    return 0


def main(argv: list[str] | None = None) -> int:
    _quiet()
    parser = argparse.ArgumentParser(prog="embodied", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    parser.add_argument("--config", metavar="FILE", help="a YAML file of settings (group options, sections of "
                        "keys), applied before the command line's overrides")
    parser.add_argument("--json", action="store_true", help="bench: print the results as JSON")
    parser.add_argument("--iterations", type=int, default=2, help="bench: measured iterations per mode")
    parser.add_argument("--devices", type=int, help="plan: plan for this many devices (what-if)")
    parser.add_argument("--profile", help="plan: a saved profile (JSON) instead of this machine's")
    parser.add_argument("--devices-per-node", type=int, help="plan: nodes of this many devices (what-if)")
    parser.add_argument("--network-gbps", type=float, default=100.0, help="plan: link between nodes, Gb/s")
    parser.add_argument("--faults", type=int, default=10, help="chaos: worker faults to inject")
    parser.add_argument("--chaos-seed", type=int, default=0, help="chaos: seed of the fault schedule")
    parser.add_argument("--targets", default="env,rollout,actor",
                        help="chaos: which processes to signal (env, rollout, actor, simulator)")
    parser.add_argument("--reference", action="store_true",
                        help="chaos: also train without faults and compare the final evaluations")
    parser.add_argument("command", choices=["train", "sft", "eval", "evals", "record", "bench", "plan", "chaos",
                                            "check-render", "setup-render"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: group=option or a.b=value "
                        "(bench: the benchmark name first, e.g. `embodied bench pipeline`)")
    args = parser.parse_intermixed_args(argv)
    if args.cfg == "job" and args.command != "train":  # train prints it itself (resume= reloads a saved config)
        commands = {args.command: lambda: cmd_print_config(args.command, args.overrides)}
    else:
        commands = _commands(args)
    try:
        if args.config:  # the file's settings first: the command line's overrides win
            args.overrides = [*_config_file(args.command, args.config), *args.overrides]
        return commands[args.command]()
    except Exception as err:
        explained = _explain(err)
        if explained is None:
            raise
        message, code = explained
        print(f"error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())

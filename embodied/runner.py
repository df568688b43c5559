"""The training loop, on Ray worker groups.

One iteration: weight sync (actor -> rollout) -> rollout (env <-> rollout workers
over a Channel) -> PPO update on the actor -> logging, checkpoint, evaluation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from embodied.algorithms.advantages import ADVANTAGES
from embodied.algorithms.losses import LOSSES
from embodied.checkpoint import save_checkpoint
from embodied.config import TrainConfig, to_yaml
from embodied.evaluate import summarize
from embodied.workers.actor_worker import ActorWorker
from embodied.workers.env_worker import EnvWorker
from embodied.workers.rollout_worker import BOOTSTRAP_MASKS, RolloutWorker
from envs.registry import check_env_config
from envs.subproc import EnvCrashedError
from policies.registry import check_policy_name
from scheduler.channel import Channel
from scheduler.cluster import start_cluster
from scheduler.placement import make_plan
from scheduler.worker import WorkerGroup

VALIDATION_SEED_OFFSET = 10_000_000  # periodic evals use eval.seed + this + k


@dataclass
class Progress:
    """Counters saved in every checkpoint so a resumed run continues where it stopped."""

    iteration: int = 0
    env_steps: int = 0
    train_seconds: float = 0.0  # wall-clock of the training loop (evals and checkpoints included)
    solved_at_seconds: float | None = None  # first periodic eval with success_once >= 0.9


class Workers:
    """The three worker groups of a run and the channel between env and rollout workers."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # bad names fail here, in seconds, before any worker starts
        check_env_config(cfg.env)
        check_policy_name(cfg.policy.name)
        for registry, name in ((ADVANTAGES, cfg.algorithm.advantage), (LOSSES, cfg.algorithm.loss),
                               (BOOTSTRAP_MASKS, cfg.algorithm.bootstrap)):
            registry.get(name)
        resources = start_cluster(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.num_gpus)
        plan = make_plan(cfg.placement, num_gpus=int(resources.get("GPU", 0)),
                         num_cpus=int(resources.get("CPU", 1)), num_envs=cfg.env.num_envs)
        threads = cfg.placement.torch_threads
        self.envs_per_worker = cfg.env.num_envs // cfg.placement.env_workers
        self.env = WorkerGroup(EnvWorker, plan.groups["env"], plan, threads,
                               env_cfg=cfg.env, num_envs=self.envs_per_worker)
        spec = self.env.call("spec")[0]
        self.obs_spec, self.action_dim = spec["obs_spec"], spec["action_dim"]
        self.max_episode_steps = spec["max_episode_steps"]
        common = dict(policy_cfg=cfg.policy, algorithm_cfg=cfg.algorithm,
                      obs_spec=self.obs_spec, action_dim=self.action_dim)
        self.rollout = WorkerGroup(RolloutWorker, plan.groups["rollout"], plan, threads,
                                   num_env_workers=len(self.env), seed=cfg.runner.seed, **common)
        self.actor = WorkerGroup(ActorWorker, plan.groups["actor"], plan, threads, seed=cfg.runner.seed,
                                 update_threads=cfg.placement.actor_threads, **common)
        self.channel = Channel("env<->rollout")

    def sync_weights(self) -> None:
        import ray

        weights = ray.put(self.actor.call("get_weights")[0])
        self.rollout.call("set_weights", weights)

    def rollout_and_update(self, num_steps: int) -> tuple[list[dict], dict, dict]:
        """Collect ``num_steps`` per env, then one PPO update.

        Returns (finished episodes, train stats, stage times in seconds).
        """
        import ray

        t0 = time.perf_counter()
        env_refs = self.env.call_async("interact", num_steps, self.channel)
        trajectory_refs = self.rollout.call_async("collect", num_steps, self.channel)
        env_out = ray.get(env_refs)
        ray.wait(trajectory_refs, num_returns=len(trajectory_refs))
        t1 = time.perf_counter()
        # trajectories go rollout -> actor through the object store, never via the driver
        stats = ray.get(self.actor.workers[0].update.remote(*trajectory_refs))
        times = {
            "rollout_s": t1 - t0,
            "update_s": time.perf_counter() - t1,
            "env_sim_s": max(out["sim_s"] for out in env_out),
            "env_wait_s": max(out["wait_s"] for out in env_out),
        }
        return [row for out in env_out for row in out["episodes"]], stats, times

    def evaluate(self, episodes: int, seed: int, deterministic: bool) -> list[dict]:
        """Run at least ``episodes`` fixed-horizon episodes, seeds ``seed, seed+1, ...``."""
        import ray

        self.sync_weights()  # evaluate the actor's current policy, not the last one rolled out
        num_envs = self.envs_per_worker * len(self.env)
        rows: list[dict] = []
        for round_ in range(math.ceil(episodes / num_envs)):
            base = seed + round_ * num_envs
            seeds = [[base + r * self.envs_per_worker + i for i in range(self.envs_per_worker)]
                     for r in range(len(self.env))]
            env_refs = self.env.call_async("evaluate", per_rank_args=[(s, self.channel) for s in seeds])
            serve = self.rollout.call_async("serve_eval", self.max_episode_steps, self.channel, deterministic)
            rows += [row for part in ray.get(env_refs) for row in part]
            ray.get(serve)
        return sorted(rows, key=lambda r: r["seed"])

    def shutdown(self) -> None:
        try:
            self.env.call("close")  # stops sim subprocesses cleanly
        except Exception:
            pass  # a crashed env worker has nothing left to close
        for group in (self.env, self.rollout, self.actor):
            group.shutdown()


def _mean(rows: list[dict], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


class Trainer:
    """Runs ``cfg`` in ``run_dir``; continues from ``resume_from`` (a checkpoint dict) if given."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, resume_from: dict | None = None,
                 warm_start: dict | None = None):
        from embodied.run_logger import RunLogger

        self.cfg = cfg
        self.run_dir = run_dir
        self.progress = Progress(**resume_from["progress"]) if resume_from else Progress()
        self.workers = Workers(cfg)  # validates names and placement before anything is written
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        if resume_from:
            self.workers.actor.call("load_state", resume_from["actor"])
        elif warm_start:
            self.workers.actor.call("load_state", warm_start["actor"], weights_only=True)
        self.steps_per_iteration = cfg.algorithm.rollout_steps * cfg.env.num_envs
        self.total_iterations = math.ceil(cfg.runner.total_env_steps / self.steps_per_iteration)
        self.log = RunLogger(run_dir, cfg.runner.total_env_steps, self.progress.env_steps, cfg.runner.progress)

    # -- checkpoints ------------------------------------------------------------
    def save(self) -> Path:
        from dataclasses import asdict

        state = {
            "actor": self.workers.actor.call("state")[0],
            "progress": asdict(self.progress),
            "config_yaml": to_yaml(self.cfg),
            "obs_spec": self.workers.obs_spec,
            "action_dim": self.workers.action_dim,
        }
        return save_checkpoint(self.run_dir, self.progress.iteration, state)

    # -- the loop ------------------------------------------------------------------
    def _time_is_up(self) -> bool:
        limit = self.cfg.runner.max_minutes
        return limit is not None and self.progress.train_seconds >= limit * 60

    def _good_enough(self, eval_history: list[float]) -> bool:
        target, patience = self.cfg.runner.stop_at_success, self.cfg.runner.stop_patience
        recent = eval_history[-patience:]
        return target is not None and len(recent) == patience and min(recent) >= target

    def _set_lr(self) -> None:
        if self.cfg.algorithm.anneal_lr:
            frac = 1.0 - self.progress.iteration / self.total_iterations
            self.workers.actor.call("set_lr", frac * self.cfg.algorithm.lr)

    def train(self) -> dict:
        """Train to ``runner.total_env_steps`` (or ``runner.max_minutes``), then evaluate."""
        cfg, p = self.cfg, self.progress
        # a resumed run gets fresh env seeds, not a replay of its first iterations
        self.workers.env.call("reset", seed=cfg.runner.seed + 1_000 * p.iteration)
        try:
            eval_history: list[float] = []
            while (p.iteration < self.total_iterations and not self._time_is_up()
                   and not self._good_enough(eval_history)):
                start = time.perf_counter()
                self._iterate()
                if cfg.runner.eval_every and p.iteration % cfg.runner.eval_every == 0:
                    eval_history.append(self._periodic_eval(elapsed=time.perf_counter() - start))
                if cfg.runner.checkpoint_every and p.iteration % cfg.runner.checkpoint_every == 0:
                    self.save()
                p.train_seconds += time.perf_counter() - start
        except EnvCrashedError:
            self.save()  # the actor's state is intact: keep the progress made so far
            raise
        self.save()
        self.log.close_progress()
        return self.final_eval()

    def _iterate(self) -> None:
        p = self.progress
        self._set_lr()
        t0 = time.perf_counter()
        self.workers.sync_weights()
        t1 = time.perf_counter()
        episodes, stats, times = self.workers.rollout_and_update(self.cfg.algorithm.rollout_steps)
        t2 = time.perf_counter()
        p.iteration += 1
        p.env_steps += self.steps_per_iteration
        scalars = {f"train/{k}": v for k, v in stats.items()}
        scalars.update({f"time/{k}": v for k, v in times.items()})
        scalars.update({
            "time/weight_sync_s": t1 - t0,
            "time/iteration_s": t2 - t0,
            "time/env_steps_per_s": self.steps_per_iteration / (t2 - t0),
            "time/total_minutes": (p.train_seconds + t2 - t0) / 60,
        })
        if episodes:
            scalars.update({
                "env/success_once": _mean(episodes, "success_once"),
                "env/success_at_end": _mean(episodes, "success_at_end"),
                "env/return": _mean(episodes, "return"),
                "env/episode_length": _mean(episodes, "length"),
                "env/episodes": len(episodes),
            })
        self.log.scalars(scalars, p.env_steps)
        self.log.advance(self.steps_per_iteration, success=scalars.get("env/success_once"))

    def _periodic_eval(self, elapsed: float) -> float:
        """Evaluate on one batch of episodes; returns success_once. ``elapsed``: this iteration's time so far."""
        cfg, p = self.cfg, self.progress
        # validation seeds, disjoint from the final evaluation's: stopping early on the
        # episodes that are then reported would flatter the result
        rows = self.workers.evaluate(cfg.env.num_envs, cfg.eval.seed + VALIDATION_SEED_OFFSET,
                                     cfg.eval.deterministic)
        success = _mean(rows, "success_once")
        self.log.scalars({"eval/success_once": success, "eval/success_at_end": _mean(rows, "success_at_end"),
                          "eval/return": _mean(rows, "return")}, p.env_steps)
        if success >= 0.9 and p.solved_at_seconds is None:
            p.solved_at_seconds = p.train_seconds + elapsed
            self.log.scalars({"time/solved_minutes": p.solved_at_seconds / 60}, p.env_steps)
        self.workers.env.call("reset", seed=cfg.runner.seed + 1_000 * p.iteration)
        return success

    def final_eval(self) -> dict:
        cfg = self.cfg
        rows = self.workers.evaluate(cfg.eval.episodes, cfg.eval.seed, cfg.eval.deterministic)
        summary = summarize(rows, cfg.env.task)
        summary["training"] = {
            "iterations": self.progress.iteration,
            "env_steps": self.progress.env_steps,
            "train_minutes": self.progress.train_seconds / 60,
            "env_steps_per_s": self.progress.env_steps / max(self.progress.train_seconds, 1e-9),
            "solved_minutes": None if self.progress.solved_at_seconds is None
            else self.progress.solved_at_seconds / 60,
        }
        self.log.scalars({"eval/final_success_once": summary["success_once"],
                          "eval/final_success_at_end": summary["success_at_end"]}, self.progress.env_steps)
        return summary

    def close(self) -> None:
        self.log.close()
        self.workers.shutdown()


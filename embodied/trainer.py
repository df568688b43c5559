"""The training loop: :class:`Trainer` runs a config on the worker groups of
:mod:`embodied.runner` and redoes the work a failed worker broke.

One iteration: weight sync (actor -> rollout) and a turn for env + rollout workers -> rollout
(env <-> rollout workers over a Channel, per micro-batch) -> a turn for the actor -> the
algorithm's update -> logging, checkpoint, evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embodied import interrupts
from embodied.algorithms.registry import make_algorithm
from embodied.algorithms.replay import demo_transitions
from embodied.checkpoint import (
    BEST,
    Progress,
    checkpoint_state,
    checkpoints_of,
    load_checkpoint,
    newest_checkpoint,
    save_best_checkpoint,
    save_checkpoint,
)
from embodied.collection import make_collector
from embodied.config import TrainConfig, to_yaml
from embodied.evaluate import recording_episodes, summarize
from embodied.recovery import FaultLog, Recovery
from embodied.run_logger import RunLogger
from embodied.runner import start_workers
from embodied.sft import demos_for
from envs.common import UserError
from envs.registry import seed_scheme, validation_seeds
from envs.seeds import RunSeeds
from scheduler.runtime.faults import RestartBudgetExceeded, WorkerFailure


def success_ends_episode(cfg: TrainConfig) -> bool:
    """Whether success ends a training episode: ``env.success_ends_episode``, or the algorithm's
    default (yes for PPO; no for GRPO, which scores an episode's return over the whole horizon)."""
    if cfg.env.success_ends_episode is not None:
        return cfg.env.success_ends_episode
    return make_algorithm(cfg.algorithm).success_ends_episode


def _raised_within(err: BaseException, function: Callable) -> bool:
    """Whether ``err`` was raised inside a call of ``function`` (a frame of its traceback runs it)."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is function.__code__:
            return True
        tb = tb.tb_next
    return False


def _mean(rows: list[dict], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


class Trainer:
    """Runs ``cfg`` in ``run_dir``; continues from ``resume_from`` (a checkpoint dict) if given.

    A worker that dies or hangs does not end the run: the piece of work it broke (an iteration,
    a validation, a checkpoint, the final evaluation) is redone after :meth:`_recover`.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, resume_from: dict | None = None,
                 warm_start: dict | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.progress = Progress(**resume_from["progress"]) if resume_from else Progress()
        self.started_from = dataclasses.replace(self.progress)  # what a lost actor restarts from without a checkpoint
        self.warm_start = warm_start
        self.workers = start_workers(cfg)  # checks names and placement before anything is written
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        if resume_from:
            self.workers.load_actor_state(resume_from["actor"])  # its KL reference included
        else:
            if warm_start:
                self.workers.load_actor_state(warm_start["actor"], weights_only=True)
            self.workers.actor.call("freeze_reference")  # algorithm.kl_coef's reference: the starting weights
        self.steps_per_iteration = self.workers.layout.env_steps(self.workers.steps_per_rollout)
        # runner.collection: each iteration's rollout in lockstep with the updates, or while the actor updates
        self.collector = make_collector(self.workers, cfg.runner.collection, cfg.runner.weight_sync_every)
        self.algorithm = make_algorithm(cfg.algorithm)
        # e.g. GRPO: every iteration starts fresh episodes, a group's envs from one initial state
        self.episodic = self.algorithm.episodic
        self.success_ends_episode = success_ends_episode(cfg)
        self.total_iterations = math.ceil(cfg.runner.total_env_steps / self.steps_per_iteration)
        limit = cfg.runner.max_minutes
        self.log = RunLogger(run_dir, cfg.runner.total_env_steps, self.progress.env_steps, cfg.runner.progress,
                             max_seconds=None if limit is None else limit * 60, elapsed_s=self.progress.train_seconds)
        if self.workers.auto is not None:
            auto = self.workers.auto
            self.log.note("placement", f"auto, from {auto.profile_path}:\n{auto.choice.markdown(limit=12)}")
        ranks = "" if self.workers.data_parallel == "single" else f"; actor ranks: {self.workers.data_parallel}"
        self.log.note("placement", self.workers.plan.describe() + ranks)
        for line in self.algorithm.describe(self.workers.obs_spec, self.workers.action_dim):
            self.log.note("algorithm", line)
        self.demos = self._demos() if self.algorithm.uses_demos else None  # RLPD: what the actor also draws from
        self._give_demos()
        for line in self.workers.notes:
            self.log.text("checkpoint", line)  # printed already, before the workers started
        self.iteration_seconds: list[float] = []
        self.final_videos: dict[int, dict] = {}  # what final_eval filmed: episode index -> frames
        self.eval_history: list[float] = []  # periodic validations' success_once
        # work due before the next iteration, redone if a fault breaks it: "reset" (training envs),
        # "eval" (a periodic validation), "checkpoint"
        self.todo: list[str] = [] if self.episodic else ["reset"]  # episodic iterations reset the envs themselves
        self.faults = FaultLog(cfg.runner)
        self.recovery = Recovery(self.workers, self.faults, note=lambda line: self.log.note("fault", line),
                                 restore_actor=self._restore_actor, now=self._when, give_up=self._stop,
                                 recovered=self._recovered)

    def _demos(self):
        """The demos' transitions (recorded once by the task's motion planner, then cached, as `embodied sft`'s)."""
        demos = demos_for(self.cfg, self.cfg.runner.progress)
        transitions = demo_transitions(demos, self.cfg.algorithm.gamma, self.cfg.algorithm.bootstrap == "all_ends")
        self.log.note("algorithm", f"{len(transitions)} transitions from {len(demos.seeds)} demos of {demos.task} make "
                                   f"{self.cfg.algorithm.sac.demo_fraction:.0%} of every batch")
        return transitions

    def _give_demos(self) -> None:
        """Hand the demos to the actor (at start, and to a restarted actor group)."""
        if self.demos is not None:
            self.workers.actor.call("load_demos", self.demos)

    # -- checkpoints ------------------------------------------------------------
    def _state(self) -> dict:
        return checkpoint_state(self.workers.actor_state(), self.progress, to_yaml(self.cfg), self.workers.obs_spec,
                                self.workers.action_dim)

    def save(self) -> Path:
        return save_checkpoint(self.run_dir, self.progress.iteration, self._state(),
                               keep=self.cfg.runner.keep_checkpoints)

    def _keep_if_best(self, success: float) -> None:
        """Save the weights as checkpoints/best.pt if ``success`` beats every earlier validation
        (ties keep the earlier: a later equal score is no evidence of a better policy)."""
        p = self.progress
        if p.best_eval_success is not None and success <= p.best_eval_success:
            return
        p.best_eval_success, p.best_iteration = success, p.iteration
        save_best_checkpoint(self.run_dir, self._state())
        self.log.scalars({"eval/best_success_once": success}, p.env_steps)

    def _load_final_weights(self) -> dict:
        """Load the weights ``runner.final_weights`` names; returns what the summary says of them."""
        p = self.progress
        if self.cfg.runner.final_weights == "last" or p.best_iteration is None:
            return {"weights": "last", "iteration": p.iteration}
        self.workers.load_actor_state(load_checkpoint(self.run_dir / "checkpoints" / BEST)["actor"], weights_only=True)
        return {"weights": "best", "iteration": p.best_iteration, "validation_success_once": p.best_eval_success}

    # -- the loop ------------------------------------------------------------------
    def _time_is_up(self) -> bool:
        limit = self.cfg.runner.max_minutes
        return limit is not None and self.progress.train_seconds >= limit * 60

    def _good_enough(self) -> bool:
        target, patience = self.cfg.runner.stop_at_success, self.cfg.runner.stop_patience
        recent = self.eval_history[-patience:]
        return target is not None and len(recent) == patience and min(recent) >= target

    def _training_done(self) -> bool:
        return (not self.todo and (self.progress.iteration >= self.total_iterations or self._time_is_up()
                                   or self._good_enough()))

    def _set_lr(self) -> None:
        if self.cfg.algorithm.anneal_lr:
            frac = 1.0 - self.progress.iteration / self.total_iterations
            self.workers.actor.call("set_lr", frac * self.cfg.algorithm.lr)

    def train(self) -> dict:
        """Train to ``runner.total_env_steps`` (or ``runner.max_minutes``), then evaluate. Ctrl-C
        (embodied/interrupts.py): checkpoint what there is, then raise :class:`~embodied.interrupts.Interrupted`."""
        with interrupts.handled():
            interrupts.set_hint(self._resume_hint)
            try:
                return self._train()
            except interrupts.Interrupted:
                raise
            except KeyboardInterrupt as err:
                raise self._interrupted(err) from None

    def _resume_hint(self) -> str:
        newest = checkpoints_of(self.run_dir)
        if not newest:
            return f"no checkpoint in {self.run_dir}: nothing to resume"
        return f"the newest checkpoint is {newest[0].name}; continue with `embodied train resume={self.run_dir}`"

    def _interrupted(self, err: KeyboardInterrupt) -> interrupts.Interrupted:
        """After a Ctrl-C: checkpoint the iteration reached (an update in flight finished and counted,
        :meth:`_iterate`), unless its checkpoint is written (the final one: the final evaluation may hold
        the best weights, not these), workers were being replaced (a new actor may not hold the run's
        weights yet) or the actor cannot give one. The error's line says which."""
        p = self.progress
        if any(c.name == f"ckpt_{p.iteration:06d}.pt" for c in checkpoints_of(self.run_dir)):
            return interrupts.Interrupted(f"interrupted at iteration {p.iteration}: {self._resume_hint()}")
        if _raised_within(err, Recovery._recover):
            why = "workers were being replaced"
        else:
            p.train_seconds += time.perf_counter() - getattr(self, "_advance_started", time.perf_counter())
            try:
                return interrupts.Interrupted(f"interrupted at iteration {p.iteration}: checkpoint {self.save().name} "
                                              f"written; continue with `embodied train resume={self.run_dir}`")
            except Exception as failure:  # the actor is gone (WorkerFailure) or cannot save
                why = f"{type(failure).__name__}: {failure}".splitlines()[0]
        return interrupts.Interrupted(f"interrupted at iteration {p.iteration}, no checkpoint written now ({why}); "
                                      f"{self._resume_hint()}")

    def _train(self) -> dict:
        saved = False
        while not saved:  # a lost actor restores an older checkpoint: train on from there
            while not self._training_done():
                self._advance_started = start = time.perf_counter()
                self.recovery.guarded(self._advance)
                self.progress.train_seconds += time.perf_counter() - start
            saved, _ = self.recovery.guarded(self.save)
        self.log.close_progress()
        done, summary = False, None
        while not done:
            done, summary = self.recovery.guarded(self.final_eval)
        return summary

    def _advance(self) -> None:
        """One iteration, then the validation and checkpoint it makes due; work a fault broke
        is still in ``todo`` and runs first."""
        cfg, p = self.cfg, self.progress
        if not self.todo:
            self._iterate()
            every = {"eval": cfg.runner.eval_every, "checkpoint": cfg.runner.checkpoint_every}
            self.todo = [work for work, n in every.items() if n and p.iteration % n == 0]
        while self.todo:
            WORK[self.todo[0]](self)
            self.todo.pop(0)

    def _validate(self) -> None:
        self.eval_history.append(self._periodic_eval(elapsed=time.perf_counter() - self._advance_started))
        self._keep_if_best(self.eval_history[-1])

    # -- faults (embodied/recovery.py replaces the workers; these hooks restore the run) ----------
    def _when(self) -> tuple[float, int]:
        return self.progress.train_seconds / 60, self.progress.iteration

    def _recovered(self) -> None:
        self.collector.forget()  # a rollout in flight was broken with the call
        if not self.episodic and "reset" not in self.todo:
            self.todo.insert(0, "reset")  # the aborted call left episodes half-run
        self.log.scalars(self.faults.scalars(), self.progress.env_steps)

    def _restore_actor(self) -> tuple[int, str]:
        """Load the newest checkpoint into the new actor group (none yet: the run's starting
        weights) and roll progress back to it. Returns (iterations lost, what was done)."""
        p = self.progress
        try:
            path, state, skipped = newest_checkpoint(self.run_dir)
            restored = f"actor group restored from {path.name}"
            restored += "".join(f" (passed over {s.describe()})" for s in skipped)
        except UserError:
            path, state, restored = None, self.warm_start, "actor group restarted from the starting weights"
        if path is not None:
            self.workers.load_actor_state(state["actor"])
            back_to = Progress(**state["progress"])
        else:
            if state is not None:
                self.workers.load_actor_state(state["actor"], weights_only=True)
            self.workers.actor.call("freeze_reference")
            back_to = self.started_from
        self._give_demos()
        lost = p.iteration - back_to.iteration
        p.iteration, p.env_steps = back_to.iteration, back_to.env_steps
        self.todo = []  # the validation or checkpoint of a rolled-back iteration comes again with it
        return lost, restored

    def _stop(self, exceeded: RestartBudgetExceeded, failure: WorkerFailure) -> None:
        """Over the restart budget: write a checkpoint now if the actor is alive, then raise."""
        exceeded.run_dir = str(self.run_dir)
        if not any(f.group == "actor" for f in failure.faults):
            try:
                exceeded.checkpoint = str(self.save())
            except WorkerFailure:
                pass  # the actor went too: the last periodic checkpoint is what there is
        raise exceeded

    def _reset_envs(self) -> None:
        """New training episodes, seeded by the iteration: a resumed run does not replay its first ones."""
        self.collector.settle()  # a rollout still in flight keeps the envs
        self.workers.reset_envs(self.progress.iteration, self.progress.env_steps // self.cfg.env.num_envs,
                                self.algorithm.group_size, self.success_ends_episode)

    def _iterate(self) -> None:
        p = self.progress
        self._set_lr()
        t0 = time.perf_counter()
        warm_up = self.algorithm.uniform_actions(p.env_steps)  # off-policy warm-up: few or no gradient steps
        if self.episodic:
            self._reset_envs()
        collected = self.collector.collect(p.iteration)
        episodes = collected.episodes
        with interrupts.finishing():  # a Ctrl-C now: the update finishes and counts, then a checkpoint
            stats, update_times = self.workers.update(collected.trajectories, p.iteration)
            if stats.get("samples", 1.0) == 0:  # say it where a person looks, not only in TensorBoard
                self.log.note("update", f"iteration {p.iteration + 1} trained on nothing: "
                                        f"{self.algorithm.nothing_trained}")
            t2 = time.perf_counter()
            if not warm_up:  # what auto placement's prediction is held against (_auto_report)
                self.iteration_seconds.append(t2 - t0)
            p.iteration += 1
            p.env_steps += self.steps_per_iteration
        scalars = {f"train/{k}": v for k, v in stats.items()} | {"train/policy_lag": collected.policy_lag}
        scalars.update({f"time/{k}": v for k, v in {**collected.times, **update_times}.items()})
        scalars.update({
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
        self.log.advance(self.steps_per_iteration, success=scalars.get("env/success_once"),
                         elapsed_s=p.train_seconds + t2 - t0)

    def _periodic_eval(self, elapsed: float) -> float:
        """Evaluate on one batch of episodes; returns success_once. ``elapsed``: this iteration's time so far."""
        cfg, p = self.cfg, self.progress
        # validation seeds, disjoint from the final evaluation's: stopping early on the
        # episodes that are then reported would flatter the result
        episodes = cfg.runner.validation_episodes or cfg.env.num_envs
        self.collector.settle()  # the envs finish a rollout in flight first
        seeds = validation_seeds(cfg.env, RunSeeds(cfg.runner.seed), episodes)
        rows, _ = self.workers.evaluate(seeds, cfg.eval.deterministic)
        success = _mean(rows, "success_once")
        self.log.scalars({"eval/success_once": success, "eval/success_at_end": _mean(rows, "success_at_end"),
                          "eval/return": _mean(rows, "return"), "eval/episodes": len(rows)}, p.env_steps)
        if success >= cfg.runner.solved_success and p.solved_at_seconds is None:
            p.solved_at_seconds = p.train_seconds + elapsed
            self.log.scalars({"time/solved_minutes": p.solved_at_seconds / 60}, p.env_steps)
        if not self.episodic:  # the evaluation used the envs; episodic iterations reset them anyway
            self._reset_envs()
        return success

    def final_eval(self) -> dict:
        """Evaluate the ``runner.final_weights`` weights on the protocol's episodes, filming
        ``eval.video_episodes`` of them as they run (kept in ``final_videos``: episode index ->
        frames)."""
        cfg = self.cfg
        self.collector.settle()
        weights = self._load_final_weights()
        seeds = seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)
        record = set(recording_episodes(seeds, cfg.env, cfg.eval.video_episodes))
        rows, self.final_videos = self.workers.evaluate(seeds, cfg.eval.deterministic, record,
                                                        progress=cfg.runner.progress)
        summary = summarize(rows, cfg.env, cfg.eval.tasks)
        summary["evaluated"] = weights
        summary["faults"] = self.faults.summary()
        summary["training"] = {
            "iterations": self.progress.iteration,
            "env_steps": self.progress.env_steps,
            "train_minutes": self.progress.train_seconds / 60,
            "env_steps_per_s": self.progress.env_steps / max(self.progress.train_seconds, 1e-9),
            "solved_minutes": None if self.progress.solved_at_seconds is None
            else self.progress.solved_at_seconds / 60,
        }
        if self.workers.auto is not None:
            summary["auto_placement"] = self._auto_report()
        self.log.scalars({"eval/final_success_once": summary["success_once"],
                          "eval/final_success_at_end": summary["success_at_end"]}, self.progress.env_steps)
        return summary

    def _auto_report(self) -> dict:
        """The auto plan's predicted iteration time against the measured one (the median
        iteration after the first, which pays one-time start-up costs), and what profiling
        added to the run (``profile_share``: of profiling plus training time)."""
        auto = self.workers.auto
        steady = self.iteration_seconds[1:] or self.iteration_seconds
        measured = statistics.median(steady) if steady else None
        return {"plan": auto.choice.best.candidate.name(), "predicted_iteration_s": auto.predicted_s,
                "measured_iteration_s": measured,
                "measured_over_predicted": measured / auto.predicted_s if measured else None,
                "profile": str(auto.profile_path), "profiled_now": auto.profiled_now,
                "profile_seconds": auto.profile_seconds,
                "profile_share": auto.profile_seconds / (auto.profile_seconds + self.progress.train_seconds)}

    def close(self) -> None:
        self.log.close()
        self.workers.shutdown()


# what Trainer.todo's entries do
WORK: dict[str, Callable[[Trainer], Any]] = {
    "reset": Trainer._reset_envs, "eval": Trainer._validate, "checkpoint": Trainer.save,
}


"""The training loop, on Ray worker groups.

One iteration: weight sync (actor -> rollout) and a turn for env + rollout workers
-> rollout (env <-> rollout workers over a Channel, per micro-batch) -> a turn for
the actor -> PPO update -> logging, checkpoint, evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from embodied.algorithms.advantages import OUTCOME_ADVANTAGES
from embodied.algorithms.ppo import ppo_update
from embodied.checkpoint import (
    BEST,
    Progress,
    checkpoint_state,
    load_checkpoint,
    resolve_checkpoint,
    save_best_checkpoint,
    save_checkpoint,
)
from embodied.checks import check_run_config
from embodied.config import TrainConfig, to_yaml
from embodied.evaluate import recording_episodes, summarize
from embodied.recovery import FaultLog, FaultRecord
from embodied.run_logger import RunLogger
from embodied.workers.actor_worker import ActorWorker
from embodied.workers.env_worker import EnvWorker
from embodied.workers.rollout_worker import RolloutWorker
from envs.common import UserError
from envs.messages import EnvSpec
from envs.registry import (
    seed_scheme,
    training_reset_seeds,
    validation_seeds,
)
from envs.seeds import AutoResets, RunSeeds
from policies.registry import check_policy_observations
from scheduler.auto import AutoPlan, auto_placement
from scheduler.channel import Channel
from scheduler.cluster import cluster_devices, start_cluster
from scheduler.context_switch import ContextSwitcher
from scheduler.faults import Deadlines, RestartBudgetExceeded, Watchdog, WorkerFailure, WorkerFault
from scheduler.layout import BatchLayout
from scheduler.placement import ClusterDevices, make_plan
from scheduler.profiler import StageRunners
from scheduler.worker import WorkerGroup, wait_ready


def success_ends_episode(cfg: TrainConfig) -> bool:
    """Whether success ends a training episode: ``env.success_ends_episode``, or by default yes
    for PPO and no for GRPO (it scores an episode's return over the whole horizon)."""
    if cfg.env.success_ends_episode is not None:
        return cfg.env.success_ends_episode
    return cfg.algorithm.advantage not in OUTCOME_ADVANTAGES


class Workers:
    """The three worker groups of a run, the channel between env and rollout workers,
    weight sync and context switching. Every call they are waited on has a deadline
    (:class:`~scheduler.faults.Watchdog`); :meth:`recover` replaces workers that failed."""

    def __init__(self, cfg: TrainConfig, devices: ClusterDevices, auto: AutoPlan | None = None):
        """Start the groups of a checked config on a running cluster's ``devices`` (see
        :func:`start_workers`); ``auto``: the plan ``placement.mode=auto`` chose, if it did."""
        self.cfg = cfg
        self.auto = auto
        self.plan = plan = make_plan(cfg.placement, devices, num_envs=cfg.env.num_envs)
        threads = cfg.placement.torch_threads
        # with action chunks a step is a decision: chunk_size simulator steps
        self.layout = BatchLayout(cfg.env.num_envs, cfg.placement.env_workers, plan.pipeline_stages,
                                  cfg.policy.chunk_size)
        self.env = WorkerGroup(EnvWorker, "env", plan, threads, env_cfg=cfg.env, layout=self.layout)
        runner = cfg.runner
        self.watchdog = Watchdog({"env": self.env}, Deadlines(runner.call_deadline_floor_s, runner.call_deadline_factor,
                                                              runner.first_call_deadline_s, runner.call_deadline_s))
        self.env.get = self.watchdog.get
        spec: EnvSpec = self.env.call("spec")[0]
        self.obs_spec, self.action_dim, self.max_episode_steps = spec.obs_spec, spec.action_dim, spec.max_episode_steps
        check_policy_observations(cfg.policy, self.obs_spec, self.action_dim)  # before any policy worker starts
        self.steps_per_rollout = cfg.algorithm.rollout_steps or self.max_episode_steps
        common = dict(policy_cfg=cfg.policy, algorithm_cfg=cfg.algorithm,
                      obs_spec=self.obs_spec, action_dim=self.action_dim)
        self.rollout = WorkerGroup(RolloutWorker, "rollout", plan, threads, layout=self.layout,
                                   seed=cfg.runner.seed, wait=False, **common)
        self.actor = WorkerGroup(ActorWorker, "actor", plan, threads, seed=cfg.runner.seed, wait=False,
                                 per_rank_kwargs=[{"update_threads": t}
                                                  for t in plan.update_threads(cfg.placement.actor_threads)],
                                 **common)
        wait_ready(self.rollout, self.actor)  # both groups start side by side: seconds of imports each
        self.groups = {"env": self.env, "rollout": self.rollout, "actor": self.actor}
        self.watchdog.groups = self.groups
        self.rollout.get = self.actor.get = self.watchdog.get
        self.data_parallel = self._join_actor_ranks()
        self.actor_shares = self.layout.actor_shares(len(self.rollout), len(self.actor))
        self.channel = Channel("env<->rollout")
        self.switcher = ContextSwitcher(plan, self.groups)
        self._setup_weight_sync()
        self._weights_ref = None
        self._weights_stale = True  # the actor has weights the rollout workers have not got
        self.notes: list[str] = []  # the config checks' lines for the run log (start_workers fills them)

    def _join_actor_ranks(self) -> str:
        """Several actor ranks: one process group, data-parallel as ``placement.data_parallel``
        says; returns the strategy they train with."""
        import ray

        if len(self.actor) == 1:
            return "single"
        address = ray.get(self.actor.workers[0].group_address.remote())
        return self.actor.call("join_data_parallel", address, self.cfg.placement.data_parallel)[0]

    # -- weight sync and turns ------------------------------------------------------------
    def _setup_weight_sync(self) -> None:
        if self.plan.weight_sync == "shared_memory":
            layout = self.actor.call("share_weights")[0]
            self.rollout.call("attach_shared_weights", layout)
            self.actor.call("unlink_shared_weights")  # every mapping is made: nothing left to clean up
        elif self.plan.weight_sync == "broadcast":
            address = self.actor.call("group_address")[0]
            world = 1 + len(self.rollout)
            self.watchdog.get(self.actor.call_async("join_broadcast_group", address, world)
                              + self.rollout.call_async("join_broadcast_group", address, world), "weight_sync")

    def _publish_weights(self) -> None:
        """Actor side of a weight sync: to the shared buffer, into the object store, or the
        whole broadcast (actor and rollout workers are both resident: see make_plan)."""
        if self.plan.weight_sync == "shared_memory":
            self.actor.call("publish_weights")
        elif self.plan.weight_sync == "broadcast":
            self.watchdog.get(self.actor.call_async("broadcast_weights") + self.rollout.call_async("receive_broadcast"),
                              "weight_sync")
        else:
            refs = self.actor.call_async("get_weights")  # every rank: FSDP gathers the shards
            self.watchdog.get(refs, "actor.get_weights", fetch=False)  # read before the actor may be offloaded
            self._weights_ref = refs[0]

    def _receive_weights(self) -> None:
        if self.plan.weight_sync == "shared_memory":
            self.rollout.call("use_shared_weights")
        elif self.plan.weight_sync == "object_store":
            self.rollout.call("set_weights", self._weights_ref)

    def load_actor_state(self, state: dict, weights_only: bool = False) -> None:
        self.switcher.turn("train")
        self.actor.call("load_state", state, weights_only=weights_only)
        self._weights_stale = True

    def actor_state(self) -> dict:
        """The actor's full state (for a checkpoint), onloading it first if it was offloaded."""
        self.switcher.turn("train")
        return self.actor.call("state")[0]

    def prepare_generation(self, force_sync: bool = False) -> dict[str, float]:
        """Sync weights and give the devices to env and rollout workers; returns timings.

        Weights are sent only if the actor changed them, unless ``force_sync`` (benchmarks).
        """
        t0 = time.perf_counter()
        if self._weights_stale or force_sync:  # the actor is resident: it just trained or was loaded
            self._publish_weights()
            self._weights_stale = False
        t1 = time.perf_counter()
        switch = self.switcher.turn("generate")
        t2 = time.perf_counter()
        self._receive_weights()
        return {"weight_sync_s": (t1 - t0) + (time.perf_counter() - t2), **switch}

    # -- one iteration -------------------------------------------------------------------
    def rollout_steps(self, num_steps: int, iteration: int = 0) -> tuple[list[dict], list, dict]:
        """Collect ``num_steps`` per env (``iteration``: whose rollout noise to draw, so a redone
        iteration samples as the first try did). Returns (finished episodes, trajectory refs, stage times)."""
        t0 = time.perf_counter()
        env_refs = self.env.call_async("interact", num_steps, self.channel)
        trajectory_refs = self.rollout.call_async("collect", num_steps, self.channel, iteration)
        # the trajectories stay in the object store (they go to the actor, never via the driver)
        everything = self.watchdog.get(env_refs + trajectory_refs, "rollout", fetch=False, inspect=env_refs)
        env_out = everything[:len(env_refs)]
        rollout_times = self.rollout.call("last_times")
        times = {
            "rollout_s": time.perf_counter() - t0,
            "env_sim_s": max(out.sim_s for out in env_out),
            "env_step_s": max(out.step_s for out in env_out),
            "env_wait_s": max(out.wait_s for out in env_out),
            "infer_s": max(t["infer_s"] for t in rollout_times),
            "infer_wait_s": max(t["wait_s"] for t in rollout_times),
        }
        return [row for out in env_out for row in out.episodes], trajectory_refs, times

    def update(self, trajectory_refs: list, critic_only: bool = False) -> tuple[dict, dict]:
        """Give the devices to the actor and run one PPO update (``critic_only``: critic warm-up).
        Returns (stats, timings)."""
        switch = self.switcher.turn("train")
        t0 = time.perf_counter()
        # trajectories go rollout -> actor through the object store, never via the driver; each
        # actor rank reads the rollout workers' trajectories that hold its envs
        shares = [(envs, *(trajectory_refs[k] for k in ranks)) for ranks, envs in self.actor_shares]
        stats = self.actor.call("update", per_rank_args=shares, critic_only=critic_only)[0]
        self._weights_stale = True
        return stats, {"update_s": time.perf_counter() - t0, **{f"train_{k}": v for k, v in switch.items()}}

    def reset_envs(self, iteration: int, sim_steps: int, group_size: int = 1,
                   success_ends_episode: bool = True) -> None:
        """Reset every env for training at ``iteration``, ``sim_steps`` simulator steps per env
        into the run. Env ``j`` of the whole batch starts episode slot ``j // group_size`` (the
        envs of a GRPO group share an initial state) of the training-reset stream; the episodes
        that envs start by themselves draw from the auto-reset stream (envs/seeds.py).
        ``success_ends_episode`` False: episodes end only at the time limit."""
        run, layout = RunSeeds(self.cfg.runner.seed), self.layout
        seeds = training_reset_seeds(self.cfg.env, run, iteration, layout.num_envs, group_size)
        auto = AutoResets(run.auto_resets, 0, layout.num_envs, sim_steps)
        self.env.call("reset", per_rank_args=[(rank_seeds, auto.shifted(layout.rank_slice(r).start),
                                               success_ends_episode)
                                              for r, rank_seeds in enumerate(layout.per_rank(seeds))])

    def evaluate(self, seeds: list[int], deterministic: bool, record: set[int] | frozenset = frozenset(),
                 progress: bool = False) -> tuple[list[dict], dict]:
        """Run one fixed-horizon episode per seed, each exactly once.

        Env ``j`` of the whole batch runs the ``j``-th block of consecutive seeds (an env
        that changes task mid-block, as LIBERO's, rebuilds its scene only at task borders);
        the last round is padded with repeats that are run but not reported. Returns
        ``(rows, videos)``: a row per seed, in ``seeds`` order (``episode`` = its index),
        and the frames of the episodes whose index is in ``record``. ``progress``: a bar
        over episodes on stderr.
        """
        self.prepare_generation()  # evaluate the actor's current policy, not the last one rolled out
        layout = self.layout
        rows: list[dict] = []
        videos: dict = {}
        bar = tqdm(total=len(seeds), unit="episode", desc="eval", disable=not progress, file=sys.stderr,
                   dynamic_ncols=True)
        for ids in layout.evaluation_rounds(len(seeds)):
            batch = [seeds[i] if i >= 0 else seeds[-1] for i in ids]
            args = [(rank_seeds, rank_ids, [i in record for i in rank_ids], self.channel, self.cfg.eval.reconfigure)
                    for rank_seeds, rank_ids in zip(layout.per_rank(batch), layout.per_rank(ids), strict=True)]
            env_refs = self.env.call_async("evaluate", per_rank_args=args)
            by_rank = dict(enumerate(layout.per_rank(batch)))
            serve = self.rollout.call_async("serve_eval", self.max_episode_steps, self.channel, deterministic, by_rank)
            for part in self.watchdog.get(env_refs + serve, "eval_round")[:len(env_refs)]:
                rows += part.rows
                videos.update(part.videos)
                bar.update(len(part.rows))
        bar.close()
        return sorted(rows, key=lambda r: r["episode"]), videos

    # -- faults ------------------------------------------------------------------------
    def recover(self, failure: WorkerFailure, settle_s: float = 30.0) -> list[WorkerFault]:
        """Replace the workers ``failure`` names and end the call they broke: the channel is
        renewed (survivors blocked on it raise and go idle; one still busy after ``settle_s`` is
        hung too), env and rollout ranks are replaced one by one, the actor group as a whole
        (its ranks share a process group), and weights are re-shared. Returns every fault
        handled (``failure.faults`` plus survivors found stuck). The caller restores the actor's
        state (a new actor group holds its initial weights) and resets the envs."""
        faults = list(failure.faults)
        for fault in faults:
            self.groups[fault.group].kill(fault.rank)  # a hung one stops holding its resources now
        self.channel.close()
        self.channel = Channel("env<->rollout")
        known = {(f.group, f.rank) for f in faults}
        for group, rank in self.watchdog.settle(settle_s):
            if (group, rank) not in known:
                process = self.groups[group].processes[rank]
                faults.append(WorkerFault(group, rank, "hung", failure.call, f"still busy {settle_s:.0f} s after "
                                          "the call was aborted", process.pid if process else None))
                self.groups[group].kill(rank)
        lost = {f.group for f in faults}
        for fault in faults:
            if fault.group != "actor":
                self.groups[fault.group].replace(fault.rank)
        if "rollout" in lost and self.plan.weight_sync == "broadcast":
            self._restart_broadcast_peers(actor_lost="actor" in lost)
        elif "actor" in lost:
            self.actor.restart()
            self.data_parallel = self._join_actor_ranks()
        if lost & {"rollout", "actor"}:
            self._setup_weight_sync()
            self._weights_stale = True
        self.switcher.workers_replaced()
        return faults

    def _restart_broadcast_peers(self, actor_lost: bool) -> None:
        """A broadcast group cannot take a new member: restart every rollout worker and the
        actor, which keeps its state when it is alive."""
        state = None if actor_lost else self.actor_state()
        self.rollout.restart()
        self.actor.restart()
        if state is not None:
            self.load_actor_state(state)

    def process_ids(self, group: str) -> list[int]:
        """The pids of ``group``'s ranks (``embodied chaos`` signals them)."""
        return [p.pid for p in self.groups[group].processes if p is not None]

    def shutdown(self) -> None:
        import ray

        try:  # stops sim subprocesses cleanly; a crashed or hung env worker has nothing left to close
            ray.get(self.env.call_async("close"), timeout=30)
        except Exception:
            pass
        for group in (self.env, self.rollout, self.actor):
            group.shutdown()


def start_workers(cfg: TrainConfig) -> Workers:
    """Check ``cfg`` (bad names and placements fail here, in seconds, before any worker starts),
    start or join the Ray cluster, choose the placement (``placement.mode=auto``: profile, or
    read the cached profile, plan, and write the chosen placement into ``cfg.placement``), then
    start the worker groups."""
    notes = check_run_config(cfg)
    for line in notes:  # what a checkpoint left to the config (e.g. its normalisation), before anything starts
        print(f"note: {line}", file=sys.stderr)
    started = time.perf_counter()
    _say(f"start-up: {'joining the Ray cluster at ' + cfg.ray.address if cfg.ray.address else 'starting Ray'} ...")
    start_cluster(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.num_gpus)
    devices = cluster_devices()
    auto = None
    if cfg.placement.mode == "auto":
        auto = auto_placement(cfg, len(devices.devices), devices.kind, STAGE_RUNNERS)
        cfg.placement = auto.placement
    placement = cfg.placement
    _say(f"start-up: {placement.env_workers} env, {placement.rollout_workers} rollout and {placement.actor_workers} "
         f"actor worker(s) on {len(devices.devices)} {devices.kind} device(s) (placement.mode={placement.mode}): "
         f"building {cfg.env.num_envs} envs and the policy ...")
    workers = Workers(cfg, devices, auto)
    workers.notes = notes
    _say(f"start-up: workers ready in {time.perf_counter() - started:.0f} s")
    return workers


def _say(line: str) -> None:
    """A phase of a command that takes seconds with nothing else to show (stderr: results go to stdout)."""
    print(line, file=sys.stderr, flush=True)


STAGE_RUNNERS = StageRunners(start_workers=start_workers, update=ppo_update)  # what placement.mode=auto profiles


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
        # GRPO: every iteration starts fresh episodes, a group's envs from one initial state
        self.episodic = cfg.algorithm.advantage in OUTCOME_ADVANTAGES
        self.success_ends_episode = success_ends_episode(cfg)
        self.total_iterations = math.ceil(cfg.runner.total_env_steps / self.steps_per_iteration)
        self.log = RunLogger(run_dir, cfg.runner.total_env_steps, self.progress.env_steps, cfg.runner.progress)
        if self.workers.auto is not None:
            auto = self.workers.auto
            self.log.note("placement", f"auto, from {auto.profile_path}:\n{auto.choice.markdown(limit=12)}")
        ranks = "" if self.workers.data_parallel == "single" else f"; actor ranks: {self.workers.data_parallel}"
        self.log.note("placement", self.workers.plan.describe() + ranks)
        for line in self.workers.notes:
            self.log.text("checkpoint", line)  # printed already, before the workers started
        self.iteration_seconds: list[float] = []
        self.final_videos: dict[int, dict] = {}  # what final_eval filmed: episode index -> frames
        self.eval_history: list[float] = []  # periodic validations' success_once
        # work due before the next iteration, redone if a fault breaks it: "reset" (training envs),
        # "eval" (a periodic validation), "checkpoint"
        self.todo: list[str] = [] if self.episodic else ["reset"]  # episodic iterations reset the envs themselves
        self.faults = FaultLog(cfg.runner)
        self.recovering = False  # True while workers are being replaced (embodied chaos waits for it)

    # -- checkpoints ------------------------------------------------------------
    def _state(self) -> dict:
        return checkpoint_state(self.workers.actor_state(), self.progress, to_yaml(self.cfg), self.workers.obs_spec,
                                self.workers.action_dim)

    def save(self) -> Path:
        return save_checkpoint(self.run_dir, self.progress.iteration, self._state())

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
        """Train to ``runner.total_env_steps`` (or ``runner.max_minutes``), then evaluate."""
        saved = False
        while not saved:  # a lost actor restores an older checkpoint: train on from there
            while not self._training_done():
                self._advance_started = start = time.perf_counter()
                self._guarded(self._advance)
                self.progress.train_seconds += time.perf_counter() - start
            saved, _ = self._guarded(self.save)
        self.log.close_progress()
        done, summary = False, None
        while not done:
            done, summary = self._guarded(self.final_eval)
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

    # -- faults ----------------------------------------------------------------------
    def _guarded(self, work: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, work())``, or ``(False, None)`` when a worker failed during it and was
        replaced (every failure met while recovering is recovered from too, within the budget)."""
        try:
            return True, work()
        except WorkerFailure as failure:
            pending: WorkerFailure | None = failure
            while pending is not None:
                pending = self._recover(pending)
            return False, None

    def _recover(self, failure: WorkerFailure) -> WorkerFailure | None:
        """Spend a restart (beyond the budget: stop, see :meth:`_stop`), replace the failed
        workers, restore a lost actor from the last checkpoint, and log each fault. Returns a
        failure met on the way, None when the run can go on."""
        started, detected_at, p = time.perf_counter(), time.time(), self.progress
        self.recovering = True
        try:
            try:
                self.faults.spend(failure)
            except RestartBudgetExceeded as exceeded:
                self._stop(exceeded, failure)
            self.log.note("fault", f"{failure}; replacing the workers")
            faults = self.workers.recover(failure)
            groups = {f.group for f in faults}
            iteration = p.iteration
            lost, action = self._restore_actor() if "actor" in groups else (0, "replaced")
            if not self.episodic and "reset" not in self.todo:
                self.todo.insert(0, "reset")  # the aborted call left episodes half-run
        except WorkerFailure as again:
            return again
        finally:
            self.recovering = False
        seconds = time.perf_counter() - started
        envs_each = self.workers.layout.envs_per_worker
        actions = {"actor": action, "channel": "channel renewed"}
        recovery = len({r.recovery for r in self.faults.records})
        for fault in faults or [WorkerFault("channel", 0, "stalled", failure.call, failure.detail)]:
            self.faults.add(FaultRecord(
                minute=p.train_seconds / 60, detected_at=detected_at, iteration=iteration, call=failure.call,
                group=fault.group, rank=fault.rank, kind=fault.kind, pid=fault.pid, detail=fault.detail,
                action=actions.get(fault.group, "replaced"), iterations_lost=lost if fault.group == "actor" else 0,
                episodes_failed=envs_each if fault.group == "env" and failure.call == "rollout" else 0,
                recovery=recovery, recovery_s=seconds))
            if fault.group == "actor":
                lost = 0  # the group's loss, counted once
        self.log.scalars(self.faults.scalars(), p.env_steps)
        self.log.note("fault", f"recovered in {seconds:.1f} s ({action}); {len(self.faults.records)} fault(s) so far")
        return None

    def _restore_actor(self) -> tuple[int, str]:
        """Load the newest checkpoint into the new actor group (none yet: the run's starting
        weights) and roll progress back to it. Returns (iterations lost, what was done)."""
        p = self.progress
        try:
            path = resolve_checkpoint(self.run_dir)
            state, restored = load_checkpoint(path), f"actor group restored from {path.name}"
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
        group = self.cfg.algorithm.group_size if self.episodic else 1
        self.workers.reset_envs(self.progress.iteration, self.progress.env_steps // self.cfg.env.num_envs, group,
                                self.success_ends_episode)

    def _iterate(self) -> None:
        p = self.progress
        self._set_lr()
        t0 = time.perf_counter()
        if self.episodic:
            self._reset_envs()
        sync = self.workers.prepare_generation()
        episodes, trajectories, times = self.workers.rollout_steps(self.workers.steps_per_rollout, p.iteration)
        warming_up = p.iteration < self.cfg.algorithm.critic_warmup_iterations
        stats, update_times = self.workers.update(trajectories, critic_only=warming_up)
        if stats.get("samples", 1.0) == 0:  # say it where a person looks, not only in TensorBoard
            self.log.note("update", f"iteration {p.iteration + 1} trained on nothing: every sample was filtered out "
                          "(GRPO with algorithm.filter_uniform_groups drops groups whose episodes all scored "
                          "the same; all successes or all failures give no signal). Larger groups, more envs or a "
                          "denser reward give mixed groups.")
        t2 = time.perf_counter()
        self.iteration_seconds.append(t2 - t0)
        p.iteration += 1
        p.env_steps += self.steps_per_iteration
        scalars = {f"train/{k}": v for k, v in stats.items()}
        scalars.update({f"time/{k}": v for k, v in {**sync, **times, **update_times}.items()})
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
        self.log.advance(self.steps_per_iteration, success=scalars.get("env/success_once"))

    def _periodic_eval(self, elapsed: float) -> float:
        """Evaluate on one batch of episodes; returns success_once. ``elapsed``: this iteration's time so far."""
        cfg, p = self.cfg, self.progress
        # validation seeds, disjoint from the final evaluation's: stopping early on the
        # episodes that are then reported would flatter the result
        episodes = cfg.runner.validation_episodes or cfg.env.num_envs
        seeds = validation_seeds(cfg.env, RunSeeds(cfg.runner.seed), episodes)
        rows, _ = self.workers.evaluate(seeds, cfg.eval.deterministic)
        success = _mean(rows, "success_once")
        self.log.scalars({"eval/success_once": success, "eval/success_at_end": _mean(rows, "success_at_end"),
                          "eval/return": _mean(rows, "return"), "eval/episodes": len(rows)}, p.env_steps)
        if success >= 0.9 and p.solved_at_seconds is None:
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


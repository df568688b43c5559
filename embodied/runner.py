"""A run's worker groups: :class:`Workers` (env, rollout and actor groups, the channel between
env and rollout workers, weight sync, turns on shared devices, recovery of failed ranks) and
:func:`start_workers`, which checks a config and starts them. :mod:`embodied.trainer` drives them
through iterations; ``embodied eval`` / ``record`` use them to evaluate.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from embodied.algorithms.registry import make_algorithm
from embodied.checks import check_run_config
from embodied.config import TrainConfig
from embodied.memory_plan import check_memory
from embodied.workers.actor_worker import ActorWorker
from embodied.workers.env_worker import EnvWorker
from embodied.workers.rollout_worker import RolloutWorker
from envs.messages import EnvSpec
from envs.registry import (
    training_reset_seeds,
)
from envs.seeds import AutoResets, RunSeeds
from policies.registry import check_policy_observations
from scheduler.auto import AutoPlan, auto_placement
from scheduler.placement import actor_update_threads, make_plan
from scheduler.profiler import StageRunners
from scheduler.runtime.channel import Channel
from scheduler.runtime.cluster import cluster_devices, start_cluster
from scheduler.runtime.context_switch import ContextSwitcher
from scheduler.runtime.faults import Deadlines, Watchdog, WorkerFailure, WorkerFault
from scheduler.runtime.layout import BatchLayout
from scheduler.runtime.plan import ClusterDevices
from scheduler.runtime.weight_sync_strategies import make_weight_sync
from scheduler.runtime.worker import WorkerGroup, wait_ready


@dataclass
class RolloutCall:
    """A rollout in flight: the env and rollout workers' result refs, and when it started."""

    env_refs: list
    trajectory_refs: list
    started: float


class Workers:
    """The three worker groups of a run, the channel between env and rollout workers,
    weight sync and context switching. Every call they are waited on has a deadline
    (:class:`~scheduler.runtime.faults.Watchdog`); :meth:`recover` replaces workers that failed."""

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
        runner = cfg.runner
        # every call to a group is waited on with a deadline, and a failure is traced to its rank
        self.watchdog = watchdog = Watchdog(Deadlines(runner.call_deadline_floor_s, runner.call_deadline_factor,
                                                      runner.first_call_deadline_s, runner.call_deadline_s),
                                            probe_every_s=runner.probe_every_s, ping_timeout_s=runner.ping_timeout_s)
        started = dict(start_deadline_s=runner.first_call_deadline_s, get=watchdog.get)
        self.env = watchdog.watch(WorkerGroup(EnvWorker, "env", plan, threads, env_cfg=cfg.env, layout=self.layout,
                                              **started))
        spec: EnvSpec = self.env.call("spec")[0]
        self.obs_spec, self.action_dim, self.max_episode_steps = spec.obs_spec, spec.action_dim, spec.max_episode_steps
        check_policy_observations(cfg.policy, self.obs_spec, self.action_dim)  # before any policy worker starts
        self.steps_per_rollout = cfg.algorithm.rollout_steps or self.max_episode_steps
        common = dict(policy_cfg=cfg.policy, algorithm_cfg=cfg.algorithm,
                      obs_spec=self.obs_spec, action_dim=self.action_dim)
        self.rollout = watchdog.watch(WorkerGroup(RolloutWorker, "rollout", plan, threads, layout=self.layout,
                                                  seed=cfg.runner.seed, wait=False, **started, **common))
        self.actor = watchdog.watch(WorkerGroup(ActorWorker, "actor", plan, threads, seed=cfg.runner.seed, wait=False,
                                                per_rank_kwargs=[{"update_threads": t} for t in
                                                                 plan.update_threads(actor_update_threads(cfg))],
                                                **started, **common))
        wait_ready(self.rollout, self.actor)  # both groups start side by side: seconds of imports each
        self.groups = {"env": self.env, "rollout": self.rollout, "actor": self.actor}
        self.data_parallel = self._join_actor_ranks()
        self.actor_shares = self.layout.actor_shares(len(self.rollout), len(self.actor))
        self.channel = Channel("env<->rollout")
        self.switcher = ContextSwitcher(plan, self.groups)
        self.weight_sync = make_weight_sync(plan.weight_sync, self.actor, self.rollout, watchdog.get)
        self.weight_sync.setup()
        self._weights_stale = True  # the actor has weights the rollout workers have not got
        self.notes: list[str] = []  # the config checks' lines for the run log (start_workers fills them)

    def _join_actor_ranks(self) -> str:
        """Several actor ranks: one process group, data-parallel as ``placement.data_parallel``
        says; returns the strategy they train with."""
        import ray

        if len(self.actor) == 1:
            return "single"
        address = ray.get(self.actor.workers[0].group_address.remote())
        placement = self.cfg.placement
        return self.actor.call("join_data_parallel", address, placement.data_parallel,
                               placement.fsdp_from_parameters)[0]

    # -- weights and turns ------------------------------------------------------------
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
            self.weight_sync.publish()
            self._weights_stale = False
        t1 = time.perf_counter()
        switch = self.switcher.turn("generate")
        t2 = time.perf_counter()
        self.weight_sync.receive()
        return {"weight_sync_s": (t1 - t0) + (time.perf_counter() - t2), **switch}

    # -- one iteration -------------------------------------------------------------------
    def rollout_steps(self, num_steps: int, iteration: int = 0) -> tuple[list[dict], list, dict]:
        """Collect ``num_steps`` per env (``iteration``: whose rollout noise to draw, so a redone
        iteration samples as the first try did). Returns (finished episodes, trajectory refs, stage times)."""
        return self.finish_rollout(self.start_rollout(num_steps, iteration))

    def start_rollout(self, num_steps: int, iteration: int = 0) -> RolloutCall:
        """Start :meth:`rollout_steps`'s collection and return at once (asynchronous collection:
        the envs step while the actor updates); :meth:`finish_rollout` waits for it."""
        env_refs = self.env.call_async("interact", num_steps, self.channel)
        trajectory_refs = self.rollout.call_async("collect", num_steps, self.channel, iteration)
        return RolloutCall(env_refs, trajectory_refs, time.perf_counter())

    def finish_rollout(self, call: RolloutCall) -> tuple[list[dict], list, dict]:
        """Wait for a started rollout; returns what :meth:`rollout_steps` does."""
        # the trajectories stay in the object store (they go to the actor, never via the driver)
        everything = self.watchdog.get(call.env_refs + call.trajectory_refs, "rollout", fetch=False,
                                       inspect=call.env_refs)
        env_out = everything[:len(call.env_refs)]
        rollout_times = self.rollout.call("last_times")
        times = {
            "rollout_s": time.perf_counter() - call.started,
            "env_sim_s": max(out.sim_s for out in env_out),
            "env_step_s": max(out.step_s for out in env_out),
            "env_wait_s": max(out.wait_s for out in env_out),
            "infer_s": max(t["infer_s"] for t in rollout_times),
            "infer_wait_s": max(t["wait_s"] for t in rollout_times),
        }
        return [row for out in env_out for row in out.episodes], call.trajectory_refs, times

    def update(self, trajectory_refs: list, iteration: int = 0) -> tuple[dict, dict]:
        """Give the devices to the actor and run the algorithm's update of training ``iteration``.
        Returns (stats, timings)."""
        switch = self.switcher.turn("train")
        t0 = time.perf_counter()
        # trajectories go rollout -> actor through the object store, never via the driver; each
        # actor rank reads the rollout workers' trajectories that hold its envs
        shares = [(envs, *(trajectory_refs[k] for k in ranks)) for ranks, envs in self.actor_shares]
        stats = self.actor.call("update", per_rank_args=shares, iteration=iteration)[0]
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
    def recover(self, failure: WorkerFailure) -> list[WorkerFault]:
        """Replace the workers ``failure`` names and end the call they broke: the channel is
        renewed (survivors blocked on it raise and go idle; one still busy after
        ``runner.recovery_settle_s`` is hung too), env and rollout ranks are replaced one by one,
        the actor group as a whole (its ranks share a process group), and weights are re-shared.
        Returns every fault handled (``failure.faults`` plus survivors found stuck). The caller
        restores the actor's state (a new actor group holds its initial weights) and resets the envs."""
        settle_s = self.cfg.runner.recovery_settle_s
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
        if "rollout" in lost and self.weight_sync.fixed_membership:
            self._restart_sync_peers(actor_lost="actor" in lost)
        elif "actor" in lost:
            self.actor.restart()
            self.data_parallel = self._join_actor_ranks()
        if lost & {"rollout", "actor"}:
            self.weight_sync.setup()
            self._weights_stale = True
        self.switcher.workers_replaced()
        return faults

    def _restart_sync_peers(self, actor_lost: bool) -> None:
        """A weight sync of fixed membership (a broadcast group) cannot take a new member: restart
        every rollout worker and the actor, which keeps its state when it is alive."""
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


def start_workers(cfg: TrainConfig, rollout_only: bool = False) -> Workers:
    """Check ``cfg`` (bad names and placements fail here, in seconds, before any worker starts),
    start or join the Ray cluster, choose the placement (``placement.mode=auto``: profile, or
    read the cached profile, plan, and write the chosen placement into ``cfg.placement``), then
    start the worker groups. ``rollout_only``: they will only roll out (auto placement's probes),
    so the algorithm's update rules are not checked."""
    notes = check_run_config(cfg, rollout_only)
    for line in notes:  # what a checkpoint left to the config (e.g. its normalisation), before anything starts
        print(f"note: {line}", file=sys.stderr)
    check_memory(cfg, rollout_only, say=lambda line: _say(f"start-up: {line}"))  # a run that cannot fit: refused now
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


def _start_rollout_workers(cfg: TrainConfig) -> Workers:
    return start_workers(cfg, rollout_only=True)


# what placement.mode=auto profiles: rollouts on these workers, the run's algorithm's update
STAGE_RUNNERS = StageRunners(start_workers=_start_rollout_workers, algorithm=make_algorithm)

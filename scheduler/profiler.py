"""Profiler: run each stage on this machine at a few batch sizes, fit cost curves, cache them.

On the real env and rollout workers, three short rollouts: taking turns with env on one
device and rollout and actor on another (all on one where there is only one), then
pipelined in two micro-batches, then colocated on two devices (two env and two rollout
workers, every device busy). They give:

- ``env_step``: one step (decision) of ``n`` and of ``n / 2`` envs, as the env worker times it;
- ``hop``, ``message`` and ``shared_message``: what a step costs beyond stepping and
  inferring: a lone message's round trip through the channel, and each further message of
  a step (with a device free to absorb Ray's work, and with none), with the rollout's start
  and collection spread over its steps. Ray's calls cost CPU time the stages then lack,
  which an in-process ``ray.put`` / ``ray.get`` misses by a factor of five on a small CPU
  machine;
- ``weight_sync``: the actor publishing its weights and the rollout workers loading them;
- the env worker's memory and a batch of real observations.

In this process, on one device (the first GPU, or CPU threads as the workers use them),
on those observations:

- ``infer``: the policy's ``act`` on ``n`` observations (CPU: ``placement.torch_threads``
  threads, as a rollout worker on its slot);
- ``train``: one update of the run's algorithm (a steady-state iteration's) over ``n`` samples
  (CPU: as many threads as the actor updates on, ``placement.actor_threads`` when the other
  groups wait and leave it every core, ``placement.torch_threads`` under asynchronous
  collection), and the actor's memory: weights, gradients, Adam's moments, the update's
  activations and what the algorithm keeps beside them (a replay buffer, at its full size);
- ``offload``: the actor's weights and optimizer state off the device and back;
- ``allreduce`` (two devices or more): two actor ranks, Ray actors in a real process group
  (NCCL or gloo), all-reducing a tiny buffer and one of the policy's gradient size: what a
  data-parallel gradient step adds.

Times are medians of ``repeats``; memory is the resident-set (CPU) or allocated-memory
(GPU) growth while a stage's objects are alive. Each stage's points are fitted with
:meth:`~scheduler.cost_model.Curve.fit`. A profile is cached as JSON under
``profile_dir``, keyed by the hardware and every config field that changes a stage's cost,
so a second run with the same setup reads it instead of measuring.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from envs.messages import Trajectory
from policies.registry import make_policy
from scheduler.cost_model import Candidate, Curve, Profile
from scheduler.placement import actor_update_threads, to_placement
from scheduler.runtime.data_parallel import AllReduceProbe
from scheduler.runtime.offload import DeviceState
from scheduler.runtime.worker import resident_mib

PROFILE_VERSION = 12


class ProfiledAlgorithm(Protocol):
    """What the profiler needs of the run's algorithm (``embodied.algorithms.base.Algorithm``)."""

    def make_optimizer(self, policy: torch.nn.Module) -> torch.optim.Optimizer: ...

    def profiled_update(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        batch: Trajectory) -> dict: ...

    def resident_mib(self, obs_spec: dict, action_dim: int) -> float: ...


@dataclass(frozen=True)
class StageRunners:
    """What the profiler runs, handed down by the trainer (``embodied/``, a layer above):
    the scheduler measures the trainer's own stages without importing it.

    - ``start_workers(cfg)``: the trainer's worker groups, placed as ``cfg.placement`` says, for
      rollouts only (``embodied.runner.start_workers``; the profiler calls ``reset_envs``,
      ``rollout_steps``, ``prepare_generation``, ``env``, ``action_dim``, ``max_episode_steps`` and
      ``shutdown``);
    - ``algorithm(algorithm_cfg)``: the run's algorithm (``embodied.algorithms.registry.make_algorithm``),
      whose optimizer and steady-state update the profiler times on a trajectory batch.
    """

    start_workers: Callable
    algorithm: Callable[..., ProfiledAlgorithm]


def hardware() -> dict:
    """What the profile's numbers depend on about this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "torch": torch.__version__}


def profile_key(cfg, sizes: list[int]) -> str:
    """A stable hash of the hardware and the config that a stage's cost depends on."""
    relevant = {
        "version": PROFILE_VERSION, "hardware": hardware(), "sizes": sizes,
        # deadlines do not change what a stage costs: changing one must not throw a profile away
        "env": dataclasses.asdict(cfg.env) | {"num_envs": None, "num_procs": None, "timeout_s": None,
                                              "startup_timeout_s": None},
        "policy": dataclasses.asdict(cfg.policy),
        "algorithm": {k: getattr(cfg.algorithm, k) for k in ("name", "update_epochs", "num_minibatches",
                                                               "logprob_level")},
        "sac": dataclasses.asdict(cfg.algorithm.sac),  # its gradient steps per transition and their size
        "threads": [cfg.placement.torch_threads, actor_update_threads(cfg)],
    }
    return hashlib.sha1(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _median_seconds(fn: Callable[[], object], repeats: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()  # first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) / 2**20
    return resident_mib()


def _device_memory_mib(device: torch.device, devices: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    import psutil

    return psutil.virtual_memory().total / 2**20 / max(devices, 1)  # CPU slots share host memory


def _batch(obs: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """``n`` observations from a recorded batch, repeated as needed."""
    index = torch.arange(n) % next(iter(obs.values())).shape[0]
    return {k: v[index] for k, v in obs.items()}


def measure_policy(cfg, obs: dict, action_dim: int, sizes: list[int], train_sizes: list[int], repeats: int,
                   device: torch.device, algorithm: ProfiledAlgorithm) -> dict:
    """Inference, training and offload costs of ``cfg.policy`` under ``algorithm`` (built on
    ``cfg.algorithm`` by :attr:`StageRunners.algorithm`)."""

    obs_spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in obs.items()}
    torch.manual_seed(0)
    base = _memory_mib(device)
    policy = make_policy(cfg.policy, obs_spec, action_dim).to(device)
    weights_mib = _memory_mib(device) - base
    infer_t, infer_m = [], []
    for n in sizes:
        batch = {k: v.to(device) for k, v in _batch(obs, n).items()}
        before = _memory_mib(device)
        infer_t.append(_median_seconds(lambda b=batch: policy.act(b), repeats))
        infer_m.append(weights_mib + max(_memory_mib(device) - before, 0.0))
    optimizer = algorithm.make_optimizer(policy)
    if device.type == "cpu":  # as many threads as the actor updates on (see ActorWorker.update)
        torch.set_num_threads(actor_update_threads(cfg))
    held = algorithm.resident_mib(obs_spec, action_dim)  # a replay buffer, full
    train_t, train_m = [], []
    for i, n in enumerate(train_sizes):
        batch = _train_batch(policy, {k: v.to(device) for k, v in _batch(obs, n).items()})
        before = _memory_mib(device)
        # one warm-up, at the first size: an update is the profile's slowest stage
        train_t.append(_median_seconds(lambda b=batch: algorithm.profiled_update(policy, optimizer, b), 1, i == 0))
        # weights, gradients and Adam's moments, the buffer, the update's own growth
        train_m.append(3 * weights_mib + held + max(_memory_mib(device) - before, 0.0))
    switch = DeviceState(policy, optimizer)
    offload_s = _median_seconds(lambda: (switch.offload(), switch.onload()), repeats)
    state_mib = sum(v.nbytes for v in policy.state_dict().values()) / 2**20
    trainable = [p for p in policy.parameters() if p.requires_grad]
    return {"weights_mib": state_mib, "parameters": sum(p.numel() for p in policy.parameters()),
            "gradient_mib": sum(p.numel() * p.element_size() for p in trainable) / 2**20,
            "gradient_steps": cfg.algorithm.update_epochs * cfg.algorithm.num_minibatches,
            "infer": Curve.fit(sizes, infer_t), "rollout_memory": Curve.fit(sizes, infer_m),
            "train": Curve.fit(train_sizes, train_t), "actor_memory": Curve.fit(train_sizes, train_m),
            "offload_s": offload_s}


def _train_batch(policy, obs: dict) -> Trajectory:
    """A one-step trajectory of ``n`` envs with the policy's own samples, as rollout workers send (with
    next observations, which an off-policy algorithm's collection keeps)."""
    with torch.no_grad():
        actions, logprobs, values = policy.act(obs)
    n = actions.shape[0]
    steps = {k: v[None] for k, v in obs.items()}
    return Trajectory(obs=steps, actions=actions[None], logprobs=logprobs[None],
                      values=values[None], rewards=torch.randn(1, n), dones=torch.zeros(1, n, dtype=torch.bool),
                      next_value=torch.zeros(n), next_obs=steps, terminated=torch.zeros(1, n, dtype=torch.bool))


@dataclass
class _Probe:
    """What short rollouts on the real workers measured (see the module doc)."""

    step_s: float  # a rollout's seconds per step (its start and collection included)
    steps: int  # in each measured rollout
    env_step_s: float  # one step of one micro-batch, timed by the env worker
    weight_sync_s: float
    obs: dict  # real observations of one micro-batch
    action_dim: int
    episode_steps: int  # in decisions
    env_memory_mib: float  # the env worker's resident memory


PROBE_SECONDS = 2.0  # a probe rollout lasts about this long: enough steps for a stable median ...
PROBE_STEPS = (4, 16)  # ... within these bounds (slow steps: Ray's milliseconds matter less)


def _probe_rollout(cfg, plan: Candidate, start_workers: Callable, repeats: int = 3) -> _Probe:
    """Rollouts on real workers placed as ``plan``; the median one's seconds per step. Slow
    steps (images, large policies) get fewer steps, within ``PROBE_STEPS``. A whole rollout
    per measurement (not a line through short and long ones, whose difference doubles the
    noise), and the median of ``repeats`` (the mean of two where a rollout lasts over twice
    ``PROBE_SECONDS``): a busy moment of Ray's own processes can slow a short rollout on a
    small machine by half."""
    # the probe only rolls out (StageRunners.start_workers checks no update rule, e.g. whole episodes)
    algorithm = dataclasses.replace(cfg.algorithm, rollout_steps=max(PROBE_STEPS))
    placement = to_placement(plan, cfg.placement)
    workers = start_workers(dataclasses.replace(cfg, placement=placement, algorithm=algorithm))
    try:
        workers.reset_envs(iteration=0, sim_steps=0)
        started = time.perf_counter()
        workers.rollout_steps(2)  # pays one-time costs, and says about how long a step takes
        step_estimate = (time.perf_counter() - started) / 2
        steps = min(max(round(PROBE_SECONDS / step_estimate), PROBE_STEPS[0]), PROBE_STEPS[1])
        if steps * step_estimate > 2 * PROBE_SECONDS:  # long rollouts: a hiccup of Ray's is a small part
            repeats = min(repeats, 2)
        sync_s, env_s, step_s = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            workers.prepare_generation(force_sync=True)
            sync_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            _, _, times = workers.rollout_steps(steps)
            step_s.append((time.perf_counter() - started) / steps)
            env_s.append(times["env_step_s"] / (steps * plan.stages))
        return _Probe(statistics.median(step_s), steps, statistics.median(env_s), statistics.median(sync_s),
                      workers.env.call("observations")[0], workers.action_dim, workers.max_episode_steps,
                      workers.env.call("memory_mib")[0])
    finally:
        workers.shutdown()


def channel_costs(lockstep: _Probe, piped: _Probe | None, shared: _Probe | None, env_step: Curve, infer: Curve,
                  num_envs: int) -> dict:
    """``hop_s``, ``message_s`` and ``shared_message_s`` solved from the cost model's formulas
    for one env worker taking turns (``lockstep``), pipelined in two (``piped``), and two env
    workers colocated with two rollout workers (``shared``)."""
    hop = max(lockstep.step_s - env_step(num_envs) - infer(num_envs), 0.0)
    # what was not measured (one device, or envs that do not halve): assume half a hop
    message = hop / 2
    if piped is not None:
        half_env, half_infer = env_step(num_envs / 2), infer(num_envs / 2)
        fill = (half_env + half_infer + hop) / piped.steps  # the pipe's fill and drain, per step
        message = max(piped.step_s - fill - 2 * max(half_env, half_infer), 0.0) / 2
    shared_message = message
    if shared is not None:
        shared_message = max(shared.step_s - env_step(num_envs / 2) - infer(num_envs / 2) - hop, 0.0)
    return {"hop_s": hop, "message_s": message, "shared_message_s": shared_message}


def measure_allreduce(gradient_mib: float, device_kind: str, repeats: int = 5) -> Curve:
    """Seconds of one all-reduce between two actor ranks (two Ray actors in a real process group,
    on devices 0 and 1 of this node) for ``gradient_mib`` MiB and for a tiny buffer: the fixed
    (latency) and per-MiB terms of the gradient reduction."""
    import ray

    probe = ray.remote(AllReduceProbe)
    resources = {"num_gpus": 1} if device_kind == "gpu" else {"num_cpus": 0}
    ranks = [probe.options(**resources).remote(device_kind, 0) for _ in range(2)]
    try:
        address = ray.get(ranks[0].open.remote())
        ray.get([r.join.remote(address, i, 2) for i, r in enumerate(ranks)])
        sizes = [1 / 1024, max(gradient_mib, 1 / 512)]
        seconds = [max(ray.get([r.seconds.remote(mib, repeats) for r in ranks])) for mib in sizes]
    finally:
        for r in ranks:
            ray.kill(r)
    return Curve.fit(sizes, seconds)


def measure(cfg, sizes: list[int], devices: int, runners: StageRunners, repeats: int = 5, log=print) -> Profile:
    """Profile every stage of ``cfg`` on this machine (see the module doc), run by ``runners``."""
    started = time.perf_counter()
    n = cfg.env.num_envs
    split, halves = devices >= 2, n % 2 == 0
    start = runners.start_workers
    probes = 3 if split and halves else 1
    log(f"profile 1/{probes + 1}: a rollout of {n} envs on one env worker ...")
    lockstep = _probe_rollout(cfg, Candidate("hybrid", 1, 1, 1) if split else Candidate("colocated", 1, 1, 1), start)
    piped = shared = None
    if probes == 3:
        log(f"profile 2/{probes + 1}: the same, pipelined in two micro-batches ...")
        piped = _probe_rollout(cfg, Candidate("hybrid", 1, 1, 1, 2), start)
        log(f"profile 3/{probes + 1}: two env workers sharing a device ...")
        shared = _probe_rollout(cfg, Candidate("colocated", 2, 2, 2), start)
    log(f"profile {probes + 1}/{probes + 1}: the policy's inference and update at batch sizes {sizes} ...")
    workers_s = time.perf_counter() - started
    env_points = {n: lockstep.env_step_s} | ({n // 2: piped.env_step_s} if piped else {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.placement.torch_threads if device.type == "cpu" else threads)
    try:
        steps = cfg.algorithm.rollout_steps or lockstep.episode_steps
        policy = measure_policy(cfg, lockstep.obs, lockstep.action_dim, sizes, [k * steps for k in sizes[:2]],
                                repeats, device, runners.algorithm(cfg.algorithm))
    finally:
        torch.set_num_threads(threads)
        gc.collect()
    kind = "gpu" if device.type == "cuda" else "cpu"
    # data-parallel actor ranks need two devices; on one, the planner has no degree to choose
    allreduce = measure_allreduce(policy["gradient_mib"], kind) if split else Curve(0.0, 0.0)
    log(f"profile: rollouts on the workers {workers_s:.0f} s, policy in-process "
        f"{time.perf_counter() - started - workers_s:.0f} s")
    message = sum(v[0].nbytes for v in lockstep.obs.values()) + 4 * lockstep.action_dim * cfg.policy.chunk_size
    env_step = Curve.fit(list(env_points), list(env_points.values()))
    return Profile(env_step=env_step,
                   env_memory=Curve(0.0, lockstep.env_memory_mib / n), weight_sync_s=lockstep.weight_sync_s,
                   episode_steps=lockstep.episode_steps, message_mib_per_env=message / 2**20,  # float32 actions
                   device_kind=kind, device_memory=_device_memory_mib(device, devices), allreduce=allreduce,
                   **channel_costs(lockstep, piped, shared, env_step, policy["infer"], n), **policy)


def save(profile: Profile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(profile), indent=2))
    os.replace(tmp, path)  # atomic: a crash never leaves half a profile behind
    return path


def load(path: Path) -> Profile:
    data = json.loads(Path(path).read_text())
    curves = {k: Curve(**v) for k, v in data.items() if isinstance(v, dict)}
    return Profile(**{**data, **curves})


def cached_profile(cfg, sizes: list[int], devices: int, profile_dir: Path, runners: StageRunners,
                   log=print) -> tuple[Profile, Path, bool]:
    """The profile for ``cfg`` on this machine: read from ``profile_dir`` or measured (by ``runners``)
    and saved. Returns ``(profile, path, measured_now)``."""
    path = Path(profile_dir) / f"profile-{profile_key(cfg, sizes)}.json"
    if path.exists():
        return load(path), path, False
    started = time.perf_counter()
    profile = measure(cfg, sizes, devices, runners, log=log)
    save(profile, path)
    log(f"profiled stages at batch sizes {sizes} in {time.perf_counter() - started:.1f} s -> {path}")
    return profile, path, True

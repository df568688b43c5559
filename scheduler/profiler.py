"""Profiler: run each stage on this machine at a few batch sizes, fit cost curves, cache them.

Stages, measured in this process on one device (the first GPU, or one CPU core with one
torch thread, as a CPU slot's worker runs):

- ``env_step``: steps of ``n`` envs (the env config's backend, in-process), random actions;
- ``infer``: the policy's ``act`` on ``n`` observations recorded from the env;
- ``train``: one PPO update (the algorithm's epochs and minibatches) over ``n`` samples;
- ``weight_sync``: writing the policy's weights into a shared-memory buffer;
- ``offload``: the actor's weights and optimizer state off the device and back;
- ``hop``: one observation message and one action message through Ray's object store.

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
from pathlib import Path

import torch

from scheduler.cost_model import Curve, Profile

PROFILE_VERSION = 1


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
        "env": dataclasses.asdict(cfg.env) | {"num_envs": None, "num_procs": None},
        "policy": dataclasses.asdict(cfg.policy),
        "algorithm": {k: getattr(cfg.algorithm, k) for k in ("update_epochs", "num_minibatches", "logprob_level")},
    }
    return hashlib.sha1(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
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
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _device_memory_mib(device: torch.device, devices: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    import psutil

    return psutil.virtual_memory().total / 2**20 / max(devices, 1)  # CPU slots share host memory


def _batch(obs: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """``n`` observations from a recorded batch, repeated as needed."""
    index = torch.arange(n) % next(iter(obs.values())).shape[0]
    return {k: v[index] for k, v in obs.items()}


def measure_env(env_cfg, sizes: list[int], repeats: int, chunk: int = 1) -> tuple[Curve, Curve, dict, int, int]:
    """``(time, memory)`` curves of one decision of ``n`` envs (``chunk`` simulator steps); also
    recorded observations, the action dim and the episode length in decisions."""
    from envs.chunking import ChunkedVecEnv
    from envs.registry import make_vec_env

    times, memory, obs, action_dim, episode = [], [], None, 0, 0
    for n in sizes:
        before = _memory_mib(torch.device("cpu"))
        # in-process where the backend allows it; process-parallel backends (LIBERO) keep their processes
        env = make_vec_env(env_cfg, num_envs=n, num_procs=min(n, env_cfg.num_procs) if env_cfg.num_procs else 0)
        if chunk > 1:
            env = ChunkedVecEnv(env, chunk)
        try:
            obs, _ = env.reset(seed=0)
            action_dim, episode = env.action_dim, env.max_episode_steps
            shape = (n, chunk, action_dim) if chunk > 1 else (n, action_dim)
            actions = torch.rand(shape, generator=torch.Generator().manual_seed(n)) * 2 - 1
            times.append(_median_seconds(lambda env=env, a=actions: env.step(a), repeats))
            memory.append(_memory_mib(torch.device("cpu")) - before)
        finally:
            env.close()
    return Curve.fit(sizes, times), Curve.fit(sizes, memory), obs, action_dim, episode


def measure_policy(cfg, obs: dict, action_dim: int, sizes: list[int], train_sizes: list[int], repeats: int,
                   device: torch.device) -> dict:
    """Inference, training, weight sync and offload costs of ``cfg.policy`` under ``cfg.algorithm``."""
    from embodied.algorithms.ppo import ppo_update
    from policies.registry import make_policy
    from scheduler.offload import DeviceState
    from scheduler.weight_sync import SharedWeights, plan_layout

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
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.algorithm.lr)
    train_t, train_m = [], []
    for n in train_sizes:
        batch = _train_batch(policy, {k: v.to(device) for k, v in _batch(obs, n).items()})
        before = _memory_mib(device)
        train_t.append(_median_seconds(lambda b=batch: ppo_update(policy, optimizer, b, cfg.algorithm), 1))
        train_m.append(3 * weights_mib + max(_memory_mib(device) - before, 0.0))  # weights, grads, Adam moments
    state = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
    shared = SharedWeights(plan_layout(state))
    try:
        sync_s = _median_seconds(lambda: shared.write(state), repeats)
    finally:
        shared.unlink()
    switch = DeviceState(policy, optimizer)
    offload_s = _median_seconds(lambda: (switch.offload(), switch.onload()), repeats)
    return {"infer": Curve.fit(sizes, infer_t), "rollout_memory": Curve.fit(sizes, infer_m),
            "train": Curve.fit(train_sizes, train_t), "actor_memory": Curve.fit(train_sizes, train_m),
            "weight_sync_s": sync_s, "offload_s": offload_s}


def _train_batch(policy, obs: dict) -> dict:
    """A one-step trajectory of ``n`` envs with the policy's own samples, as rollout workers send."""
    with torch.no_grad():
        actions, logprobs, values = policy.act(obs)
    n = actions.shape[0]
    return {"obs": {k: v[None] for k, v in obs.items()}, "actions": actions[None], "logprobs": logprobs[None],
            "values": values[None], "rewards": torch.randn(1, n), "dones": torch.zeros(1, n, dtype=torch.bool),
            "next_value": torch.zeros(n)}


def measure_hop(obs: dict, repeats: int) -> float:
    """One observation batch and one action batch through Ray's object store (put + get)."""
    import ray

    actions = torch.zeros(next(iter(obs.values())).shape[0], 8)
    return _median_seconds(lambda: (ray.get(ray.put(obs)), ray.get(ray.put(actions))), repeats)


def measure(cfg, sizes: list[int], devices: int, repeats: int = 5) -> Profile:
    """Profile every stage of ``cfg`` on this machine (see the module doc)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if device.type == "cpu" else threads)
    try:
        env_time, env_memory, obs, action_dim, episode = measure_env(cfg.env, sizes, repeats, cfg.policy.chunk_size)
        steps = cfg.algorithm.rollout_steps or episode
        policy = measure_policy(cfg, obs, action_dim, sizes, [n * steps for n in sizes[:2]], repeats, device)
        hop = measure_hop(_batch(obs, max(sizes)), repeats)
    finally:
        torch.set_num_threads(threads)
        gc.collect()
    return Profile(env_step=env_time, env_memory=env_memory, hop_s=hop, episode_steps=episode,
                   device_kind="gpu" if device.type == "cuda" else "cpu",
                   device_memory=_device_memory_mib(device, devices), **policy)


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


def cached_profile(cfg, sizes: list[int], devices: int, profile_dir: Path, log=print) -> tuple[Profile, Path, bool]:
    """The profile for ``cfg`` on this machine: read from ``profile_dir`` or measured and saved.
    Returns ``(profile, path, measured_now)``."""
    path = Path(profile_dir) / f"profile-{profile_key(cfg, sizes)}.json"
    if path.exists():
        return load(path), path, False
    started = time.perf_counter()
    profile = measure(cfg, sizes, devices)
    save(profile, path)
    log(f"profiled stages at batch sizes {sizes} in {time.perf_counter() - started:.1f} s -> {path}")
    return profile, path, True

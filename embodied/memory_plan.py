"""Memory planned before any worker starts: what each worker will hold against the node's memory.

:func:`plan_memory` adds up, from the config alone (no env, policy or Ray started):

- **envs**: each env worker's sim processes and what it steps itself (``envs.registry.env_memory``: a rough
  figure per backend, measured as RSS, the basis named in the backend module);
- **the policy**: its parameters times their bytes, once per rollout worker and, with gradients and Adam's two
  moments (4x the trainable parameters' bytes), once per actor rank. Counted by building the policy on the
  ``meta`` device (no memory), or, for a checkpoint (``policy.vla.model_path``), from its safetensors headers
  (weights only: which of them train is the policy's business);
- **the algorithm**: what it keeps on the actor's device beside the policy (``Algorithm.resident_mib``: SAC's full
  replay buffer, sized from the env's observations as its backend gives them before any env starts,
  ``envs.registry.env_static_obs_spec``);
- **a rollout batch**, once on the rollout workers and once on the actor;
- **Ray and the worker processes**: :data:`RAY_BYTES` for Ray's daemons and the driver, :data:`WORKER_BYTES` per
  worker process (Python, torch and Ray imported).

Host items are compared with this machine's available memory (``psutil``); the policy's and the algorithm's
are on the GPUs when the local cluster has them, compared per GPU with its total memory. Joining a cluster
(``ray.address``), the node seen is the driver's (the head node, usually) and workers spread over the nodes:
there only a single worker that needs more than this node has is refused, the run's total is reported.

``runner.memory_check``: ``on`` refuses a run that does not fit (a UserError: exit 2, the figures and the
settings that would fit), ``warn`` says so and starts it, ``off`` skips the plan. During a run, a failed
allocation is a configuration error too (embodied/allocation.py: exit 2), never a fault to retry.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from envs.common import UserError, unknown_name_error
from envs.registry import GiB, env_action_dim, env_episode_steps, env_memory, env_static_obs_spec
from scheduler.placement import parse_devices

RAY_BYTES = 1 * GiB  # Ray's GCS and raylet, and the driver (RSS, a local cluster on one node)
WORKER_BYTES = int(0.6 * GiB)  # one worker process with Python, torch and Ray imported (RSS)
ADAM_FACTOR = 4  # a trained parameter: its value, its gradient and Adam's two moments
PLACEHOLDER_ACTION_DIM = 32  # where the env's action size is known only once it is built (a generous one)
MEMORY_CHECKS = ("on", "warn", "off")  # runner.memory_check


# -- the plan ------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """What ``workers`` workers of ``group`` hold, ``bytes_each`` each, on ``device`` ("host" or "gpu")."""

    group: str  # env | rollout | actor | ray
    what: str
    bytes_each: int
    workers: int = 1
    device: str = "host"
    # the setting value that fits when this item may take ``budget`` bytes in all (its workers together; None:
    # none fits); absent: not a setting's to change
    fit: Callable[[int], str | None] | None = None

    @property
    def total(self) -> int:
        return self.bytes_each * self.workers


@dataclass(frozen=True)
class NodeMemory:
    """The memory the plan is held against: this machine's (``available``: what allocations can get now), and
    the local cluster's GPUs (their total memory each; empty: none, or not known before joining a cluster)."""

    total: int
    available: int
    gpus: tuple[int, ...] = ()
    joined: str | None = None  # ray.address: a cluster whose other nodes this does not see

    @classmethod
    def here(cls, cfg) -> NodeMemory:
        import psutil

        memory = psutil.virtual_memory()
        return cls(memory.total, memory.available, () if cfg.ray.address else _local_gpus(cfg.ray.num_gpus),
                   cfg.ray.address)


def _local_gpus(num_gpus: int | None) -> tuple[int, ...]:
    """Total memory of each GPU a local cluster gets (``ray.num_gpus``; None: what CUDA sees)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    count = min(torch.cuda.device_count(), torch.cuda.device_count() if num_gpus is None else num_gpus)
    return tuple(torch.cuda.get_device_properties(i).total_memory for i in range(count))


@dataclass
class MemoryPlan:
    items: list[Item]
    node: NodeMemory
    placement: object  # the config's placement section: which GPUs the actor and rollout groups use
    uncounted: list[str] = field(default_factory=list)

    # -- sums --------------------------------------------------------------------------------------------
    def host_total(self) -> int:
        return sum(i.total for i in self.items if i.device == "host")

    def per_worker(self) -> dict[str, int]:
        """Host bytes of one worker of each group (the largest share: the one a joined cluster must fit)."""
        out: dict[str, int] = {}
        for item in self.items:
            if item.device == "host" and item.group != "ray":
                out[item.group] = out.get(item.group, 0) + item.bytes_each
        return out

    def gpu_needs(self) -> dict[int, int]:
        """GPU index -> bytes the actor ranks and rollout workers placed on it hold."""
        needs: dict[int, int] = {}
        for group in ("actor", "rollout"):
            devices = parse_devices(getattr(self.placement, group))
            each = sum(i.bytes_each for i in self.items if i.group == group and i.device == "gpu")
            workers = getattr(self.placement, f"{group}_workers")
            for d in devices:
                needs[d] = needs.get(d, 0) + each * math.ceil(workers / len(devices))
        return needs

    # -- verdict -------------------------------------------------------------------------------------------
    def problem(self) -> str | None:
        """One paragraph on what does not fit and the settings that would, or None."""
        node = self.node
        if node.joined is None and self.host_total() > node.available:
            return self._refusal([i for i in self.items if i.device == "host"], self.host_total(), node.available,
                                 f"this machine, which has {_gib(node.available)} available ({_gib(node.total)} in "
                                 "all)")
        if node.joined is not None:
            for group, need in self.per_worker().items():
                if need > node.available:
                    items = [i for i in self.items if i.group == group and i.device == "host"]
                    return self._refusal(items, need, node.available,
                                         f"this node (the driver's, in the cluster at {node.joined}: one {group} "
                                         f"worker runs on one node), which has {_gib(node.available)} available",
                                         per_worker=True)
        for gpu, need in sorted(self.gpu_needs().items()):
            if gpu < len(node.gpus) and need > node.gpus[gpu]:
                items = [i for i in self.items if i.device == "gpu"]
                return self._refusal(items, need, node.gpus[gpu], f"GPU {gpu}, which has {_gib(node.gpus[gpu])}")
        return None

    def _refusal(self, items: list[Item], need: int, have: int, where: str, per_worker: bool = False) -> str:
        largest = sorted(items, key=lambda i: -(i.bytes_each if per_worker else i.total))
        parts = [f"{i.what}: {_gib(i.bytes_each if per_worker else i.total)}" for i in largest[:4]]
        fits = []
        for item in largest:
            if item.fit is None:
                continue
            rest = need - (item.bytes_each if per_worker else item.total)
            value = item.fit(int(have - rest) * (item.workers if per_worker else 1))  # fit() takes the group's bytes
            if value:
                fits.append(value)
        advice = (f"Settings that would fit (each alone): {'; '.join(fits)}." if fits else
                  "No one setting of these makes it fit: shrink several.")
        return (f"This run would hold about {_gib(need)} of memory on {where}: {'; '.join(parts)}. It cannot "
                f"fit, and a failed allocation mid-run is not a fault a restart fixes. {advice} To start it anyway "
                "(the figures are estimates: embodied/memory_plan.py), set runner.memory_check=warn.")

    def summary(self) -> str:
        """One line for start-up: the total against the node, the largest items."""
        node = self.node
        top = sorted(self.items, key=lambda i: -i.total)[:3]
        parts = ", ".join(f"{i.what.split(' (')[0]} {_gib(i.total)}" for i in top)
        line = (f"memory plan: ~{_gib(self.host_total())} of this machine's {_gib(node.available)} available "
                f"({parts})")
        gpu = self.gpu_needs() if node.gpus else {}
        if gpu:
            line += "; GPU " + ", ".join(f"{d}: ~{_gib(n)} of {_gib(node.gpus[d])}" for d, n in sorted(gpu.items())
                                         if d < len(node.gpus))
        if node.joined:
            line += f" (joining {node.joined}: compared per worker with this node)"
        if self.uncounted:
            line += f"; not counted: {'; '.join(self.uncounted)}"
        return line


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def plan_memory(cfg, rollout_only: bool = False, node: NodeMemory | None = None) -> MemoryPlan:
    """What the run ``cfg`` will hold, worker by worker (module docstring). ``rollout_only``: the workers only
    roll out (auto placement's probes): no update, so no algorithm memory and no optimizer."""
    node = node or NodeMemory.here(cfg)
    env_cfg, placement = cfg.env, cfg.placement
    device = "gpu" if node.gpus else "host"
    obs_spec = env_static_obs_spec(env_cfg)
    action_dim = env_action_dim(env_cfg) or PLACEHOLDER_ACTION_DIM
    plan = MemoryPlan([Item("ray", "Ray and the driver", RAY_BYTES)], node, placement)
    workers = {"env": placement.env_workers, "rollout": placement.rollout_workers, "actor": placement.actor_workers}
    for group, count in workers.items():
        plan.items.append(Item(group, f"{group} worker processes", WORKER_BYTES, count))
    plan.items += _env_items(env_cfg, placement.env_workers)
    if obs_spec is None:
        plan.uncounted.append(f"the replay buffer and rollout batches (env.backend={env_cfg.backend} says what it "
                              "observes only once built)")
    else:
        plan.items += _batch_items(cfg, obs_spec, action_dim, device, rollout_only)
        plan.items += _policy_items(cfg, obs_spec, action_dim, device, rollout_only, plan.uncounted)
        if not rollout_only:
            plan.items += _algorithm_items(cfg, obs_spec, action_dim, device)
    return plan


def _env_items(env_cfg, env_workers: int) -> list[Item]:
    envs_each = math.ceil(env_cfg.num_envs / env_workers)
    memory = env_memory(env_cfg, envs_each, env_cfg.num_procs)
    if memory is None:
        return []

    def fit(budget: int) -> str | None:
        for total in range(env_cfg.num_envs - env_workers, 0, -env_workers):
            if env_workers * env_memory(env_cfg, math.ceil(total / env_workers), env_cfg.num_procs).total <= budget:
                return f"env.num_envs={total}"
        return None

    return [Item("env", f"{env_cfg.num_envs} {env_cfg.backend} envs ({memory.basis})", memory.total, env_workers,
                 fit=fit)]


def _torch_dtype(dtype):
    import torch

    return getattr(torch, str(dtype).removeprefix("torch."))


def _obs_bytes(obs_spec: dict) -> int:
    return sum(math.prod(shape) * _torch_dtype(dtype).itemsize for shape, dtype in obs_spec.values())


def _batch_items(cfg, obs_spec: dict, action_dim: int, device: str, rollout_only: bool) -> list[Item]:
    """One iteration's trajectories: observations (and next ones, for an off-policy algorithm), actions and a few
    floats per step (reward, done, log-prob, value, ...), on the rollout workers and again on the actor."""
    from embodied.algorithms.registry import make_algorithm

    steps = cfg.algorithm.rollout_steps or env_episode_steps(cfg.env) or 1000
    next_obs = 2 if make_algorithm(cfg.algorithm).collection.next_obs else 1
    per_step = cfg.env.num_envs * (next_obs * _obs_bytes(obs_spec) + 4 * action_dim + 32)
    what = f"rollout batch ({cfg.env.num_envs} envs x {steps} steps)"
    items = [Item("rollout", what, math.ceil(steps * per_step / cfg.placement.rollout_workers),
                  cfg.placement.rollout_workers, device)]
    if not rollout_only:
        items.append(Item("actor", what, math.ceil(steps * per_step / cfg.placement.actor_workers),
                          cfg.placement.actor_workers, device))
    return items


def _algorithm_items(cfg, obs_spec: dict, action_dim: int, device: str) -> list[Item]:
    from embodied.algorithms.registry import make_algorithm

    algorithm = make_algorithm(cfg.algorithm)
    resident = int(algorithm.resident_mib(obs_spec, action_dim) * 2**20)
    if not resident:
        return []
    # what it is and the setting that sizes it, where the algorithm says (SAC's replay buffer)
    describe = getattr(algorithm, "resident_description", None)
    fitting = getattr(algorithm, "resident_setting_that_fits", None)
    what = describe(obs_spec, action_dim) if describe else f"algorithm={cfg.algorithm.name}'s memory on the actor"
    fit = (lambda budget: fitting(obs_spec, action_dim, budget)) if fitting else None
    return [Item("actor", what, resident, 1, device, fit)]


def _policy_items(cfg, obs_spec: dict, action_dim: int, device: str, rollout_only: bool,
                  uncounted: list[str]) -> list[Item]:
    counted = policy_bytes(cfg.policy, obs_spec, action_dim)
    if counted is None:
        uncounted.append(f"policy={cfg.policy.name}'s weights (not known before it is built)")
        return []
    weights, trained, how = counted
    name = f"policy={cfg.policy.name}"
    items = [Item("rollout", f"{name} weights ({how})", weights, cfg.placement.rollout_workers, device)]
    if not rollout_only:
        items.append(Item("actor", f"{name} weights, gradients and Adam moments ({how})",
                          weights + (ADAM_FACTOR - 1) * trained, cfg.placement.actor_workers, device))
    return items


def policy_bytes(policy_cfg, obs_spec: dict, action_dim: int) -> tuple[int, int, str] | None:
    """(bytes of all weights, bytes of the trained ones, how they were counted), or None where neither a
    ``meta`` build nor a checkpoint's headers say."""
    model_path = getattr(getattr(policy_cfg, "vla", None), "model_path", None)
    if model_path:
        return _checkpoint_bytes(Path(model_path), getattr(policy_cfg.vla, "dtype", None))
    import torch

    from policies.registry import make_policy

    spec = {k: (tuple(shape), _torch_dtype(dtype)) for k, (shape, dtype) in obs_spec.items()}
    try:
        with torch.device("meta"):
            policy = make_policy(policy_cfg, spec, action_dim)
    except Exception:  # a constructor that reads values (token policies' bins): none on the meta device
        return None
    params = list(policy.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return weights, trained, f"{sum(p.numel() for p in params):,} parameters"


DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _checkpoint_bytes(path: Path, run_dtype: str | None) -> tuple[int, int, str] | None:
    """The weights of a checkpoint's ``*.safetensors`` files (their headers only), in the run's dtype
    (``policy.vla.dtype``); what trains (LoRA adapters, ...) is not known here: counted as nothing."""
    files = sorted(path.rglob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    count, stored = 0, 0
    for file in files:
        with file.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                numel = math.prod(entry["shape"])
                count += numel
                stored += numel * DTYPE_BYTES.get(entry["dtype"], 4)
    each = {"float32": 4, "bfloat16": 2, "float16": 2}.get(run_dtype or "", 0)
    weights = count * each if each else stored
    return weights, 0, f"{count:,} parameters in {path.name}; its training state not counted"


# -- the check -------------------------------------------------------------------------------------------------
def check_memory(cfg, rollout_only: bool = False, node: NodeMemory | None = None,
                 say: Callable[[str], None] | None = None) -> MemoryPlan | None:
    """Plan ``cfg``'s memory (``runner.memory_check``): ``on`` raises a UserError for a run that does not fit,
    ``warn`` says so through ``say``; ``say`` gets the plan's one-line summary either way."""
    choice = cfg.runner.memory_check
    if choice not in MEMORY_CHECKS:
        raise unknown_name_error("memory check (runner.memory_check)", choice, list(MEMORY_CHECKS))
    if choice == "off":
        return None
    plan = plan_memory(cfg, rollout_only, node)
    problem = plan.problem()
    if problem and choice == "on":
        raise UserError(problem)
    if say is not None:
        say(plan.summary())
        if problem:
            say(f"memory plan: warning (runner.memory_check=warn): {problem}")
    return plan

"""Data-parallel training: ``placement.actor_workers`` actor ranks train one policy together.

Every rank holds a share of the envs of an iteration's batch (``[T, B / world]``), and the
ranks join one torch.distributed process group (NCCL between GPUs, gloo on CPU slots). Two
ways to keep their policies one (``placement.data_parallel``):

- ``replicate``: every rank holds the whole policy and optimizer (DDP's scheme); after each
  backward pass one all-reduce sums the gradients, so every rank takes the same step.
  Fastest for a small model: one collective per minibatch, no gathering of weights;
- ``fsdp``: the policy is sharded with FSDP2 (``fully_shard``): parameters, gradients and
  Adam state are split over the ranks (ZeRO-3), each transformer block gathered only while it
  runs, gradients reduce-scattered. What a 7B VLA needs: a rank holds ``1 / world`` of the
  ~16 bytes per parameter of fp32 training state;
- ``auto``: ``fsdp`` from ``placement.fsdp_from_parameters`` parameters on, else ``replicate``.

The algorithm is the one rank's (``embodied/algorithms/ppo.py``): the ranks exchange their
samples' scalars (rewards, values, log-probs...) so that each computes the advantages and
draws the minibatches of the whole batch, and each minibatch's gradient is the sum of the
ranks' shares, weighted by how many of its samples each holds. :data:`SINGLE` is one rank:
every collective is then the identity.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from envs.common import UserError
from scheduler.runtime.weight_sync import group_address, join_process_group

STRATEGIES = ("auto", "replicate", "fsdp")
# auto: shard from here on (fp32 training state ~1.6 GB a replica); the default of placement.fsdp_from_parameters,
# for callers without a config
FSDP_FROM_PARAMETERS = 100_000_000


def resolve_strategy(choice: str, parameters: int, fsdp_from: int = FSDP_FROM_PARAMETERS) -> str:
    """``placement.data_parallel`` for a policy of ``parameters`` parameters: ``auto`` shards from
    ``fsdp_from`` (``placement.fsdp_from_parameters``) parameters on."""
    if choice not in STRATEGIES:
        raise UserError(f"placement.data_parallel={choice!r}: use one of {', '.join(STRATEGIES)} "
                        "(auto: replicate small policies, shard large ones with FSDP2).")
    if choice == "auto":
        return "fsdp" if parameters >= fsdp_from else "replicate"
    return choice


@dataclass
class DataParallel:
    """This rank's place among the ``world`` actor ranks, and the collectives between them."""

    rank: int = 0
    world: int = 1
    strategy: str = "replicate"  # resolved: "replicate" | "fsdp"

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp" and self.world > 1

    def env_slice(self, num_envs: int) -> slice:
        """This rank's envs of a batch of ``num_envs`` (a contiguous block)."""
        share = num_envs // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    @property
    def loss_scale(self) -> float:
        """What a rank's loss is multiplied by so that the reduced gradient is the sum of the
        ranks' (FSDP's reduce-scatter averages: gloo has no pre-multiplied sum)."""
        return float(self.world) if self.sharded else 1.0

    # -- collectives (the identity on one rank) -----------------------------------------------
    def gather_envs(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` joined along the env axis ``dim``, in rank order."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        sent = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()  # gloo gathers no bools
        parts = [torch.empty_like(sent) for _ in range(self.world)]
        dist.all_gather(parts, sent)
        return torch.cat(parts, dim=dim).to(x.dtype)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a new tensor)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        total = x.clone()
        dist.all_reduce(total)
        return total

    def sum_gradients(self, module: nn.Module) -> None:
        """Replicate: add up every rank's gradients in one all-reduce of a flat buffer (FSDP has
        reduce-scattered them in the backward pass already)."""
        if self.world == 1 or self.sharded:
            return
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        flat = self.sum(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- the policy --------------------------------------------------------------------------
    def wrap(self, policy: nn.Module) -> nn.Module:
        """Shard ``policy`` in place (fsdp): each of its ``shard_units()`` (transformer blocks),
        then the rest; FSDP gathers the root's parameters around each of its ``forward_methods`` (the
        methods its callers use instead of ``forward()``). Replicate: ``policy`` unchanged."""
        if not self.sharded:
            return policy
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for unit in policy.shard_units():
            fully_shard(unit)
        fully_shard(policy)
        for method in policy.forward_methods:
            register_fsdp_forward_method(policy, method)
        return policy

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s whole state dict on the CPU (fsdp: gathered; every rank must call)."""
        state = module.state_dict()
        if self.sharded:
            state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
        return {k: v.detach().cpu() for k, v in state.items()}

    def whole_state(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """``module``'s whole state dict on rank 0, None elsewhere. Every rank calls: FSDP
        gathers the shards (replicate ranks other than 0 copy nothing)."""
        if self.rank == 0 or self.sharded:
            state = self.full_state(module)
            return state if self.rank == 0 else None
        return None

    def load_full_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a whole (unsharded) state dict, as :meth:`full_state` returns it."""
        if not self.sharded:
            module.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state as one rank's ``optimizer.state_dict()`` would be (parameters by
        index), whatever the ranks: a checkpoint resumes on any number of them. Every rank calls;
        fsdp gathers it on rank 0 (the others get ``{}``)."""
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        named = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                     cpu_offload=True))
        return _by_index(named, optimizer, module) if self.rank == 0 else {}  # gathered on rank 0 only

    def load_full_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # strict=False: a trainable parameter no loss reaches has no Adam state to load (pi0's last VLM layer
        # beyond its keys and values), as on one rank
        set_optimizer_state_dict(module, optimizer, _by_name(state, optimizer, module),
                                 options=StateDictOptions(full_state_dict=True, strict=False))


def _parameter_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """Names of the optimizer's parameters, in the order ``optimizer.state_dict()`` numbers them."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_index(named: dict, optimizer: torch.optim.Optimizer, module: nn.Module) -> dict:
    index = {name: i for i, name in enumerate(_parameter_names(optimizer, module))}
    groups = [{**g, "params": [index[name] for name in g["params"]]} for g in named["param_groups"]]
    return {"state": {index[name]: s for name, s in named["state"].items()}, "param_groups": groups}


def _by_name(state: dict, optimizer: torch.optim.Optimizer, module: nn.Module) -> dict:
    names = _parameter_names(optimizer, module)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def join_group(address: str, rank: int, world: int, device: torch.device, strategy: str) -> DataParallel:
    """Join the actor ranks' process group (every rank at once) and return this rank's place."""
    if world > 1:
        join_process_group(address, rank=rank, world_size=world, device=device)
    return DataParallel(rank, world, strategy)


SINGLE = DataParallel()


class AllReduceProbe:
    """A Ray actor the profiler starts twice to time all-reduces on a real process group
    (``scheduler/profiler.py``): the cost model's data-parallel gradient reduction."""

    def __init__(self, device_kind: str = "cpu", local_device: int = 0):
        use_cuda = device_kind == "gpu" and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{local_device}" if use_cuda else "cpu")

    def open(self) -> str:
        return group_address()

    def join(self, address: str, rank: int, world: int) -> None:
        join_process_group(address, rank=rank, world_size=world, device=self.device)

    def seconds(self, mib: float, repeats: int) -> float:
        """The median seconds of one all-reduce of ``mib`` MiB of float32 (after one warm-up)."""
        import torch.distributed as dist

        buffer = torch.zeros(max(int(mib * 2**20 / 4), 1), device=self.device)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

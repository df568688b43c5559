"""The Policy protocol every registered policy follows, and the pieces small policies share.

A policy is an ``nn.Module`` built as ``cls(policy_cfg, obs_spec, action_dim)`` and registered
with ``@POLICIES.register(name)`` (``policies/registry.py`` builds it by name). Observations
are dicts of batched tensors (``obs_spec``: name -> (shape without the batch, dtype)).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributions import Normal

from envs.common import Registry, UserError, unknown_name_error

# each policy's module, imported when a run asks for it: a run imports its own family only
POLICIES = Registry("policy (policy.name / policy=...)", modules={
    "mlp": "policies.mlp", "mlp_tokens": "policies.mlp_tokens", "mlp_flow": "policies.mlp_flow",
    "mlp_sac": "policies.mlp_sac", "cnn": "policies.cnn", "random": "policies.random",
    "openvla": "policies.vla.policy", "openvla_oft": "policies.vla.oft", "qwen_vl": "policies.vla.qwen_vl",
    "pi0": "policies.pi0.policy",
})


class Policy(nn.Module):
    """What the workers call on a policy (as ``envs/base.py``'s ``VecEnv`` is what they call on
    an env). ``B`` is the batch, ``A`` the action size (``A = chunk_size * action_dim`` for a
    chunking policy, whose env steps each chunk in turn).

    - ``act(obs, deterministic=False, noise=None)`` -> ``(actions [B, A], log_prob [B],
      value [B])``, without gradients. ``noise [B, noise_dim]`` is the sample's randomness
      (standard normal; token policies map it to a uniform through the normal CDF themselves),
      so a caller makes sampling independent of how a batch is split; None draws it.
    - ``evaluate(obs, actions [B, A])`` -> ``(log_prob [B], entropy [B], value [B])`` with
      gradients (what PPO trains on).
    - ``value(obs)`` -> ``[B]``.
    - ``to_env(actions [B, A], obs)`` -> what the env is sent (a clipped box, un-normalised bins, a
      family's gripper steps; ``obs``, what the actions were chosen on, for actions relative to the state).
    - ``weights_updated()``: called by the rollout worker after each weight sync.
    - ``demo_loss(obs, targets [B, chunk_size, action_dim])`` -> ``{statistic: scalar}`` of
      ``demo_statistics``, ``"loss"`` with gradients: what ``embodied sft`` minimises on demos
      (token policies: cross-entropy over the targets' action tokens).

    What the trainer reads off the class, instead of probing with ``hasattr``:
    """

    # the family's config sections (policy.net, policy.vla, ...: embodied/policy_config.py): the policy reads
    # policy.name, chunk_size, temperature and these; setting keys of a section it does not read is refused
    config_sections: tuple[str, ...] = ("net",)
    chunks: bool = False  # can act in chunks (policy.chunk_size > 1)
    trainable: bool = True  # False: a baseline for `embodied eval` only (policy=random)
    token_actions: bool = False  # emits action tokens (bin_distributions)
    # what demo_loss reports, "loss" first; empty: `embodied sft` cannot train this policy
    demo_statistics: tuple[str, ...] = ()
    critic_modules: tuple[str, ...] = ("critic",)  # the value function's own modules (critic warm-up)
    # methods the workers call instead of forward(): a sharded (FSDP) policy gathers its parameters around each
    forward_methods: tuple[str, ...] = ("act", "evaluate", "value")
    noise_dim: int  # randomness per sample that act() consumes
    # where its checkpoints come from (said when policy.vla.model_path is not one): a Hugging Face id, or words
    hub_id: str | None = None
    checkpoint_sources: str = ""

    @classmethod
    def check_config(cls, cfg, action_dim: int | None) -> list[str]:
        """Raise a UserError for what is wrong with ``cfg`` before any worker starts (a checkpoint's
        missing files, statistics of another action size); ``action_dim`` is the env's, or None.
        Returns lines for the run log about what was chosen (none by default)."""
        return []

    @classmethod
    def resolve_settings(cls, cfg) -> None:
        """Fill, in place, the settings ``cfg`` leaves null to mean "the checkpoint's" or "the family's own"
        (here ``policy.chunk_size``: 1; a VLA's ``policy.vla.dtype``: float32). Runs whenever a config is composed
        or loaded, so every reader sees values; a checkpoint that cannot be read is left for :meth:`check_config`
        to refuse."""
        if cfg.chunk_size is None:
            cfg.chunk_size = 1
        if "vla" in cls.config_sections and cfg.vla.dtype is None:
            cfg.vla.dtype = "float32"

    @classmethod
    def checkpoint_settings(cls, cfg) -> dict[str, dict]:
        """What the checkpoint at ``policy.vla.model_path`` records of the settings its actions depend on:
        ``{setting: {"value": the run's, "checkpoint": the checkpoint's, "field": where it records it}}`` (for the
        run log and eval.json's provenance; a value unlike the checkpoint's is the user's override). None here."""
        return {}

    @classmethod
    def check_observations(cls, cfg, obs_spec: dict, action_dim: int) -> None:
        """Raise a UserError if this policy cannot act on the env's observations (``obs_spec``, known
        once the env workers report it: checked there, before any policy worker starts)."""

    @staticmethod
    def untrainable_reason(cfg) -> str | None:
        """Why ``embodied train`` cannot train this config (one paragraph), or None."""
        return None

    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        raise NotImplementedError

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        raise NotImplementedError

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def to_env(self, actions: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        return actions

    def weights_updated(self) -> None:
        """Nothing to refresh by default (a vLLM engine reloads its weights here)."""

    def shard_units(self) -> list[nn.Module]:
        """The blocks FSDP2 shards one by one (``placement.data_parallel=fsdp``), each gathered only
        while it runs; the rest of the policy is one more unit. Default: none besides the whole."""
        return []

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU}


ROW_TILE = 32  # rows per product on the batch-invariant path of :class:`Linear`
# products' columns are rounded up to a multiple of this: narrower products (a value head's 1 column)
# take BLAS paths where a row's result depends on its place in the tile
MIN_COLUMNS = 16
IMAGE_TILE = 16  # images per convolution on the batch-invariant path of :class:`Conv2d`


def _fixed_tiles(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` (``[N, ...]``) zero-padded to a whole number of tiles: ``[ceil(N / size) * size, ...]``."""
    pad = -x.shape[0] % size
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


class Linear(nn.Linear):
    """``nn.Linear`` that can compute each output row exactly as a batch of one would.

    BLAS picks different kernels (so different summation orders) for different batch
    sizes, so ``linear(x)[i]`` can differ in the last bit from ``linear(x[i:i+1])``.
    Rollout workers turn ``batch_invariant`` on (see :func:`set_batch_invariant`) so a
    pipelined rollout, which infers on micro-batches, gives the serial run's actions
    bit for bit. Training keeps the fast path. State-dict names are nn.Linear's.

    The invariant path cuts the rows into tiles of :data:`ROW_TILE` (the last zero-padded)
    and multiplies them in one batched product of ``[ROW_TILE, in] @ [in, out']``
    (``out`` rounded up to a multiple of :data:`MIN_COLUMNS` with zero columns): every product has the same
    shape whatever the batch, and a row's result does not depend on its place in the tile
    (tests/test_policies.py checks both over a grid of shapes and thread counts), at about
    the speed of one plain product (one product per row was 2-6x slower).
    """

    batch_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)
        tiles = _fixed_tiles(rows, ROW_TILE).view(-1, ROW_TILE, self.in_features)
        weight = _fixed_tiles(self.weight, MIN_COLUMNS)
        bias = _fixed_tiles(self.bias, MIN_COLUMNS) if self.bias is not None else weight.new_zeros(len(weight))
        n = tiles.shape[0]
        out = torch.baddbmm(bias.expand(n, ROW_TILE, -1), tiles, weight.t().expand(n, -1, -1))
        # contiguous: a pointwise op after a strided slice takes other vector paths (last bits differ)
        out = out.reshape(-1, weight.shape[0])[:rows.shape[0], :self.out_features].contiguous()
        return out.reshape(*x.shape[:-1], self.out_features)


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` with the same batch-invariant option as :class:`Linear`: oneDNN picks its
    algorithm by the whole input's shape (a batch of one can get another one), so the invariant
    path runs the convolution on tiles of :data:`IMAGE_TILE` images (the last zero-padded), one
    shape whatever the batch; within a tile each image's result does not depend on its place."""

    batch_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().forward(x)
        tiles = _fixed_tiles(x, IMAGE_TILE).split(IMAGE_TILE)
        return torch.cat([super(Conv2d, self).forward(tile) for tile in tiles])[:x.shape[0]]


SIMD_BLOCK = 64  # elements: a whole number of CPU vector-loop iterations for float and double


def rowwise_exact(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a pointwise ``fn`` (log, sigmoid, sin, ...), with each element's result
    independent of the tensor's size.

    ATen's CPU kernels run the vector loop over whole vectors and a scalar loop over the last
    few elements, and the two differ in the last bit for transcendental functions; so a row of
    a ``[1, 8]`` tensor (all tail) could differ from the same row of ``[16, 8]`` (all vector).
    Padding the flattened tensor to a multiple of :data:`SIMD_BLOCK` puts every element through
    the vector loop. Exact for tensors under ATen's parallel grain (32768 elements); costs a copy.
    """
    flat = x.reshape(-1)
    pad = -flat.numel() % SIMD_BLOCK
    if pad == 0 or x.device.type != "cpu":
        return fn(x)
    return fn(torch.cat([flat, flat.new_ones(pad)]))[:flat.numel()].view(x.shape)


def get_setting(cfg, key: str):
    """``get_setting(policy_cfg, "flow.eval_steps")`` -> ``policy_cfg.flow.eval_steps``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def set_setting(cfg, key: str, value) -> None:
    """``set_setting(policy_cfg, "flow.eval_steps", 4)``: the setting in place."""
    *parents, last = key.split(".")
    for part in parents:
        cfg = getattr(cfg, part)
    setattr(cfg, last, value)


# the defaults of keys that are now null ("the checkpoint's"), which configs saved before then still carry (a run's
# config.yaml, a checkpoint's config_yaml, the shipped warm starts): not a setting anybody made
FORMER_DEFAULTS = {"vla.dtype": "float32", "vla.image_size": 64}


def changed_settings(section, name: str, skip: tuple[str, ...] = ()) -> list[str]:
    """``policy.<name>.<key>=<value>`` for each key of the config ``section`` (a dataclass) set to other than
    its default (or its :data:`FORMER_DEFAULTS` value), leaving out the keys in ``skip``: settings a policy does not
    read are refused with these."""
    default = type(section)()
    return [f"policy.{name}.{key.name}={value}" for key in dataclasses.fields(section) if key.name not in skip
            and (value := getattr(section, key.name)) != getattr(default, key.name)
            and (f"{name}.{key.name}" not in FORMER_DEFAULTS or value != FORMER_DEFAULTS[f"{name}.{key.name}"])]


def set_batch_invariant(module: nn.Module, enabled: bool = True) -> None:
    """Switch every :class:`Linear` and :class:`Conv2d` in ``module`` to (or from) the
    batch-invariant path."""
    for layer in module.modules():
        if isinstance(layer, (Linear, Conv2d)):
            layer.batch_invariant = enabled


def layer_init(layer: nn.Linear | nn.Conv2d, gain: float = math.sqrt(2)) -> nn.Module:
    """Orthogonal weights, zero bias: the PPO default that keeps early updates stable."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def mlp(sizes: list[int], activation: str, out_gain: float | None = None) -> nn.Sequential:
    """Linear layers of ``sizes`` with activations between; last layer gets ``out_gain``."""
    if activation not in ACTIVATIONS:
        raise unknown_name_error("activation (policy.net.activation)", activation, list(ACTIVATIONS))
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        last = i == len(sizes) - 2
        layers.append(layer_init(Linear(a, b), out_gain if last and out_gain is not None else math.sqrt(2)))
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


VECTOR_KEYS = ("state", "task")  # flat float observations a policy concatenates (task: one-hot)


def vector_dim(obs_spec: dict) -> int:
    """Width of :func:`vector_obs` for observations ``obs_spec`` (0 if it has none)."""
    return sum(obs_spec[k][0][0] for k in VECTOR_KEYS if k in obs_spec)


def vector_obs(obs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``state`` (and ``task``, the one-hot task of a multi-task suite) as one ``[B, D]`` tensor."""
    return torch.cat([obs[k].float() for k in VECTOR_KEYS if k in obs], dim=-1)


class GaussianActorCritic(Policy):
    """A Gaussian actor-critic: subclasses define ``actor_mean(obs)`` and ``value(obs)``."""

    def __init__(self, action_dim: int, log_std_init: float):
        super().__init__()
        self.action_dim = action_dim
        self.noise_dim = action_dim  # standard-normal draws per sample (see act)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))

    def actor_mean(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def heads(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action mean [B, A], value [B])``; subclasses with a shared encoder run it once."""
        return self.actor_mean(obs), self.value(obs)

    def distribution(self, obs: dict[str, torch.Tensor]) -> Normal:
        mean = self.actor_mean(obs)
        return Normal(mean, self.log_std.expand_as(mean).exp())

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False,
            noise: torch.Tensor | None = None):
        """Sample ``mean + std * noise``; ``noise [B, A]`` defaults to fresh ``randn``.

        Passing the noise lets a caller make sampling independent of how a batch is split.
        """
        mean, value = self.heads(obs)
        std = self.log_std.expand_as(mean).exp()
        if deterministic:
            actions = mean
        else:
            actions = mean + std * (torch.randn_like(mean) if noise is None else noise.to(mean.device))
        return actions, Normal(mean, std).log_prob(actions).sum(-1), value

    def to_env(self, actions: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The env's action for a sample: clipped to the [-1, 1] box (the unclipped one is scored)."""
        return actions.clamp(-1.0, 1.0)

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        dist = self.distribution(obs)
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.value(obs)


def require_model_dir(path: str, hub_id: str | None = None, where: str = "") -> None:
    """A clear error for a ``policy.vla.model_path`` that is not a saved model directory: how to fetch
    ``hub_id`` (a Hugging Face id), or ``where`` the policy's checkpoints come from."""
    if not (Path(path) / "config.json").exists():
        fetch = (f"fetch {hub_id} on a machine with internet (`huggingface-cli download {hub_id} --local-dir {path}`)"
                 if hub_id else "fetch the model on a machine with internet")
        raise UserError(f"policy.vla.model_path={path} is not a model directory (no config.json there). Nothing is "
                        f"downloaded at run time: {fetch}, copy it here, or use a *_tiny policy config.{where}")

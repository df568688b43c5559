"""OpenVLA-OFT: OpenVLA with parallel decoding of an action chunk in one forward pass.

After the prompt come ``T = chunk_size * A`` placeholder tokens whose input embeddings are
zero (OFT's "empty action embeddings") and, with ``policy.vla.stop_token`` (OFT's own layout and
SimpleVLA-RL's; RLinf drops it), the real STOP token ``</s>``. Attention is **bidirectional**
(every token sees every non-padding token), as OFT's transformers fork makes Llama's SDPA
attention. The hidden states from the last prompt token through placeholder ``T - 2`` (OFT's
``NUM_PATCHES + NUM_PROMPT_TOKENS`` slice) predict the ``T`` action tokens:

- **token OFT** (the layout RLinf and SimpleVLA-RL train with RL): their LM-head logits over the
  256 action bins, so sampling all ``T`` tokens and the teacher-forced log-probs PPO needs come
  from one pass;
- **L1 OFT** (moojink/openvla-oft's public LIBERO checkpoints, which ship an
  ``action_head--*_checkpoint.pt``): OFT's MLP-ResNet head regresses the normalised chunk from
  them. It has no probabilities, so it acts for ``eval`` and ``record`` but cannot be trained with RL.

With ``policy.vla.proprio`` the env's ``state`` becomes one more token after the image patches, through
OFT's ``proprio_projector`` (fc1, GELU, fc2), normalised as OFT's ``normalize_proprio`` does when
the checkpoint's ``dataset_statistics.json`` has proprio statistics: the dimensions in their
``mask`` rescaled by q01 / q99 (or min / max: ``policy.vla.normalization=bounds``, OFT's ALOHA
constants), the others left as they are, then everything clipped to [-1, 1]. The action chunk
(``policy.chunk_size`` x the env's action size) and the cameras are the config's: upstream's
checkpoints do not record them (its ``constants.py`` picks them per robot platform).

Sequence: ``[BOS] + patches (per camera) (+ proprio) + prompt[1:] + T placeholders (+ STOP)``.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from envs.common import UserError
from policies.base import POLICIES
from policies.token_actions import ParallelTokenPolicy
from policies.vla.action_tokenizer import ActionStats
from policies.vla.checkpoint import NORMALIZATION_NAMES
from policies.vla.policy import OpenVLACheckpoint, OpenVLAPolicy

STOP_TOKEN_ID = 2  # Llama's </s>: OFT's STOP_INDEX
LEGACY_PROPRIO_FILE = "proprio_projector.pt"  # what this project saved before


class ProprioProjector(nn.Module):
    """OFT's proprioception projector: ``[B, D] -> [B, H]`` (state-dict names fc1 / fc2)."""

    def __init__(self, state_dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act_fn1, self.fc2 = nn.Linear(state_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn1(self.fc1(state)))


class ResidualBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    """LayerNorm, fc1, ReLU, residual blocks, LayerNorm, fc2 (OFT's ``MLPResNet`` state-dict names)."""

    def __init__(self, blocks: int, input_dim: int, hidden: int, output_dim: int):
        super().__init__()
        self.layer_norm1, self.fc1, self.relu = nn.LayerNorm(input_dim), nn.Linear(input_dim, hidden), nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(ResidualBlock(hidden) for _ in range(blocks))
        self.layer_norm2, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """OFT's continuous head: hidden states ``[B, chunk * A, H]`` -> normalised actions ``[B, chunk, A]``."""

    def __init__(self, hidden: int, action_dim: int):
        super().__init__()
        self.model = MLPResNet(2, hidden * action_dim, hidden, action_dim)

    def forward(self, hidden_states: torch.Tensor, chunk: int) -> torch.Tensor:
        return self.model(hidden_states.reshape(hidden_states.shape[0], chunk, -1))


def component_file(model_dir: str | Path, name: str) -> Path | None:
    """OFT's ``find_checkpoint_file``: the one ``{name}--*checkpoint.pt`` in ``model_dir`` (None if none)."""
    matches = sorted(p for p in Path(model_dir).glob(f"{name}*checkpoint.pt"))
    if len(matches) > 1:
        raise UserError(f"{model_dir} holds {len(matches)} {name} files ({[p.name for p in matches]}); OFT's loader "
                        "takes exactly one. Keep the one from the training step you evaluate.")
    return matches[0] if matches else None


def load_component(module: nn.Module, path: Path) -> None:
    """A component saved by OFT's DDP training (``module.`` prefixed keys) or by this project."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise UserError(f"{path} does not fit this model ({str(err).splitlines()[0]}): it belongs to a checkpoint "
                        "of another size. Copy the component files of the same checkpoint as config.json.") from err


# component files of OFT variants this project does not implement -> what they are (refused up front)
UNSUPPORTED_COMPONENTS = {
    "noisy_action_projector": "a diffusion action head (OFT's use_diffusion)",
    "vision_backbone": "a FiLM-conditioned vision backbone (OFT's use_film)",
}


def component_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name (``module.`` stripped) -> shape of a component file, without reading its data
    (memory-mapped: a 7B OFT's action head is ~0.5 GB)."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file in torch's legacy format cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        said = " ".join(str(err).split()[:12])  # torch's advice on weights_only runs for lines: its start says it
        raise UserError(f"{path} does not read as a torch checkpoint ({type(err).__name__}: {said} ...): it is "
                        "truncated or damaged. Download it again with the rest of the checkpoint, or copy it again "
                        "from where the checkpoint was saved.") from None
    return {k.removeprefix("module."): tuple(v.shape) for k, v in state.items()}


@dataclass(frozen=True)
class OFTCheckpoint(OpenVLACheckpoint):
    """An OFT directory: the OpenVLA files, and OFT's component files and proprio statistics."""

    action_head: Path | None = None  # action_head--*_checkpoint.pt: an L1 head; None: token actions
    proprio_projector: Path | None = None  # proprio_projector--*_checkpoint.pt (or this project's older name)
    proprio_stats: ActionStats | None = None  # under policy.vla.normalization; None: the state is fed as it is
    proprio_used: bool = False  # policy.vla.proprio

    def describe(self) -> str:
        head = f"L1 action head {self.action_head.name}" if self.action_head else "token actions (LM head)"
        if not self.proprio_used:
            unused = f" (its {self.proprio_projector.name} is unused)" if self.proprio_projector else ""
            proprio = f"no proprio (policy.vla.proprio=false){unused}"
        elif self.proprio_stats is None:
            proprio = "proprio as the env gives it (no proprio statistics)"
        else:
            mask = self.proprio_stats.normalize_mask
            kept = len(mask) - int(mask.sum())
            proprio = (f"{len(mask)}-dim proprio normalised with {NORMALIZATION_NAMES[self.normalization]}"
                       + (f" ({kept} dims left as they are by the statistics' mask)" if kept else ""))
        return f"{super().describe()}; {head}; {proprio}"


def refuse_unsupported_components(model_dir: str) -> None:
    """A UserError for component files of an OFT variant this project does not implement."""
    for name, what in UNSUPPORTED_COMPONENTS.items():
        found = sorted(Path(model_dir).glob(f"{name}*checkpoint.pt"))
        if found:
            raise UserError(f"{found[0]}: this checkpoint uses {what}, which this project does not implement "
                            "(OpenVLA-OFT's L1-regression and token checkpoints are supported: "
                            "docs/vla_checkpoints.md). Use an L1 or token OFT checkpoint.")


def proprio_projector_file(model_dir: str) -> Path | None:
    """OFT's ``proprio_projector--*_checkpoint.pt``, else the name this project saved it under before."""
    legacy = Path(model_dir) / LEGACY_PROPRIO_FILE
    return component_file(model_dir, "proprio_projector") or (legacy if legacy.exists() else None)


def check_action_head(path: Path, hidden: int, action_dim: int | None) -> None:
    """The L1 head's shapes: ``hidden * A`` in (``layer_norm1``), ``A`` out (``fc2``), ``A`` the env's."""
    shapes = component_shapes(path)
    out = shapes.get("model.fc2.weight", (None,))[0]
    width = shapes.get("model.layer_norm1.weight", (None,))[0]
    if out is None or width is None:
        raise UserError(f"{path} is not an OFT L1RegressionActionHead (no model.fc2 / model.layer_norm1; it has "
                        f"{sorted(shapes)[:6]}). Copy the action head saved with this checkpoint.")
    if width != hidden * out:
        raise UserError(f"{path} takes {width} inputs, not this model's hidden size {hidden} x {out} actions: it "
                        "belongs to a checkpoint of another size. Copy the one saved with config.json.")
    if action_dim is not None and out != action_dim:
        raise UserError(f"{path} predicts {out}-dim actions; the env's are {action_dim}-dim. The checkpoint was "
                        "trained for another robot (OFT's ALOHA checkpoints act in 14 dims, LIBERO's in 7): use an "
                        "env with its action space, or a checkpoint trained for this env.")


def check_proprio_projector(path: Path, hidden: int, stats: ActionStats | None) -> None:
    """The proprio projector's shapes: ``P`` in (``fc1``), ``hidden`` out; ``P`` the statistics' size."""
    shapes = component_shapes(path)
    fc1 = shapes.get("fc1.weight")
    if fc1 is None or fc1[0] != hidden:
        raise UserError(f"{path} is not a proprio projector of this model (fc1 {fc1}, hidden size {hidden}). Copy "
                        "the one saved with config.json.")
    if stats is not None and len(stats.low) != fc1[1]:
        raise UserError(f"{path} takes {fc1[1]}-dim proprio, but the proprio statistics are {len(stats.low)}-dim. "
                        "The component and dataset_statistics.json come from different checkpoints.")


def check_proprio_state(obs_spec: dict, saved: OFTCheckpoint | None) -> None:
    """``policy.vla.proprio=true`` needs the env's ``state``, of the size of the checkpoint's proprio statistics."""
    if "state" not in obs_spec:
        raise UserError("policy.vla.proprio=true needs a `state` observation; this env has none "
                        f"(it has {sorted(obs_spec)}). Set policy.vla.proprio=false.")
    shape = obs_spec["state"][0]  # None: the env's state size is known only once it is built
    state_dim = None if shape is None else shape[0]
    if (state_dim is not None and saved is not None and saved.proprio_stats is not None
            and len(saved.proprio_stats.low) != state_dim):
        raise UserError(f"policy.vla.proprio=true: the env's state is {state_dim}-dim, but {saved.model_dir}'s proprio "
                        f"statistics are {len(saved.proprio_stats.low)}-dim (OFT's LIBERO checkpoints take 8, its "
                        "ALOHA ones 14). Use an env whose state matches, or policy.vla.proprio=false.")


def bidirectional_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` padding mask -> additive ``[B, 1, L, L]``: every query sees every non-padding key
    (OFT's fork: the causal mask's last row for every row)."""
    blocked = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, torch.finfo(dtype).min)
    return blocked[:, None, None, :].expand(-1, 1, mask.shape[1], -1)


@POLICIES.register("openvla_oft")
class OpenVLAOFTPolicy(ParallelTokenPolicy, OpenVLAPolicy):
    """OpenVLA backbone (same checkpoint layout), parallel decoding of ``policy.chunk_size`` actions:
    sampling, log-probs and the value come from :class:`ParallelTokenPolicy` over :meth:`token_logits`."""

    normalizations = ("bounds_q99", "bounds")  # OFT's constants: q01 / q99 (LIBERO, Bridge), min / max (ALOHA)

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__(cfg, obs_spec, action_dim)
        self.stop_token = cfg.vla.stop_token
        dtype = next(self.model.parameters()).dtype
        hidden = self.model.config.text_config.hidden_size
        saved: OFTCheckpoint | None = self.checkpoint  # None: a tiny model built here
        self.action_head = None
        if saved is not None and saved.action_head is not None:
            self.action_head = L1RegressionActionHead(hidden, action_dim).to(dtype)
            load_component(self.action_head, saved.action_head)
        self.proprio_projector, self.proprio_stats = None, None
        if cfg.vla.proprio:
            check_proprio_state(obs_spec, saved)
            self.proprio_projector = ProprioProjector(obs_spec["state"][0][0], hidden).to(dtype)
            if saved is not None:
                self.proprio_stats = saved.proprio_stats
                if saved.proprio_projector is not None:
                    load_component(self.proprio_projector, saved.proprio_projector)

    @classmethod
    def check_observations(cls, cfg, obs_spec: dict, action_dim: int) -> None:
        super().check_observations(cfg, obs_spec, action_dim)
        if cfg.vla.proprio:
            check_proprio_state(obs_spec, cls.read_checkpoint(cfg, action_dim) if cfg.vla.model_path else None)

    @classmethod
    def read_checkpoint(cls, cfg, action_dim: int | None) -> OFTCheckpoint:
        """The OpenVLA files (:meth:`OpenVLAPolicy.read_checkpoint`), then OFT's: the component files
        (one of each at most, none of a variant not implemented here, each the size of this model)
        and the proprio statistics under ``policy.vla.normalization``."""
        base = super().read_checkpoint(cfg, action_dim)
        refuse_unsupported_components(cfg.vla.model_path)
        head = component_file(cfg.vla.model_path, "action_head")
        proprio_file = proprio_projector_file(cfg.vla.model_path)
        statistics = base.statistics
        proprio = statistics.bounds("proprio", cfg.vla.normalization, cfg.vla.model_path) if statistics else None
        found = OFTCheckpoint(**vars(base), action_head=head, proprio_projector=proprio_file, proprio_stats=proprio,
                              proprio_used=cfg.vla.proprio)
        hidden = base.config.text_config.hidden_size
        if head is not None:
            check_action_head(head, hidden, action_dim)
        if proprio_file is not None:
            check_proprio_projector(proprio_file, hidden, proprio)
        return found

    @staticmethod
    def untrainable_reason(cfg) -> str | None:
        """Why ``embodied train`` cannot train this checkpoint (an L1 head has no action probabilities)."""
        head = component_file(cfg.vla.model_path, "action_head") if cfg.vla.model_path else None
        if head is None:
            return None
        return (f"policy.vla.model_path={cfg.vla.model_path} is an L1-regression OpenVLA-OFT checkpoint "
                f"(it has {head.name}): "
                "its continuous action head gives no action probabilities, so PPO / GRPO cannot train it; it acts "
                "for `embodied eval` and `embodied record`. RL starts from a token OFT checkpoint: the same "
                "directory layout without action_head--*.pt, trained to predict the 256 action tokens with the "
                "LM head (SimpleVLA-RL's Haozhan72/Openvla-oft-SFT-* or RLinf's RLinf/RLinf-OpenVLAOFT-*; "
                "docs/vla_checkpoints.md).")

    def _proprio(self, state: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` -> the projector's input: OFT's ``normalize_proprio`` with the checkpoint's
        statistics (masked dimensions as they are, then all clipped), in float64 as upstream's numpy."""
        if self.proprio_stats is None:
            return state
        return self.proprio_stats.normalize(state.double())

    def _forward(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass -> ``(logits [B, T, V], hidden [B, T, H], value [B])`` at the positions that
        predict the ``T`` action tokens (the last prompt token through placeholder ``T - 2``)."""
        ids, mask = self._prompt_ids(obs)
        device = ids.device
        batch, tokens = ids.shape[0], self.noise_dim
        embeds, mask = self.model.multimodal_embeddings(ids, self._pixel_values(obs, device), mask)
        if self.proprio_projector is not None:
            after_patches = 1 + self.model.num_patches * len(self.cameras)
            state = self._proprio(obs["state"].to(device)).to(embeds.dtype)
            token = self.proprio_projector(state).unsqueeze(1)
            embeds = torch.cat([embeds[:, :after_patches], token, embeds[:, after_patches:]], dim=1)
            mask = torch.cat([mask[:, :after_patches], mask.new_ones(batch, 1), mask[:, after_patches:]], dim=1)
        tail = [embeds.new_zeros(batch, tokens, embeds.shape[-1])]
        if self.stop_token:
            stop = torch.full((batch, 1), STOP_TOKEN_ID, dtype=torch.long, device=device)
            tail.append(self.model.get_input_embeddings()(stop))
        embeds = torch.cat([embeds, *tail], dim=1)
        mask = torch.cat([mask, mask.new_ones(batch, embeds.shape[1] - mask.shape[1])], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding skipped: positions as if unpadded
        out = self.model.language_model(inputs_embeds=embeds, attention_mask=bidirectional_mask(mask, embeds.dtype),
                                        position_ids=positions, output_hidden_states=True)
        end = embeds.shape[1] - int(self.stop_token) - 1  # one past placeholder T - 2
        hidden = out.hidden_states[-1][:, end - tokens:end]
        value = self.value_head(hidden[:, 0]).squeeze(-1)  # the last prompt token
        return out.logits[:, end - tokens:end], hidden, value

    def token_logits(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _, value = self._forward(obs)
        return logits, value

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        """Token OFT: sampled (or greedy) bins ``[B, T]``. L1 OFT: the regressed normalised chunk
        ``[B, T]`` (deterministic either way; its log-probs are zeros)."""
        if self.action_head is None:
            return super().act(obs, deterministic, noise)
        _, hidden, value = self._forward(obs)
        chunk = self.action_head(hidden, self.chunk_size).flatten(1).float()
        return chunk, torch.zeros_like(chunk), value

    def to_env(self, actions: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if self.action_head is None:
            return super().to_env(actions, obs)
        chunk = self.actions.unnormalize(actions.unflatten(-1, (self.chunk_size, self.action_dim)).cpu())
        chunk = self.adapter.actions(chunk.to(actions.device))
        return chunk if self.chunk_size > 1 else chunk[:, 0]

    def save_pretrained(self, path: str | Path) -> None:
        """A model directory ``policy.vla.model_path`` loads: the backbone, tokenizer and OFT's component files."""
        super().save_pretrained(path)
        for name, module in (("proprio_projector", self.proprio_projector), ("action_head", self.action_head)):
            if module is not None:
                torch.save({f"module.{k}": v for k, v in module.state_dict().items()},  # OFT's name pattern
                           Path(path) / f"{name}--0_checkpoint.pt")

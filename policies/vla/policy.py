"""Token VLA policies behind the Policy protocol: action tokens sampled autoregressively (OpenVLA,
Qwen-VL) or in parallel (OpenVLA-OFT), a value head on the last prompt token's hidden state,
PPO / GRPO log-probs per action token. What every token-action policy shares (tokens, sampling from
seeded noise, log-probs, decoding to env actions) is ``policies/token_actions.py``'s; this module
adds the language backbone: prompts, KV-cached decoding, LoRA, vLLM and model directories.

Observations: ``rgb`` uint8 ``[B, H, W, 3]``, ``state`` (proprioception, OFT) and, where the env
has one, ``instruction`` uint8 ``[B, L]`` (UTF-8, zero-padded: ``envs.base.instruction_width``; else
``policy.vla.instruction``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from envs.common import UserError, unknown_name_error
from policies.base import POLICIES, require_model_dir
from policies.token_actions import TokenActionPolicy
from policies.vla.action_tokenizer import ActionStats, ActionTokenizer
from policies.vla.adapters import InputAdapter
from policies.vla.checkpoint import (
    NORMALIZATION_NAMES,
    NORMALIZATIONS,
    STATS_FILE,
    Statistics,
    action_bounds,
    check_model_files,
    check_normalization,
    check_pretrained_weights,
    dataset_statistics,
    quiet_transformers,
    recorded_image_size,
)
from policies.vla.openvla import PROMPT, TINY_PATCH, OpenVLAConfig, OpenVLAForActionPrediction, read_config, tiny_config
from policies.vla.processor import ImageProcessing, byte_tokenizer, tokenize_prompts

GENERATION_BACKENDS = ["hf", "vllm"]  # hf: this module's KV-cached decoding; vllm: vllm_backend.py
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def instructions_of(obs: dict[str, torch.Tensor], fallback: str) -> list[str]:
    if "instruction" not in obs:
        return [fallback] * obs["rgb"].shape[0]
    from envs.base import decode_instruction

    return [decode_instruction(row) for row in obs["instruction"].cpu()]


@dataclass
class DecodeState:
    """What one more decoding step needs: the KV cache, and the attention mask / positions so far."""

    cache: object
    mask: torch.Tensor
    positions: torch.Tensor | None = None


class TokenVLAPolicy(TokenActionPolicy):
    """Base of VLA policies that emit one token per action dimension.

    A subclass calls :meth:`_setup_rl` (action tokens, sampling settings, value head, LoRA)
    and implements :meth:`_run` (one forward pass over the prompt, optionally followed by
    action tokens) and :meth:`_step` (one more token with the KV cache). The backbone is the
    actor's: critic warm-up trains the value head alone.
    """

    config_sections = ("vla",)

    def _run(self, obs: dict[str, torch.Tensor], action_ids: torch.Tensor | None = None,
             use_cache: bool = False) -> tuple[torch.Tensor, torch.Tensor, DecodeState]:
        """-> ``(logits [B, L, V], last hidden layer [B, L, H], state)``; the sequence ends with the
        prompt, then ``action_ids [B, K]``."""
        raise NotImplementedError

    def _step(self, token: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        """One token ``[B, 1]`` more -> ``(logits [B, V], state)``."""
        raise NotImplementedError

    def _prompts(self, obs: dict[str, torch.Tensor]) -> list[str]:
        return [PROMPT.format(instruction=text.lower()) for text in instructions_of(obs, self.instruction)]

    def _setup_rl(self, cfg, action_dim: int, actions: ActionTokenizer, hidden: int, lora_target: nn.Module) -> None:
        """What every VLA policy adds to its backbone: action tokens, sampling settings, a value
        head on ``hidden``-wide states and, with ``policy.vla.lora_rank``, LoRA in ``lora_target``."""
        self._setup_actions(cfg, action_dim, actions)
        self.instruction = cfg.vla.instruction
        vla = cfg.vla
        self.model_path, self.unnorm_key, self.normalization = vla.model_path, vla.unnorm_key, vla.normalization
        self.backend, self.generator = cfg.vla.backend, None  # generator: the vLLM engine, once built
        if cfg.vla.backend not in GENERATION_BACKENDS:
            raise unknown_name_error("generation backend (policy.vla.backend)", cfg.vla.backend, GENERATION_BACKENDS)
        self.value_head = make_value_head(hidden).to(next(lora_target.parameters()).dtype)  # the backbone's
        if cfg.vla.lora_rank:
            self._add_lora(lora_target, cfg.vla.lora_rank)

    def shard_units(self) -> list[nn.Module]:
        """The backbone's transformer blocks: the classes its models list as ``_no_split_modules``."""
        blocks = {name for m in self.modules() for name in getattr(m, "_no_split_modules", None) or ()}
        return [m for m in self.modules() if type(m).__name__ in blocks]

    def _add_lora(self, module: nn.Module, rank: int) -> None:
        """LoRA adapters in ``module`` (the language model); only they and the new heads (value head,
        OFT's proprio projector, added after this) train."""
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS), module)
        for name, param in self.named_parameters():
            param.requires_grad = "lora_" in name or name.startswith("value_head")

    # -- the Policy protocol ---------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None):
        if self.backend == "vllm":
            return self._act_vllm(obs, deterministic)
        logits, hidden, state = self._run(obs, use_cache=True)
        value = self.value_head(hidden[:, -1]).squeeze(-1)
        uniform = self._uniform(logits.shape[0], deterministic, noise, logits.device)
        bins, logprobs, logits = [], [], logits[:, -1]
        for j in range(self.noise_dim):
            logp = self._bin_logprobs(logits)
            b = self._sample(logp, None if uniform is None else uniform[:, j])
            bins.append(b)
            logprobs.append(logp.gather(-1, b[:, None]).squeeze(-1))
            if j + 1 < self.noise_dim:
                logits, state = self._step(self.actions.action_ids.to(b.device)[b][:, None], state)
        return torch.stack(bins, dim=1).float(), torch.stack(logprobs, dim=1), value

    def _act_vllm(self, obs: dict[str, torch.Tensor], deterministic: bool):
        """vLLM samples the tokens; this model scores them (see policies/vla/vllm_backend.py)."""
        if self.generator is None:  # built at the first rollout, in the rollout worker only
            from policies.vla.vllm_backend import VLLMGenerator

            self.generator = VLLMGenerator(self)
        bins = self.generator.generate(obs, deterministic).to(self.value_head[0].weight.device).float()
        token_logp, _, value = self.token_logprobs(obs, bins)
        return bins, token_logp, value

    def weights_updated(self) -> None:
        """Called after a weight sync: a vLLM engine reloads before its next rollout."""
        if self.generator is not None:
            self.generator.stale = True

    def bin_distributions(self, obs: dict[str, torch.Tensor], actions: torch.Tensor):
        """Teacher-forced log-probs of every bin at every action token ``[B, T, n_bins]``, and the value."""
        action_ids = self.actions.action_ids.to(actions.device)[actions.long()]
        logits, hidden, _ = self._run(obs, action_ids[:, :-1])
        # the last prompt token predicts action token 0, action token j predicts j + 1
        value = self.value_head(hidden[:, -self.noise_dim]).squeeze(-1)
        return self._bin_logprobs(logits[:, -self.noise_dim:]), value

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        _, hidden, _ = self._run(obs)
        return self.value_head(hidden[:, -1]).squeeze(-1)

    def save_pretrained(self, path: str | Path) -> None:
        """A model directory that ``policy.vla.model_path`` loads: the model, its tokenizer and, where
        actions are normalised, their statistics (OpenVLA's ``dataset_statistics.json``, in the fields
        of ``policy.vla.normalization``)."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        self.images.save_pretrained(path)
        stats = self.actions.stats
        if bool(stats.normalize_mask.any()):  # [-1, 1] actions need no file
            key = self.unnorm_key or "embodied"
            block = stats.to_dict(NORMALIZATIONS[self.normalization])
            (Path(path) / STATS_FILE).write_text(json.dumps({key: {"action": block}}, indent=1))

def load_strictly(model_class, model_dir: str, dtype: torch.dtype, config=None):
    """``model_class.from_pretrained`` (with ``config``, already read and checked, if given) that fails
    on any missing, unexpected or misshapen weight, naming them (transformers only warns, and a
    half-loaded VLA acts plausibly but wrongly)."""
    extra = {} if config is None else {"config": config}
    try:
        with quiet_transformers():  # mismatches are loaded (then refused below) so that we can name them
            model, info = model_class.from_pretrained(model_dir, dtype=dtype, output_loading_info=True,
                                                      ignore_mismatched_sizes=True, **extra)
    except OSError as err:  # a file transformers could not read: a shard cut short, a missing file
        raise UserError(f"policy.vla.model_path={model_dir} does not load as {model_class.__name__}: {err}. Check that "
                        "the directory is a complete copy of the checkpoint (config.json and every "
                        "*.safetensors shard named in its index).") from err
    problems = loading_problems(info)
    if problems:
        raise UserError(f"policy.vla.model_path={model_dir}: its weights do not fit the {model_class.__name__} its "
                        f"config.json describes: {problems}. config.json and the weights come from different "
                        "checkpoints (or config.json was edited): copy both from one.")
    return model


def loading_problems(info: dict, shown: int = 3) -> str:
    """transformers' loading info -> what does not fit, readably ('' when everything loaded)."""
    parts = []
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        named = "; ".join(f"{name}: {tuple(saved)} in the weights, {tuple(built)} per config.json"
                          for name, saved, built in sorted(mismatched)[:shown])
        parts.append(f"{len(mismatched)} weights of other shapes ({named}{'; ...' if len(mismatched) > shown else ''})")
    for key, what in (("missing_keys", "missing from the weights"), ("unexpected_keys", "not in the model")):
        names = sorted(info.get(key) or [])
        if names:
            parts.append(f"{len(names)} {what} ({', '.join(names[:shown])}{', ...' if len(names) > shown else ''})")
    return "; ".join(parts)


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def weights_dtype(name: str) -> torch.dtype:
    """``policy.vla.dtype`` -> the torch dtype a checkpoint's weights are loaded in."""
    if name not in WEIGHT_DTYPES:
        raise unknown_name_error("weights dtype (policy.vla.dtype)", name, list(WEIGHT_DTYPES))
    return WEIGHT_DTYPES[name]


def require_images(obs_spec: dict, name: str, cameras: list[str] | tuple[str, ...] = ("rgb",)) -> None:
    if "rgb" not in obs_spec:
        raise UserError(f"policy={name} needs camera images: use an env with obs_mode: rgb.")
    missing = [c for c in cameras if c not in obs_spec]
    if missing:
        raise UserError(f"policy.vla.cameras={list(cameras)}: this env has no {missing} observation (it has "
                        f"{sorted(obs_spec)}). Drop them from policy.vla.cameras, or use an env that renders them "
                        "(LIBERO gives rgb and wrist_rgb).")


def make_value_head(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))


EMPTY_PIECE = "\u2581"  # SentencePiece's word boundary on its own: id 29871 in Llama-2's vocabulary


@dataclass(frozen=True)
class OpenVLACheckpoint:
    """What an OpenVLA-family checkpoint directory says, read and checked; no weights loaded. Built
    by :meth:`OpenVLAPolicy.read_checkpoint`, both before any worker starts and when the policy builds."""

    model_dir: str
    config: OpenVLAConfig
    images: ImageProcessing
    statistics: Statistics | None
    action_stats: ActionStats | None  # None while the env's action size is not known
    normalization: str

    def describe(self) -> str:
        """One line for the run log: what was loaded, and which choices the checkpoint left to the config."""
        specs = self.config.vision_specs()
        vision = " + ".join(self.config.timm_model_ids[:len(specs)])
        text = self.config.text_config
        if self.statistics is None or "action" not in self.statistics.blocks:
            actions = "actions in [-1, 1] (no statistics)"
        else:
            actions = (f"actions un-normalised with {NORMALIZATION_NAMES[self.normalization]} of "
                       f"{self.statistics.source}[{self.statistics.key}] "
                       f"(policy.vla.normalization={self.normalization})")
        return (f"{self.model_dir}: vision {vision} at {specs[0].image_size} px, images {self.images.describe()}; "
                f"Llama {text.num_hidden_layers} layers, {self.config.n_action_bins} action bins; {actions}")


TINY_IMAGE_SIZE = 64  # a tiny model's ViTs' input size: 8 x 8 patches of TINY_PATCH


@POLICIES.register("openvla")
class OpenVLAPolicy(TokenVLAPolicy):
    """OpenVLA: action bins are the last ``n_action_bins`` ids of the vocabulary before its padding."""

    hub_id = "openvla/openvla-7b"
    normalizations = ("bounds_q99",)  # upstream OpenVLA's predict_action un-normalises with q01 / q99 only
    # what a checkpoint directory loads into (load_strictly) and what check_config builds on the meta device
    model_class = OpenVLAForActionPrediction

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        require_images(obs_spec, cfg.name, cfg.vla.cameras)
        self.cameras = list(cfg.vla.cameras)
        self.checkpoint = None
        if cfg.vla.model_path:
            from transformers import AutoTokenizer

            require_model_dir(cfg.vla.model_path, self.hub_id)
            self.checkpoint = self.read_checkpoint(cfg, action_dim)
            self.model = load_strictly(self.model_class, cfg.vla.model_path, weights_dtype(cfg.vla.dtype),
                                       self.checkpoint.config)
            # trust_remote_code=False: config.json's auto_map names upstream's code, which we never run
            with quiet_transformers():  # it warns that config.json's model_type is not one of its own
                self.tokenizer = AutoTokenizer.from_pretrained(cfg.vla.model_path, trust_remote_code=False)
            self.images, stats = self.checkpoint.images, self.checkpoint.action_stats
        else:
            self.tokenizer = byte_tokenizer()
            self.model = OpenVLAForActionPrediction(tiny_config(len(self.tokenizer), cfg.vla.image_size))
            self.images = ImageProcessing.default(cfg.vla.image_size, len(self.model.config.vision_specs()))
            stats = ActionStats.identity(action_dim)
        self.image_size = self.model.config.image_sizes[0]
        actions = ActionTokenizer(stats, n_bins=self.model.config.n_action_bins,
                                  vocab_size=self.model.config.action_vocab_size)
        self._setup_rl(cfg, action_dim, actions, self.model.config.text_config.hidden_size, self.model.language_model)
        self.empty_piece = self.tokenizer.get_vocab().get(EMPTY_PIECE)

    @classmethod
    def read_checkpoint(cls, cfg, action_dim: int | None) -> OpenVLACheckpoint:
        """``policy.vla.model_path``'s files read and checked (config.json, the processor, the statistics
        under ``policy.vla.normalization``); ``action_dim``: the env's, or None while it is not known."""
        cls.check_normalization(cfg.vla.normalization)
        check_model_files(cfg.vla.model_path, needs_processor=True)
        config = read_config(cfg.vla.model_path)
        backbones = len(config.vision_specs())
        images = ImageProcessing.from_pretrained(cfg.vla.model_path, config.image_sizes[:backbones], backbones)
        found = dataset_statistics(cfg.vla.model_path, config.norm_stats, cfg.vla.unnorm_key)
        actions = action_bounds(found, cfg.vla.model_path, action_dim, cfg.vla.normalization)
        return OpenVLACheckpoint(cfg.vla.model_path, config, images, found, actions, cfg.vla.normalization)

    @classmethod
    def resolve_settings(cls, cfg) -> None:
        """``policy.vla.image_size`` left null: the checkpoint's (config.json ``image_sizes``), 64 for a tiny model
        (or a checkpoint that cannot be read: check_config says why)."""
        super().resolve_settings(cfg)
        if cfg.vla.image_size is None:
            cfg.vla.image_size = recorded_image_size(cfg.vla.model_path) or TINY_IMAGE_SIZE

    @classmethod
    def checkpoint_settings(cls, cfg) -> dict[str, dict]:
        size = recorded_image_size(cfg.vla.model_path)
        return {"policy.vla.image_size": {"value": cfg.vla.image_size, "checkpoint": size, "field": "image_sizes"}
                } if size else {}

    @classmethod
    def check_observations(cls, cfg, obs_spec: dict, action_dim: int) -> None:
        require_images(obs_spec, cfg.name, cfg.vla.cameras)

    @classmethod
    def check_normalization(cls, name: str) -> None:
        check_normalization(name)
        if name not in cls.normalizations:
            raise UserError(f"policy.vla.normalization={name}: OpenVLA's predict_action un-normalises actions with "
                            "q01 / q99 only (bounds_q99); min / max bounds are OpenVLA-OFT's (policy=openvla_oft, "
                            "e.g. its ALOHA checkpoints). Remove the override.")

    @classmethod
    def check_config(cls, cfg, action_dim: int | None) -> list[str]:
        """Before any worker starts: the checkpoint's files and every option in them, its
        ``unnorm_key`` and action size, and its weights against the model its config.json builds (on
        the meta device: :func:`check_pretrained_weights`). Returns the line the run log shows about
        the checkpoint."""
        InputAdapter.from_config(cfg)
        weights_dtype(cfg.vla.dtype)
        cls.check_normalization(cfg.vla.normalization)
        if not cfg.vla.model_path:
            if cfg.vla.image_size < TINY_PATCH:
                raise UserError(f"policy.vla.image_size={cfg.vla.image_size}: the tiny {cfg.name} model's ViTs "
                                f"cut images into {TINY_PATCH} px patches, so they need at least {TINY_PATCH} px "
                                f"({TINY_IMAGE_SIZE} is the tiny configs' size). Set policy.vla.image_size to "
                                f"{TINY_PATCH} or more.")
            return []
        checkpoint = cls.read_checkpoint(cfg, action_dim)
        size = checkpoint.config.image_sizes[0]
        if cfg.vla.image_size != size:
            raise UserError(f"policy.vla.image_size={cfg.vla.image_size}, but {cfg.vla.model_path}'s vision "
                            f"backbone takes {size} px images (config.json image_sizes): a checkpoint's input "
                            f"size is its own. Leave policy.vla.image_size unset (null: the checkpoint's).")
        check_pretrained_weights(cfg.vla.model_path, lambda: cls.model_class(checkpoint.config))
        return [f"policy={cfg.name} {checkpoint.describe()}"]

    def _prompt_ids(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids and mask ``[B, L]`` (BOS, padding, prompt). OpenVLA was trained on "Out: " then the
        lone "\u2581" piece (29871) before the action tokens; like its ``predict_action``, append
        that piece where the tokenizer has it and the prompt does not end with it."""
        ids, mask = tokenize_prompts(self.tokenizer, self._prompts(obs))
        if self.empty_piece is not None and bool((ids[:, -1] != self.empty_piece).any()):
            ids = torch.cat([ids, torch.full_like(ids[:, :1], self.empty_piece)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        device = self.value_head[0].weight.device
        return ids.to(device), mask.to(device)

    def _pixel_values(self, obs: dict[str, torch.Tensor], device) -> torch.Tensor:
        """``policy.vla.cameras``' frames through the family's adapter and the checkpoint's processor,
        stacked on channels (OFT's multi-image input): ``[B, 3 * backbones * cameras, S, S]``."""
        return torch.cat([self.images(self.adapter.frames(obs[c])) for c in self.cameras], dim=1).to(device)

    def _run(self, obs, action_ids=None, use_cache=False):
        ids, mask = self._prompt_ids(obs)
        device = ids.device
        if action_ids is not None:
            ids = torch.cat([ids, action_ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(action_ids)], dim=1)
        embeds, mask = self.model.multimodal_embeddings(ids, self._pixel_values(obs, device), mask)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding skipped: positions as if unpadded
        out = self.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                        use_cache=use_cache, output_hidden_states=True)
        return out.logits, out.hidden_states[-1], DecodeState(out.cache, mask, positions[:, -1:])

    def _step(self, token, state):
        lm = self.model.language_model
        mask = torch.cat([state.mask, torch.ones_like(token)], dim=1)
        positions = state.positions + 1
        out = lm(inputs_embeds=lm.get_input_embeddings()(token), attention_mask=mask, position_ids=positions,
                 cache=state.cache, use_cache=True)
        return out.logits[:, -1], DecodeState(out.cache, mask, positions)

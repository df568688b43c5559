"""``policy=pi0``: pi0 / pi0.5 behind the Policy protocol, as a chain-sampled flow policy
(policies/flow_policy.py): rollouts sample the denoising chain (Flow-SDE or Flow-Noise), the update
re-scores it, evaluation runs the checkpoint's Euler ODE.

- weights: a lerobot-layout checkpoint (``policy.vla.model_path``; policies/pi0/checkpoint.py), or a
  tiny network from scratch (``policy.pi.variant``) for CPU runs and tests;
- observations: the cameras ``policy.vla.cameras`` (uint8 ``[B, H, W, 3]``, in the checkpoint's camera
  order; mirrored left-right with ``policy.vla.mirror_images``), ``state [B, S]`` and the instruction
  (``instruction`` or ``policy.vla.instruction``), made into the model's inputs as lerobot does
  (policies/pi0/inputs.py);
- the chain: ``x`` is the model's whole chunk, ``D = H * 32`` numbers (``H`` the checkpoint's
  chunk, 32 its padded action size), so sampling from the same noise is the reference's; the env
  executes the first ``policy.chunk_size`` actions of it, cropped to the env's action size and
  un-normalised with the checkpoint's statistics;
- value (RLinf's placement): an MLP on the mean of the expert's output over the action tokens (pi0: the
  expert reads the prefix and the state token; run once at ``t = 1`` from the noise's mean, 0, so the value
  is the observation's alone) or of the VLM's output over the real prefix tokens (pi0.5, whose expert sees
  no state); the expert's reading is detached, so the value loss trains the head alone, as RLinf's
  ``detach_critic_input``; Flow-Noise's std: a linear head on each action token's ``x_t`` and the time.
"""

from __future__ import annotations

import torch
from torch import nn

from envs.common import UserError
from policies.base import POLICIES, changed_settings, get_setting, layer_init, mlp, rowwise_exact, set_setting
from policies.flow_policy import FlowMatchingPolicy, time_features
from policies.flow_steps import accumulated_time_grid
from policies.pi0.checkpoint import PiCheckpoint, read_checkpoint
from policies.pi0.inputs import Normalizer, pad_to, pi0_prompt, pi05_prompt, pil_resize_with_pad, vision_input
from policies.pi0.model import PiSize, PiZero, Prefix, VisionSize
from policies.pi0.transformer import DecoderLayer, StackSize
from policies.vla.processor import byte_tokenizer

VARIANTS = ("pi0", "pi05")
RESIZES = ("lerobot", "openpi")  # policy.pi.resize
TIME_FEATURES = 16
# a tiny network's settings where a checkpoint would record them (PiCheckpoint.recorded): 4 actions of each chunk,
# the ODE's 10 Euler steps (lerobot's default), 56 px images (16 patches of 14), prompts of 48 tokens, float32
TINY_SETTINGS = {"chunk_size": 4, "flow.eval_steps": 10, "pi.image_size": 56, "pi.max_tokens": 48,
                 "vla.dtype": "float32"}
# the flow-matching loss's time distribution, Beta(alpha, beta) * scale + offset (lerobot's and openpi's defaults)
TIME_SAMPLING = {"beta_alpha": 1.5, "beta_beta": 1.0, "scale": 0.999, "offset": 0.001}


def tiny_size(variant: str, chunk: int, image_size: int = 56) -> PiSize:
    """A network of about 0.3M parameters (56 px images: 16 patches of 14) for CPU runs and tests."""
    return PiSize(pi05=variant == "pi05", vlm=StackSize(64, 2, 128, 8, 1, 16), expert=StackSize(32, 2, 64, 8, 1, 16),
                  vision=VisionSize(32, 2, 2, 64, 14, image_size), vocab_size=len(byte_tokenizer(0)), chunk_size=chunk)


class Features:
    """What :meth:`PiPolicy.heads` gives the chain: the prefix and pi0's padded, normalised state."""

    def __init__(self, prefix: Prefix, state: torch.Tensor | None):
        self.prefix, self.state = prefix, state

    def repeat_interleave(self, repeats: int, dim: int = 0) -> Features:
        state = None if self.state is None else self.state.repeat_interleave(repeats, dim)
        return Features(self.prefix.repeat_interleave(repeats, dim), state)


@POLICIES.register("pi0")
class PiPolicy(FlowMatchingPolicy):
    config_sections = ("vla", "flow", "pi")
    checkpoint_sources = (" pi0 / pi0.5: lerobot's are on the Hugging Face hub (lerobot/pi05_libero_finetuned, "
                          "lerobot/pi0_libero, ...), RLinf's too (RLinf/RLinf-Pi0-LIBERO-*-SFT); openpi's "
                          "(gs://openpi-assets/checkpoints/pi0_libero, pi05_libero) are converted by openpi's "
                          "examples/convert_jax_model_to_pytorch.py, with assets/<asset_id>/norm_stats.json copied "
                          "beside the weights.")

    def __init__(self, cfg, obs_spec: dict, action_dim: int):
        super().__init__()
        ckpt = _read(cfg) if cfg.vla.model_path else None
        self.size = ckpt.size if ckpt else tiny_size(cfg.pi.variant, max(cfg.chunk_size, 4), cfg.pi.image_size)
        self._setup_flow(cfg, action_dim)
        self.width = self.size.chunk_size * self.size.max_action_dim  # the chain is the model's whole chunk
        self.noise_dim = (self.steps + 1) * self.width + 1
        self.model = PiZero(self.size)
        if cfg.vla.dtype == "bfloat16":  # before loading, as lerobot casts: the float32 islands keep every bit
            self.model.use_bfloat16()
        if ckpt is not None:
            self.model.load_state_dict(ckpt.tensors(), strict=True)
        if cfg.vla.lora_rank:  # after loading: the adapters rename the layers they wrap
            add_vlm_lora(self.model.vlm, cfg.vla.lora_rank)
        self.state_norm, self.action_norm = _normalizers(ckpt, obs_spec, action_dim)
        self.cameras, self.instruction = list(cfg.vla.cameras), cfg.vla.instruction
        self.mirror = cfg.vla.mirror_images  # LIBERO checkpoints: frames rotated 180 degrees from upright
        self.empty_cameras = ckpt.empty_cameras(len(self.cameras)) if ckpt else 0
        self.layout = ckpt.layout if ckpt else None
        self.state_prompt, self.resize, self.delta_actions = cfg.pi.state_prompt, cfg.pi.resize, cfg.pi.delta_actions
        self.tokenizer = _tokenizer(cfg.pi.tokenizer_path, ckpt)
        config = ckpt.config if ckpt else {}
        self.time_sampling = tuple(float(config.get(f"time_sampling_{k}", d)) for k, d in TIME_SAMPLING.items())
        self.max_tokens, self.image_size = cfg.pi.max_tokens, cfg.pi.image_size
        width = self.size.vlm.width if self.size.pi05 else self.size.expert.width
        # RLinf's value MLP for pi0 / pi0.5: width -> width/2 -> width/4 -> width/8 -> 1, ReLU between
        self.critic = mlp([width, width // 2, width // 4, width // 8, 1], "relu", out_gain=1.0)
        self.noise_head = layer_init(nn.Linear(self.size.max_action_dim + TIME_FEATURES, self.size.max_action_dim),
                                     gain=0.01) if cfg.flow.method == "noise" else None
        self.freeze_trunk(cfg.flow.train)

    @classmethod
    def resolve_settings(cls, cfg) -> None:
        """What the checkpoint records (:meth:`PiCheckpoint.recorded`: executed actions, Euler steps, image size,
        prompt length, dtype) fills the settings left null, as lerobot-eval uses them; a tiny network's
        :data:`TINY_SETTINGS` where there is no checkpoint (or it cannot be read: check_config then says why)."""
        recorded = {}
        if cfg.vla.model_path:
            try:
                recorded = {key: value for key, (_, value) in _read(cfg).recorded().items()}
            except (UserError, OSError, ValueError):
                pass
        for key, tiny in TINY_SETTINGS.items():
            if get_setting(cfg, key) is None:
                set_setting(cfg, key, recorded.get(key, tiny))

    @classmethod
    def checkpoint_settings(cls, cfg) -> dict[str, dict]:
        return _settings_beside(cfg, _read(cfg)) if cfg.vla.model_path else {}

    @classmethod
    def check_config(cls, cfg, action_dim: int | None) -> list[str]:
        """The variant, the checkpoint's files, fields and every weight's name and shape (on the meta device),
        before any worker starts. Notes: what the checkpoint records and whether the config overrides it."""
        notes = super().check_config(cfg, action_dim)
        if cfg.pi.variant not in VARIANTS:
            raise UserError(f"policy.pi.variant={cfg.pi.variant}: pick one of {list(VARIANTS)}.")
        if cfg.pi.resize not in RESIZES:
            raise UserError(f"policy.pi.resize={cfg.pi.resize}: pick lerobot (float bilinear) or openpi (PIL's "
                            "antialiased bilinear on uint8), as the checkpoint's authors resize.")
        if action_dim is not None and cfg.pi.delta_actions > action_dim:
            raise UserError(f"policy.pi.delta_actions={cfg.pi.delta_actions}, but this env's actions have {action_dim} "
                            "dims: name how many leading dims are offsets from the state (openpi's pi0_libero: 6).")
        if cfg.vla.lora_rank and cfg.flow.train == "expert":
            raise UserError(f"policy.vla.lora_rank={cfg.vla.lora_rank} adapts the VLM, which policy.flow.train=expert "
                            "freezes. Pick one: LoRA in the VLM and the expert whole (flow.train=all), or the expert "
                            "alone (lora_rank=0).")
        unread = changed_settings(cfg.vla, "vla", skip=READ_VLA_KEYS)
        if unread:
            raise UserError(f"policy=pi0 does not read {', '.join(unread)} (OpenVLA / OFT settings): the checkpoint's "
                            "own statistics and lerobot's pre-processing apply. Leave them at their defaults.")
        if cfg.vla.dtype not in ("float32", "bfloat16"):
            raise UserError(f"policy.vla.dtype={cfg.vla.dtype}: policy=pi0 runs in float32 or bfloat16 (lerobot's "
                            "mixed precision: the Gemma stacks in bfloat16, SigLIP, the norms and the heads in "
                            "float32).")
        if not cfg.vla.model_path:
            return notes
        ckpt = _read(cfg)
        ckpt.check_weights()
        check_env_sizes(ckpt, None, action_dim)
        patch, positions = ckpt.size.vision.patch, ckpt.size.vision.image_size // ckpt.size.vision.patch
        if cfg.pi.image_size // patch != positions:
            raise UserError(f"policy.pi.image_size={cfg.pi.image_size} makes {(cfg.pi.image_size // patch) ** 2} "
                            f"patches of {patch} px, but {ckpt.path} holds {positions ** 2} positions: leave it null "
                            f"(the checkpoint's image_resolution, {ckpt.size.vision.image_size}).")
        if cfg.chunk_size > ckpt.size.chunk_size:
            raise UserError(f"policy.chunk_size={cfg.chunk_size}, but {ckpt.path} predicts chunks of "
                            f"{ckpt.size.chunk_size}. Execute at most that many (its n_action_steps: "
                            f"{ckpt.config.get('n_action_steps')}).")
        if not ckpt.fits_cameras(len(cfg.vla.cameras)):
            fill = " (the env's fill the first slots)" if ckpt.layout == "openpi" else ""
            raise UserError(f"policy.vla.cameras={list(cfg.vla.cameras)}, but {ckpt.path} reads "
                            f"{len(ckpt.cameras)} camera(s) ({', '.join(ckpt.cameras)}){fill}: name the env's images "
                            "in that order.")
        _tokenizer(cfg.pi.tokenizer_path, ckpt, load=False)
        return notes + [f"pi0 checkpoint {ckpt.path} ({ckpt.layout}'s layout): {ckpt.config['type']}, chunks of "
                        f"{ckpt.size.chunk_size}"] + _setting_notes(_settings_beside(cfg, ckpt))

    @classmethod
    def check_observations(cls, cfg, obs_spec: dict, action_dim: int) -> None:
        """The cameras named, and a checkpoint's state size against the env's (once the env workers report it)."""
        missing = [c for c in cfg.vla.cameras if c not in obs_spec]
        if missing:
            raise UserError(f"policy.vla.cameras names {missing}, which this env does not observe (it has "
                            f"{sorted(obs_spec)}). Name its camera images, e.g. env.obs_mode=rgb.")
        if cfg.vla.model_path:
            check_env_sizes(_read(cfg), obs_spec, action_dim)

    def shard_units(self) -> list[nn.Module]:
        """FSDP's units: every decoder layer of the two Gemma stacks and of SigLIP. FSDP gathers a unit in one
        dtype, so in bfloat16 (float32 norms inside bfloat16 layers) a layer's parts are the units (the
        attention's projections one by one: their module is never called itself), and the bfloat16 token
        embedding is one (the rest, the root's, is float32)."""
        layers = [m for m in self.modules() if isinstance(m, DecoderLayer) or type(m).__name__ == "SiglipEncoderLayer"]
        units = [part for layer in layers for part in ([layer] if _one_dtype(layer) else _parts(layer))]
        embed = self.model.vlm.model.language_model.embed_tokens
        return units + ([embed] if embed.weight.dtype != self.model.action_in_proj.weight.dtype else [])

    def freeze_trunk(self, train: str) -> None:
        """``policy.flow.train=expert``: the VLM (vision tower, projector, language model) keeps its weights."""
        if train == "expert":
            self.model.vlm.requires_grad_(False)

    # -- observations -> the model's inputs ------------------------------------------------------
    def _prompts(self, obs: dict[str, torch.Tensor], state: torch.Tensor | None) -> list[str]:
        from policies.vla.policy import instructions_of

        tasks = instructions_of({"rgb": obs[self.cameras[0]], **obs}, self.instruction)
        if self.size.pi05:
            states = state if self.state_prompt else [None] * len(tasks)
            return [pi05_prompt(task, s) for task, s in zip(tasks, states, strict=True)]
        return [pi0_prompt(task) for task in tasks]

    def _tokens(self, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """BOS, the prompt, right padding with 0 to ``max_tokens`` (longer prompts are cut)."""
        tokens = torch.zeros(len(prompts), self.max_tokens, dtype=torch.long)
        mask = torch.zeros(len(prompts), self.max_tokens, dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            ids = [self.tokenizer.bos_token_id, *self.tokenizer.encode(prompt, add_special_tokens=False)]
            ids = ids[:self.max_tokens]
            tokens[i, :len(ids)], mask[i, :len(ids)] = torch.tensor(ids), True
        return tokens.to(device), mask.to(device)

    def heads(self, obs: dict[str, torch.Tensor]) -> tuple[Features, torch.Tensor]:
        first = obs[self.cameras[0]]
        size = self.image_size
        frames = [obs[c].flip(2) if self.mirror else obs[c] for c in self.cameras]  # [B, H, W, 3]: W is dim 2
        if self.resize == "openpi":  # resized on uint8 (the client's), then vision_input passes it through
            frames = [pil_resize_with_pad(f, size) for f in frames]
        images = [vision_input(f.permute(0, 3, 1, 2).float() / 255, size) for f in frames]
        masks = [torch.ones(first.shape[0], dtype=torch.bool, device=first.device) for _ in self.cameras]
        for _ in range(self.empty_cameras):  # blank slots: -1 everywhere, masked out (as lerobot feeds them)
            images.append(torch.full_like(images[0], -1.0))
            masks.append(torch.zeros_like(masks[0]))
        state = obs["state"].float() if "state" in obs else torch.zeros(first.shape[0], 0, device=first.device)
        if self.state_norm is not None:
            state = self.state_norm.normalize(state)
        tokens, token_masks = self._tokens(self._prompts(obs, state), first.device)
        prefix = self.model.prefix(images, masks, tokens, token_masks)
        features = Features(prefix, None if self.size.pi05 else pad_to(state, self.size.max_state_dim))
        return features, self.critic(self._critic_input(features)).squeeze(-1)

    def _critic_input(self, features: Features) -> torch.Tensor:
        """``[B, W]``: pi0.5 the VLM's pooled output; pi0 the expert's mean over its action tokens at ``t = 1``
        from ``x = 0``, without gradients."""
        if self.size.pi05:
            return features.prefix.pooled()
        b, h = len(features.prefix.pad), self.size.chunk_size
        x = torch.zeros(b, h, self.size.max_action_dim, device=features.prefix.pad.device)
        with torch.no_grad():
            return self.model.expert_output(features.prefix, features.state, x, torch.ones(b, device=x.device)
                                            ).float().mean(1)

    # -- the chain -----------------------------------------------------------------------------------
    def _chunk(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.size.chunk_size, self.size.max_action_dim))

    def velocity(self, features: Features, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.model.velocity(features.prefix, features.state, self._chunk(x), t).flatten(1)

    def ode_times(self, steps: int) -> torch.Tensor:
        """openpi's checkpoints are evaluated at the times openpi's sampler visits (float32 accumulation), lerobot's
        on the exact grid (which lerobot's matches to 1e-5)."""
        return accumulated_time_grid(steps) if self.layout == "openpi" else super().ode_times(steps)

    def scored(self, per_element: torch.Tensor) -> torch.Tensor:
        """The executed actions' share of the chain, ``[B, chunk_size * A]``: the first ``chunk_size`` of the
        model's ``H`` actions, the env's ``A`` of its 32 dims (RLinf's pi0 RL scores these; the rest of the
        chunk and the padding never reach the env)."""
        return self._chunk(per_element)[:, :self.chunk_size, :self.action_dim].flatten(1)

    def noise_std(self, features: Features, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tokens = self._chunk(x)
        time = time_features(t, TIME_FEATURES)[:, None, :].expand(*tokens.shape[:2], -1)
        squashed = rowwise_exact(torch.sigmoid, self.noise_head(torch.cat([tokens, time], -1)))
        return (self.noise_min + (self.noise_max - self.noise_min) * squashed).flatten(1)

    def to_env(self, actions: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The chunk's first ``chunk_size`` actions, cropped to the env's size, un-normalised, and with
        ``policy.pi.delta_actions`` the observed state added to its leading dims: ``[B, chunk_size, A]``
        (``[B, A]`` for a chunk of one)."""
        chunk = self._chunk(actions[:, -1 - self.width:-1])[:, :self.chunk_size, :self.action_dim]
        decoded = chunk if self.action_norm is None else self.action_norm.unnormalize(chunk)
        if self.delta_actions:
            decoded = decoded + self._delta_offset(obs, decoded)
        return decoded if self.chunk_size > 1 else decoded[:, 0]

    def _delta_offset(self, obs: dict[str, torch.Tensor] | None, chunk: torch.Tensor) -> torch.Tensor:
        """``[B, 1, A]``: the state the chunk was planned on in its first ``delta_actions`` dims, 0 elsewhere."""
        if obs is None or "state" not in obs:
            raise ValueError("policy.pi.delta_actions: to_env needs the observations the actions were chosen on")
        n = self.delta_actions
        return pad_to(obs["state"][:, None, :n].to(chunk.device, chunk.dtype), chunk.shape[-1])

    def demo_loss(self, obs: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flow-matching loss on demo chunks ``targets [B, chunk_size, A]``, normalised as the checkpoint's
        actions, padded to the model's chunk and action size, at times drawn as pi0 trains (lerobot, openpi):
        ``t ~ Beta(1.5, 1) * 0.999 + 0.001`` (a checkpoint's ``time_sampling_*`` where it sets them), which
        weights the noisy end (``t`` near 1)."""
        if self.delta_actions:  # demos record absolute actions; the model predicts the offsets
            targets = targets - self._delta_offset(obs, targets)
        a = targets if self.action_norm is None else self.action_norm.normalize(targets)
        a = nn.functional.pad(pad_to(a, self.size.max_action_dim), (0, 0, 0, self.size.chunk_size - a.shape[1]))
        features, _ = self.heads(obs)
        alpha, beta, scale, offset = self.time_sampling
        t = torch.distributions.Beta(alpha, beta).sample((len(a),)).to(a.device) * scale + offset
        loss = self.model.flow_loss(features.prefix, features.state, a, torch.randn_like(a), t)
        return {"loss": loss[:, :targets.shape[1], :self.action_dim].mean()}


# policy.vla keys that pi0 reads; the rest are other VLA families' and must keep their defaults
READ_VLA_KEYS = ("model_path", "dtype", "instruction", "cameras", "mirror_images", "camera_size", "camera_rendering",
                 "lora_rank")
# LoRA in the VLM as RLinf adapts pi0's PaliGemma: Gemma's attention and MLP, SigLIP's attention and MLP
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj", "fc1", "fc2"]


def add_vlm_lora(vlm: nn.Module, rank: int) -> None:
    """LoRA adapters (rank ``rank``, alpha = rank, RLinf's) in the VLM, whose own weights freeze; the expert,
    the action and time projections and the heads train whole."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS), vlm)
    for name, param in vlm.named_parameters():
        param.requires_grad = "lora_" in name


def _one_dtype(module: nn.Module) -> bool:
    return len({p.dtype for p in module.parameters()}) == 1


def _parts(layer: DecoderLayer) -> list[nn.Module]:
    return [*layer.self_attn.children(), layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]


def check_env_sizes(ckpt: PiCheckpoint, obs_spec: dict | None, action_dim: int | None) -> None:
    """The checkpoint's action and state sizes against the env's (None: not known yet)."""
    if action_dim is not None and ckpt.action_dim != action_dim:
        raise UserError(f"{ckpt.path} acts in {ckpt.action_dim} dimensions (config.json output_features), but "
                        f"this env takes {action_dim}. Use the checkpoint on the robot it was trained for.")
    state = None if obs_spec is None else obs_spec.get("state", ((0,), None))[0][0]
    if state is not None and ckpt.state is not None and state != ckpt.state_dim:
        raise UserError(f"{ckpt.path} reads a state of {ckpt.state_dim} numbers, but this env's has {state}. Use "
                        "the env settings the checkpoint was trained with.")


def _read(cfg) -> PiCheckpoint:
    return read_checkpoint(cfg.vla.model_path, cfg.pi.vision_head_dim, cfg.pi.norm_stats)


def _normalizers(ckpt: PiCheckpoint | None, obs_spec: dict, action_dim: int
                 ) -> tuple[Normalizer | None, Normalizer | None]:
    """The checkpoint's statistics (a tiny network has none: actions and states as the env gives them)."""
    if ckpt is None:
        return None, None
    check_env_sizes(ckpt, obs_spec, action_dim)
    return ckpt.state, ckpt.action


def _settings_beside(cfg, ckpt: PiCheckpoint) -> dict[str, dict]:
    """What ``ckpt`` records, each beside the run's value (:meth:`PiPolicy.checkpoint_settings`)."""
    return {f"policy.{key}": {"value": get_setting(cfg, key), "checkpoint": value, "field": field}
            for key, (field, value) in ckpt.recorded().items()}


def _setting_notes(settings: dict[str, dict]) -> list[str]:
    """One run-log line for what the checkpoint records, one per setting the config overrides."""
    used = [f"{s['field']}={s['value']} ({key})" for key, s in settings.items() if s["value"] == s["checkpoint"]]
    notes = [f"the checkpoint's {', '.join(used)}"] if used else []
    return notes + [f"{key}={s['value']} overrides the checkpoint's {s['field']}={s['checkpoint']}"
                    for key, s in settings.items() if s["value"] != s["checkpoint"]]


def _tokenizer(path: str | None, ckpt: PiCheckpoint | None, load: bool = True):
    """``policy.pi.tokenizer_path``, else the one saved in the checkpoint directory, else a local copy (the Hugging
    Face cache, nothing downloaded) of the one its pre-processor names; a tiny network: a byte-level one.
    ``load=False``: only check that there is one."""
    from transformers import AutoTokenizer

    if path is None and ckpt is None:
        return byte_tokenizer(0)
    where = path or ckpt.tokenizer_dir()
    if where is None:
        name = ckpt.tokenizer_name()
        if name:
            try:
                return AutoTokenizer.from_pretrained(name, local_files_only=True)
            except (OSError, ValueError):
                pass
        raise UserError(f"{ckpt.path} holds no tokenizer (lerobot saves none; its pre-processor names "
                        f"{name or 'PaliGemma'}'s), and no local copy of {name or 'it'} is in the Hugging Face cache. "
                        "Put the tokenizer's files (tokenizer.json or tokenizer.model, with tokenizer_config.json) in "
                        "the checkpoint directory, or set policy.pi.tokenizer_path to a local copy; nothing is "
                        "downloaded at run time.")
    if not load:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"the tokenizer in {where} does not load ({str(err).splitlines()[0]}). Point "
                        "policy.pi.tokenizer_path at a directory holding PaliGemma's tokenizer files.") from None

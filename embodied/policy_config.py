"""The ``policy`` section of the schema: the keys every policy reads, and one section per family.

A policy reads ``policy.name``, ``policy.chunk_size`` and ``policy.temperature``, and the sections of
its family (its class's ``config_sections`` in policies/): ``policy.net`` for the small networks
trained from scratch (mlp, cnn, mlp_tokens), ``policy.vla`` for vision-language-action models
(openvla, openvla_oft, qwen_vl), ``policy.flow`` for flow-matching action heads (mlp_flow, with
``policy.net``). A run that sets keys of another family's section is refused before
any worker starts (``policies.registry.check_policy_config``), so ``policy=mlp
policy.vla.lora_rank=8`` is an error, not a setting nobody reads.

Configs saved before the sections existed (a run's config.yaml, a checkpoint's ``config_yaml``)
wrote these keys flat (``policy.model_path``); :func:`upgrade_saved_policy` moves them into their
sections when such a config is loaded. On the command line the old spelling is an error naming the
new one (:func:`moved_policy_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from omegaconf import DictConfig

from embodied.config_ranges import ranged


@dataclass
class NetConfig:
    """``policy.net``: small networks trained from scratch (policies/mlp.py, cnn.py, mlp_tokens.py)."""

    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256, 256])
    activation: str = "tanh"
    log_std_init: float = ranged(-0.5)  # initial log std of the Gaussian action distribution (any value)
    cnn_channels: list[int] = field(default_factory=lambda: [32, 64, 64])  # cnn only
    feature_dim: int = ranged(256, 1)  # cnn only: image embedding size
    # mlp_tokens only: how the trunk gives the 256 bin logits of each action token (policies/mlp_tokens.py):
    # "gaussian" (a Gaussian's log-density at the bins: learns from scratch as policy=mlp does) or
    # "logits" (free, as a VLA's LM head: from scratch, far slower; docs/results/rl_from_scratch)
    token_head: str = "gaussian"
    num_q: int = ranged(2, 1)  # mlp_sac only: Q critics; SAC's target takes the smallest of them
    q_layer_norm: bool = True  # mlp_sac only: LayerNorm after each hidden layer of the critics (RLPD, ManiSkill's SAC)


@dataclass
class VLAConfig:
    """``policy.vla``: vision-language-action models (policies/vla/)."""

    model_path: str | None = None  # a save_pretrained directory (model + tokenizer); None: a tiny model from scratch
    # the weights' dtype once loaded: float32 | bfloat16; null: a pi0 checkpoint's config.json dtype, else float32
    dtype: str | None = None
    # the vision backbones' input size; null: an OpenVLA / OFT checkpoint's (config.json image_sizes), else 64
    image_size: int | None = ranged(None, 1)
    instruction: str = ""  # the language instruction where the env gives none (ManiSkill tasks)
    lora_rank: int = ranged(0, 0)  # > 0: train LoRA adapters of this rank (peft) and the value head; the rest is frozen
    unnorm_key: str | None = None  # OpenVLA checkpoints: whose norm_stats un-normalise actions (optional if one)
    # which statistics map actions (and OFT's proprio) to [-1, 1], upstream's NormalizationType:
    # bounds_q99 (q01 / q99: OpenVLA; OFT on LIBERO, Bridge) or bounds (min / max: OFT on ALOHA). Checkpoints do
    # not record it (OFT's constants.py picks it per robot platform); the run log says which was used
    normalization: str = "bounds_q99"
    backend: str = "hf"  # rollout generation: hf (transformers, KV cache) or vllm (GPU, Qwen-VL only)
    proprio: bool = False  # openvla_oft: feed the env's `state` (proprioception) as one more input token
    cameras: list[str] = field(default_factory=lambda: ["rgb"])  # images fed in order (OFT: + wrist_rgb)
    stop_token: bool = True  # openvla_oft: a STOP token after the action placeholders (OFT, SimpleVLA-RL; RLinf: false)
    # how the checkpoint family wants inputs and actions (policies/vla/adapters.py; each published
    # family's values: docs/vla_checkpoints.md and its configs/policy/*.yaml)
    mirror_images: bool = False  # mirror frames left-right (LIBERO-trained OpenVLA/OFT: raw frame rotated 180 deg)
    # JPEG round trip + lanczos3 resize to this size first (their RLDS data: 224)
    dataset_resize: int | None = ranged(None, 1)
    # keep this central fraction of the area, resized back (random-crop training: 0.9)
    center_crop: float | None = ranged(None, 0, 1, above=True)
    gripper: str = "none"  # the last action dim: none | libero ([0, 1] -> [-1, 1], binarise, invert)
    # the camera images the checkpoint was trained on: their size (env.image_size) and LIBERO rendering
    # (env.rendering). A public-checkpoint config sets both, and the env settings its authors use; a run whose
    # env renders other images is refused, not resized behind the user's back. None: any
    camera_size: int | None = ranged(None, 8)
    camera_rendering: str | None = None


@dataclass
class FlowConfig:
    """``policy.flow``: flow-matching action heads (policies/flow_policy.py: mlp_flow), which integrate an
    action chunk from Gaussian noise over denoising steps, and how RL gets log-probabilities from that chain."""

    # how a training rollout's chain gets a log-probability (policies/flow_policy.py, FLOW_METHODS):
    # "sde" (Flow-SDE: one denoising step per sample is a Gaussian step of the SDE with the ODE's marginals,
    # the others ODE steps; log pi = that step's log-density) or "noise" (Flow-Noise: every step adds noise of
    # a learned std; log pi = the mean of the initial noise's and every step's log-densities)
    method: str = "sde"
    steps: int = ranged(4, 1)  # denoising steps K of training rollouts (and of the update's re-scoring)
    # denoising steps of evaluations (all ODE); None: steps. More than steps is Flow-GRPO's denoising reduction
    eval_steps: int | None = ranged(None, 1)
    noise_level: float = ranged(0.5, 0, above=True)  # Flow-SDE's a in sigma_t = a * sqrt(t / (1 - t))
    # Flow-SDE: which denoising step (0 .. steps - 1, from the noise) is stochastic; None: one drawn per sample
    sde_step: int | None = ranged(None, 0)
    # Flow-Noise: the learned noise std's bounds (a sigmoid between them)
    noise_min: float = ranged(0.08, 0, above=True)
    noise_max: float = ranged(0.16, 0, above=True)
    # which modules RL and SFT train: "all", or "expert" (the flow head alone: velocity and noise nets; the
    # trunk that encodes observations is frozen). The critic always trains
    train: str = "all"


@dataclass
class PiConfig:
    """``policy.pi``: pi0 and pi0.5 (policies/pi0/), read with ``policy.vla`` (``model_path``: a checkpoint
    directory in lerobot's or openpi's layout; ``cameras``: the env's images in the checkpoint's camera order;
    ``instruction``) and ``policy.flow`` (the chain RL samples; ``eval_steps``: the checkpoint's 10 Euler steps)."""

    variant: str = "pi0"  # a tiny network from scratch (vla.model_path null): pi0 | pi05 (a checkpoint says its own)
    # a local PaliGemma tokenizer directory (AutoTokenizer); null: the tokenizer saved in the checkpoint directory,
    # else a local copy in the Hugging Face cache of the one its pre-processor names (nothing is downloaded); a tiny
    # network from scratch: a byte-level one
    tokenizer_path: str | None = None
    # an openpi checkpoint's norm_stats.json; null: the one under policy.vla.model_path (lerobot's: its processor files)
    norm_stats: str | None = None
    # SigLIP's head size, which a checkpoint's tensors do not show; null: its tiny_overrides.json's where it has one
    # (tiny checkpoints built with other sizes), else so400m's 72 (every public checkpoint's)
    vision_head_dim: int | None = ranged(None, 1)
    # prompt tokens, right-padded; null: the checkpoint's tokenizer_max_length (pi0 48, pi0.5 200), 48 without one
    max_tokens: int | None = ranged(None, 1)
    # the size camera frames are resized (with padding) to for SigLIP; null: the checkpoint's image_resolution
    # (openpi's: 224), 56 for a tiny network. SigLIP's patches floor what the patch size does not divide
    image_size: int | None = ranged(None, 8)
    # pi0.5: the state's 256 bins in the prompt (lerobot's pi05; openpi's own with discrete_state_input); false:
    # openpi's pi05_libero, whose prompt is the cleaned task and a newline and which reads no state
    state_prompt: bool = True
    # how camera frames reach the vision size: "lerobot" (bilinear on floats, no antialiasing: lerobot's
    # resize_with_pad_torch) or "openpi" (PIL's bilinear on uint8, antialiased: openpi's LIBERO client)
    resize: str = "lerobot"
    # the first this many action dims are offsets from the state the chunk was planned on (openpi's pi0_libero,
    # extra_delta_transform: 6, the end-effector pose; the gripper stays absolute); 0: absolute actions
    delta_actions: int = ranged(0, 0)


@dataclass
class PolicyConfig:
    name: str = "mlp"  # registered in policies/registry.py
    # a checkpoint directory, as lerobot-eval's --policy.path (every VLA family; the same as policy.vla.model_path)
    path: str | None = None
    # actions per decision (an action chunk, executed open loop by the env worker; policies that chunk); null: the
    # policy's own (a pi0 checkpoint's n_action_steps, 4 for a tiny pi0, else 1)
    chunk_size: int | None = ranged(None, 1)
    # action-token sampling temperature in training rollouts (token policies; evaluation is greedy)
    temperature: float = ranged(1.0, 0, above=True)
    net: NetConfig = field(default_factory=NetConfig)
    vla: VLAConfig = field(default_factory=VLAConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    pi: PiConfig = field(default_factory=PiConfig)


SECTIONS = {"net": NetConfig, "vla": VLAConfig}  # the sections of the former flat keys
# a key of the former flat policy section -> its section now
MOVED = {key.name: section for section, schema in SECTIONS.items() for key in fields(schema)}


def moved_policy_key(dotted: str) -> str | None:
    """``policy.model_path`` -> ``policy.vla.model_path``: the key's place since the sections; None
    for a key that never was a flat policy key."""
    parts = dotted.split(".")
    if len(parts) == 2 and parts[0] == "policy" and parts[1] in MOVED:
        return f"policy.{MOVED[parts[1]]}.{parts[1]}"
    return None


def upgrade_saved_policy(raw: DictConfig) -> DictConfig:
    """A saved config (in place) with its flat policy keys moved into their sections."""
    policy = raw.get("policy") if isinstance(raw, DictConfig) else None
    if not isinstance(policy, DictConfig):
        return raw
    for key in [k for k in policy if k in MOVED]:
        section = MOVED[key]
        if section not in policy:
            policy[section] = {}
        policy[section][key] = policy.pop(key)
    return raw


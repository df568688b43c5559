"""Headless rendering for SAPIEN (and MuJoCo's EGL) on machines without a GPU.

SAPIEN needs a Vulkan device even for state observations. Debian 12's own
lavapipe (Mesa 22.3) lacks a feature SAPIEN needs; Mesa 25 lavapipe from
bookworm-backports works. :func:`install_lavapipe` unpacks it into a folder of
the environment (no system-wide Mesa upgrade) and writes a Vulkan ICD file;
:func:`ensure_vulkan_icd` points ``VK_ICD_FILENAMES`` at it before SAPIEN starts. MuJoCo (LIBERO,
MetaWorld) renders through EGL with the system's Mesa; :func:`install_egl` installs it where it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PACKAGES = ("mesa-vulkan-drivers", "mesa-libgallium")
EGL_PACKAGES = ("libegl1", "libegl-mesa0", "libgl1-mesa-dri")  # MuJoCo's MUJOCO_GL=egl on a CPU (Mesa llvmpipe)
APT_SOURCE = Path("/etc/apt/sources.list.d/embodied-rl-backports.sources")


def lavapipe_dir() -> Path:
    """Where the unpacked lavapipe lives (inside the active Python environment)."""
    return Path(os.environ.get("EMBODIED_LAVAPIPE_DIR", Path(sys.prefix) / "share" / "embodied-rl-lavapipe"))


def icd_file() -> Path:
    return lavapipe_dir() / "lvp_icd.json"


def ensure_vulkan_icd() -> None:
    """Use our lavapipe unless the user chose a Vulkan driver or has a GPU."""
    if "VK_ICD_FILENAMES" in os.environ or _has_cuda():
        return
    if icd_file().exists():
        os.environ["VK_ICD_FILENAMES"] = str(icd_file())


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _debian_mirror() -> tuple[str, str]:
    """(mirror URI, codename) of the system's main Debian source."""
    codename = ""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            codename = line.split("=", 1)[1].strip('"')
    candidates = [*Path("/etc/apt/sources.list.d").glob("*.sources")]
    for path in candidates:
        uri = ""
        for line in path.read_text().splitlines():
            if line.startswith("URIs:"):
                uri = line.split(":", 1)[1].split()[0]
            if line.startswith("Suites:") and codename in line.split() and uri:
                return uri, codename
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == codename:
                return parts[1], codename
    raise RuntimeError(
        "Could not find the system's Debian apt source to derive a backports source from. "
        "Install Mesa >= 23 lavapipe (package mesa-vulkan-drivers) yourself and set "
        "VK_ICD_FILENAMES to its lvp_icd json."
    )


def install_lavapipe(verbose: bool = True) -> Path:
    """Download Mesa lavapipe from backports and unpack it; returns the ICD file. Idempotent."""
    if icd_file().exists():
        return icd_file()
    if os.geteuid() != 0:
        raise PermissionError(
            "Installing lavapipe needs apt (root). Run `sudo embodied setup-render`, or install "
            "Mesa >= 23 mesa-vulkan-drivers system-wide."
        )
    mirror, codename = _debian_mirror()
    if not APT_SOURCE.exists():
        APT_SOURCE.write_text(
            f"Types: deb\nURIs: {mirror}\nSuites: {codename}-backports\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        )
    out = lavapipe_dir()
    debs = out / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    os.chmod(debs, 0o777)  # apt downloads as the unprivileged _apt user
    run = dict(check=True, stdout=None if verbose else subprocess.DEVNULL)
    subprocess.run(["apt-get", "update", "-qq"], **run)
    subprocess.run(["apt-get", "download", "-qq", "-t", f"{codename}-backports", *PACKAGES], cwd=debs, **run)
    for deb in debs.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(out / "root")], **run)
    library = next((out / "root").rglob("libvulkan_lvp.so"))
    icd = {"file_format_version": "1.0.0", "ICD": {"library_path": str(library), "api_version": "1.3.0"}}
    icd_file().write_text(json.dumps(icd, indent=1))
    return icd_file()


def install_egl(verbose: bool = True) -> str:
    """apt-get install the EGL libraries and Mesa's software driver MuJoCo renders with (root only)."""
    if os.geteuid() != 0:
        raise PermissionError(f"Installing EGL needs apt (root): run `sudo apt-get install {' '.join(EGL_PACKAGES)}`.")
    run = dict(check=True, stdout=None if verbose else subprocess.DEVNULL)
    subprocess.run(["apt-get", "update", "-qq"], **run)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *EGL_PACKAGES], **run)
    return ", ".join(EGL_PACKAGES)


_PROBE = """
import numpy as np
from envs.rendering import ensure_vulkan_icd
ensure_vulkan_icd()
import gymnasium as gym, mani_skill.envs
env = gym.make("PushCube-v1", obs_mode="rgb", sim_backend="physx_cpu", render_backend="cpu",
               sensor_configs=dict(width=64, height=64))
obs, _ = env.reset(seed=0)
img = next(iter(obs["sensor_data"].values()))["rgb"][0].cpu().numpy()
print("FRAME", img.shape[0], img.shape[1], float(img.std()))
"""


def check_render(timeout_s: float = 180.0) -> tuple[bool, str]:
    """Render one camera frame in a fresh process; returns (works, message)."""
    fix = (
        "Fix: run `make setup` (or `embodied setup-render` as root), which unpacks Mesa 25 "
        "lavapipe from Debian bookworm-backports into the environment and sets VK_ICD_FILENAMES; "
        "on other systems install a Vulkan driver (Mesa >= 23 `mesa-vulkan-drivers`, or a GPU "
        "driver) and point VK_ICD_FILENAMES at its ICD json."
    )
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout_s, cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return False, f"Rendering did not finish within {timeout_s:.0f} s. {fix}"
    frame = [line for line in proc.stdout.splitlines() if line.startswith("FRAME")]
    driver = os.environ.get("VK_ICD_FILENAMES") or (str(icd_file()) if icd_file().exists() else "system default")
    if proc.returncode != 0 or not frame:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return False, f"Rendering does not work here (Vulkan ICD: {driver}).\n{tail}\n{fix}"
    _, h, w, std = frame[0].split()
    if float(std) == 0.0:
        return False, f"Rendering ran but produced a blank {h}x{w} frame (Vulkan ICD: {driver}). {fix}"
    return True, (f"Rendering works: a {h}x{w} camera frame rendered (pixel std {float(std):.1f}) with Vulkan "
                  f"ICD {driver}.")

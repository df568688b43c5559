"""Patch known mistakes back into a copy of the code, one at a time, and list the tests that catch each.

Each mistake is one a loader once made or could make (issue 36's list among them): the parity and
bad-input tests must fail on every one. The copy is a throwaway git worktree of HEAD, so the
working tree is never touched; the project's venv runs the tests.

Usage: ``.venv/bin/python benchmarks/reference/mistakes.py [substring of a mistake's name ...]``
(about a minute per mistake on 2 cores).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = ["tests/test_reference_parity.py", "tests/test_reference_options.py", "tests/test_cli_errors.py",
         "tests/test_instructions.py"]
# name -> (file, the correct code, the mistake)
MISTAKES = {
    "proprio mask ignored (every dimension normalised)": (
        "policies/vla/oft.py", "return self.proprio_stats.normalize(state.double())",
        "return ActionStats(self.proprio_stats.low, self.proprio_stats.high, "
        "torch.ones_like(self.proprio_stats.normalize_mask)).normalize(state.double())"),
    "always q01 / q99 (min / max bounds ignored)": (
        "policies/vla/checkpoint.py", "low_key, high_key = NORMALIZATIONS[normalization]",
        'low_key, high_key = NORMALIZATIONS["bounds_q99"]'),
    "single backbone built with the fused projector": (
        "policies/vla/openvla.py", "fused=config.use_fused_vision_backbone)", "fused=True)"),
    "weights that do not fit reported as an incomplete copy": (
        "policies/vla/policy.py", 'f"config.json describes: {problems}. config.json',
        'f"config.json describes: is it a complete copy? {problems}. config.json'),
    "letterbox padding not applied": (
        "policies/vla/processor.py", "        if self.letterbox_fill is not None:\n            image = letterbox",
        "        if False:\n            image = letterbox"),
    "checkpoint read only when the workers build the policy": (
        "policies/vla/policy.py", "        if not cfg.vla.model_path:\n            if cfg.vla.image_size < TINY_PATCH:",
        "        if True:\n            if cfg.vla.image_size < TINY_PATCH:"),
    "a policy worker's crash points at the renderer": (
        "embodied/cli.py", '    if "EnvWorker" in report:', "    if True:"),
    "instructions cut at 128 bytes": ("envs/base.py", "    data = text.encode()\n", "    data = text.encode()[:128]\n"),
}


def caught_by(worktree: Path, path: str, correct: str, mistake: str) -> list[str]:
    """The tests that fail with ``mistake`` in place of ``correct`` in ``path``."""
    file = worktree / path
    original = file.read_text()
    if original.count(correct) != 1:
        raise SystemExit(f"{path} no longer holds exactly one {correct!r}: update MISTAKES")
    file.write_text(original.replace(correct, mistake))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-q", "-rfE", "-p", "no:cacheprovider"],
                              cwd=worktree, capture_output=True, text=True)
    finally:
        file.write_text(original)
    return [line.split(" ")[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]


def main() -> int:
    wanted = sys.argv[1:]
    worktree = Path(tempfile.mkdtemp(prefix="mistakes-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), "HEAD"], cwd=REPO, check=True)
    uncaught = []
    try:
        for name, (path, correct, mistake) in MISTAKES.items():
            if wanted and not any(w in name for w in wanted):
                continue
            failing = caught_by(worktree, path, correct, mistake)
            print(f"{name}: {len(failing)} tests fail", flush=True)
            for test in failing:
                print(f"    {test}")
            if not failing:
                uncaught.append(name)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    print("every mistake is caught" if not uncaught else f"NOT caught: {uncaught}")
    return 1 if uncaught else 0


if __name__ == "__main__":
    sys.exit(main())

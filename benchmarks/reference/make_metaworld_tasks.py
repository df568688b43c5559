"""Regenerate assets/metaworld/tasks.json: MetaWorld's task lists and each task's language instruction.

The task lists (MT10's and MT50's, in the benchmark's order) come from the installed ``metaworld``; the
instructions from lerobot's ``metaworld_config.json`` (TASK_DESCRIPTIONS), which the published
SmolVLA / pi0 MetaWorld checkpoints were trained and evaluated with (RLinf's copy is identical). Run in the
MetaWorld interpreter, with a lerobot checkout (github:huggingface/lerobot, src/lerobot/envs/):

    .venv-metaworld/bin/python benchmarks/reference/make_metaworld_tasks.py \\
        <lerobot>/src/lerobot/envs/metaworld_config.json assets/metaworld/tasks.json
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

import metaworld


def main(lerobot_config: str, out: str) -> None:
    descriptions = json.load(open(lerobot_config))["TASK_DESCRIPTIONS"]
    mt10 = list(metaworld.MT10(seed=0).train_classes)
    mt50 = list(metaworld.MT50(seed=0).train_classes)
    missing = sorted(set(mt50) - set(descriptions))
    if missing:
        raise SystemExit(f"no instruction for {missing}")
    tasks = {
        "metaworld_version": version("metaworld"),
        "instructions_from": "lerobot src/lerobot/envs/metaworld_config.json TASK_DESCRIPTIONS",
        "mt10": mt10,
        "mt50": mt50,
        "instructions": {name: descriptions[name] for name in mt50},
    }
    with open(out, "w") as f:
        json.dump(tasks, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])

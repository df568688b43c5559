"""Export a run's checkpoint as a small warm-start file: the policy's weights and what
``embodied train checkpoint=<file>`` / ``embodied eval checkpoint=<file>`` read (its config,
observation spec and action size); no optimizer state, no KL reference.

    python benchmarks/export_policy.py RUN_DIR_OR_CKPT OUT.pt

``assets/policies/pushcube_state_mlp.pt`` was made this way from
``embodied train runner.max_minutes=6 runner.run_dir=R`` (PushCube-v1 from state, seed 1,
final eval success_once 0.93 on this 2-core machine), for tests whose episodes must push the
cube from their first step (tests/test_eval_exact.py).
"""

from __future__ import annotations

import argparse

import torch

from embodied.checkpoint import Progress, checkpoint_state, load_checkpoint


def export(source: str, out: str) -> None:
    state = load_checkpoint(source)
    small = checkpoint_state({"policy": state["actor"]["policy"]}, Progress(**state["progress"]), state["config_yaml"],
                             state["obs_spec"], state["action_dim"])
    torch.save(small, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a run directory or a checkpoint file")
    parser.add_argument("out", help="the .pt file to write")
    args = parser.parse_args()
    export(args.source, args.out)

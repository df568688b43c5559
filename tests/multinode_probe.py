"""Run by tests/test_multinode.py in its own process: join the two-node cluster at argv[1],
train a few iterations with the placement overrides in argv[3:], and print as JSON which
node (by its custom resource) each worker group ran on, plus the run's eval summary."""

import json
import sys
from pathlib import Path

import ray

from embodied.config import compose
from embodied.trainer import Trainer
from tests.conftest import SMALL_OVERRIDES


def main(address: str, run_dir: str, overrides: list[str]) -> None:
    cfg = compose([*SMALL_OVERRIDES, f"ray.address={address}", f"runner.run_dir={run_dir}", *overrides])
    trainer = Trainer(cfg, Path(run_dir))
    try:
        summary = trainer.train()
        resource_of = {n["NodeID"]: [r for r in n["Resources"] if r.startswith("node_")][0]
                       for n in ray.nodes() if n["Alive"]}
        groups = {name: [resource_of[node] for node in getattr(trainer.workers, name).call("node_id")]
                  for name in ("env", "rollout", "actor")}
        print(json.dumps({"groups": groups, "weight_sync": trainer.workers.plan.weight_sync,
                          "episodes": summary["episodes"], "env_steps": summary["training"]["env_steps"]}))
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

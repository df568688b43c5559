"""Supervised warm start: a policy with a demo loss (a token VLA, a flow-matching policy) learns the
motion planner's demonstrations.

Read top to bottom: record (or load the cached) demos, then ``sft.epochs`` epochs of
minibatches of the policy's demo loss (token policies: cross-entropy over the demo actions' tokens;
flow-matching policies: the flow-matching loss; ``embodied/algorithms/sft.py``), in this process or on
``placement.actor_workers`` data-parallel ranks, then a checkpoint in the format ``train``
(``checkpoint=`` warm start), ``eval`` and ``record`` read.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from embodied.algorithms.sft import SftTrainer, chunk_targets, seeded_policy
from embodied.checkpoint import Progress, checkpoint_state, save_checkpoint
from embodied.config import TrainConfig, to_yaml
from embodied.run_logger import RunLogger
from embodied.workers.sft_worker import SftWorker
from envs.common import UserError
from envs.demos import Demos, generate_demos
from envs.registry import env_action_dim
from policies.base import POLICIES
from policies.registry import check_policy_config
from policies.vla.action_tokenizer import ActionStats
from scheduler.placement import make_plan
from scheduler.runtime.cluster import cluster_devices, start_cluster
from scheduler.runtime.worker import WorkerGroup


def demos_for(cfg: TrainConfig, progress: bool) -> Demos:
    """The run's demos from the cache, or recorded now and cached."""
    e, s = cfg.env, cfg.sft
    # v2: demos with rewards, success flags and next observations (RLPD); older caches lack them
    name = f"{e.task}-{e.obs_mode}{e.image_size}-{s.demos}demos-seed{s.demo_seed}-v2.pt"
    path = Path(s.demos_dir) / name
    if path.exists():
        return Demos.load(path)
    demos = generate_demos(e, s.demos, s.demo_seed, progress=progress)
    demos.save(path)
    return demos


class SftRanks:
    """``placement.actor_workers`` SFT ranks (Ray actors on the actor group's devices, one process
    group, data-parallel as ``placement.data_parallel`` says): the same :meth:`epoch` and
    :meth:`state` as one in-process :class:`SftTrainer`."""

    def __init__(self, cfg: TrainConfig, obs_spec: dict, action_dim: int, action_stats: ActionStats):
        import ray

        start_cluster(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.num_gpus)
        plan = make_plan(cfg.placement, cluster_devices(), num_envs=cfg.env.num_envs)
        self.ranks = WorkerGroup(SftWorker, "actor", plan, cfg.placement.torch_threads, policy_cfg=cfg.policy,
                                 sft_cfg=cfg.sft, obs_spec=obs_spec, action_dim=action_dim,
                                 action_stats=action_stats, seed=cfg.runner.seed)
        address = ray.get(self.ranks.workers[0].group_address.remote())
        self.strategy = self.ranks.call("start", address, cfg.placement.data_parallel,
                                        cfg.placement.fsdp_from_parameters)[0]
        self._demos: tuple | None = None

    def epoch(self, obs: dict[str, torch.Tensor], targets: torch.Tensor, advance) -> dict[str, float]:
        import ray

        if self._demos is None:  # into the object store once: every epoch and rank reads the same copy
            self._demos = (ray.put(obs), ray.put(targets))
        stats = self.ranks.call("epoch", *self._demos)[0]  # every rank's are the same
        advance(len(targets))
        return stats

    def state(self) -> dict:
        return self.ranks.call("state")[0]

    def shutdown(self) -> None:
        self.ranks.shutdown()


def train_sft(cfg: TrainConfig, run_dir: Path) -> dict:
    """Warm-start ``cfg.policy`` on demos of ``cfg.env.task`` (in this process, or on
    ``placement.actor_workers`` data-parallel ranks); returns the last epoch's statistics."""
    check_policy_config(cfg.policy, env_action_dim(cfg.env))
    if not POLICIES.get(cfg.policy.name).demo_statistics:
        raise UserError(f"embodied sft trains policies with a demo loss (token policies: VLAs, mlp_tokens; "
                        f"flow-matching policies: mlp_flow): policy={cfg.policy.name} has none. Use "
                        "policy=openvla_tiny, policy=qwen_vl_tiny or policy=mlp_flow (or a real VLA config).")
    demos = demos_for(cfg, cfg.runner.progress)
    obs_spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in demos.obs.items()}
    action_dim, action_stats = demos.actions.shape[-1], ActionStats.from_actions(demos.actions)
    if cfg.placement.actor_workers > 1:
        trainer = SftRanks(cfg, obs_spec, action_dim, action_stats)
    else:
        policy = seeded_policy(cfg.policy, obs_spec, action_dim, action_stats, cfg.runner.seed)
        trainer = SftTrainer(policy, cfg.sft, cfg.runner.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    log = RunLogger(run_dir, cfg.sft.epochs * len(demos), progress=cfg.runner.progress)
    log.note("sft", f"{len(demos)} steps from {len(demos.seeds)} demos of {demos.task} ('{demos.instruction}')"
             + (f" on {cfg.placement.actor_workers} ranks ({trainer.strategy})" if isinstance(trainer, SftRanks)
                else ""))
    targets = chunk_targets(demos.actions, demos.episode, cfg.policy.chunk_size)
    try:
        stats: dict[str, float] = {}
        for epoch in range(cfg.sft.epochs):
            stats = {f"sft/{k}": v for k, v in trainer.epoch(demos.obs, targets, log.advance).items()}
            log.scalars(stats, (epoch + 1) * len(demos))
        actor = trainer.state()
    finally:
        log.close()
        if isinstance(trainer, SftRanks):
            trainer.shutdown()
    # RL has not started (Progress at zero): `train checkpoint=` warm-starts from here
    state = checkpoint_state(actor, Progress(), to_yaml(cfg), obs_spec, action_dim,
                             sft={**stats, "demos": len(demos.seeds), "steps": len(demos), **asdict(cfg.sft)})
    save_checkpoint(run_dir, 0, state, keep=cfg.runner.keep_checkpoints)
    return state["sft"]

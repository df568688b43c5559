"""Data-parallel actor ranks (scheduler/runtime/data_parallel.py): one update on 2 ranks (real Ray
actors in a gloo process group) gives the weights of the same update on 1 rank, replicated or
sharded with FSDP2, for PPO on the MLP and GRPO on the tiny VLA with LoRA and a KL penalty."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied.algorithms.ppo import sample_owners
from embodied.config import compose
from envs.messages import Trajectory
from scheduler.runtime.layout import BatchLayout

STATE_SPEC = {"state": ((7,), torch.float32)}
VLA_SPEC = {"rgb": ((32, 32, 3), torch.uint8), "state": ((9,), torch.float32)}


# -- pure logic ------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sample_owners_index_each_ranks_own_flattened_envs(ranks: int):
    g = torch.Generator().manual_seed(ranks)
    T, B = 5, 8
    valid = torch.rand(T, B, generator=g) > 0.3
    marks = torch.arange(T * B).view(T, B)  # each sample's own id
    owner, local = sample_owners(valid, B // ranks)
    expected = marks[valid]  # flatten_time's order
    for rank in range(ranks):
        block = marks[:, rank * (B // ranks):(rank + 1) * (B // ranks)].flatten()
        mine = owner == rank
        assert torch.equal(block[local[mine]], expected[mine])
    assert sorted(owner.unique().tolist()) == sorted(set(owner.tolist())) and len(owner) == int(valid.sum())


@pytest.mark.parametrize(("num_envs", "env_workers", "stages", "rollout", "actor"),
                         [(8, 2, 1, 1, 2), (8, 2, 2, 2, 2), (12, 3, 1, 2, 3), (16, 4, 2, 3, 4), (8, 4, 1, 4, 1)])
def test_actor_shares_cover_the_concatenated_batch_in_equal_blocks(num_envs, env_workers, stages, rollout, actor):
    layout = BatchLayout(num_envs, env_workers, stages)
    widths = [len(layout.streams(k, rollout)) * layout.stage_size for k in range(rollout)]
    columns = torch.arange(num_envs).split(widths)  # the rollout workers' trajectories, joined in order
    got = []
    for ranks, envs in layout.actor_shares(rollout, actor):
        block = torch.cat([columns[k] for k in ranks])[envs]
        assert len(block) == num_envs // actor
        got.append(block)
    assert torch.equal(torch.cat(got), torch.arange(num_envs))


# -- one update on 1 rank and on 2 ------------------------------------------------------------
def _trajectory(policy, spec: dict, T: int, B: int, episodic: bool, seed: int = 0) -> Trajectory:
    """A batch the policy itself sampled on random observations; ``episodic``: every env's
    first episode ends within ``T`` steps, scored 0 or 1 (GRPO)."""
    g = torch.Generator().manual_seed(seed)
    obs = {}
    for key, (shape, dtype) in spec.items():
        obs[key] = (torch.randint(0, 256, (T, B, *shape), generator=g, dtype=dtype) if dtype == torch.uint8
                    else torch.randn(T, B, *shape, generator=g))
    with torch.no_grad():
        acted = [policy.act({k: v[t] for k, v in obs.items()}) for t in range(T)]
    actions, logprobs, values = (torch.stack([a[i] for a in acted]) for i in range(3))
    dones = torch.rand(T, B, generator=g) < 0.2
    if episodic:
        dones[-1] = True
    rewards = (torch.rand(T, B, generator=g) < 0.5).float() * dones if episodic else torch.randn(T, B, generator=g)
    return Trajectory(obs, actions, logprobs, values, rewards, dones, torch.randn(B, generator=g))


def _actors(ray, cfg, spec: dict, world: int, strategy: str) -> list:
    from embodied.workers.actor_worker import ActorWorker

    remote = ray.remote(ActorWorker)
    actors = [remote.options(num_cpus=0).remote(cfg.policy, cfg.algorithm, spec, 4, seed=3, rank=r, world_size=world)
              for r in range(world)]
    if world > 1:
        address = ray.get(actors[0].group_address.remote())
        joined = [a.join_data_parallel.remote(address, strategy, cfg.placement.fsdp_from_parameters) for a in actors]
        assert ray.get(joined) == [strategy] * world
    ray.get([a.freeze_reference.remote() for a in actors])
    return actors


def _update(ray, actors: list, batch: Trajectory) -> tuple[dict, dict]:
    world = len(actors)
    share = batch.num_envs // world
    stats = ray.get([a.update.remote(slice(r * share, (r + 1) * share), batch) for r, a in enumerate(actors)])
    assert all(s == stats[0] for s in stats), "the ranks disagree on the statistics"
    return stats[0], ray.get([a.get_weights.remote() for a in actors])[0]  # FSDP gathers: every rank


CASES = {
    "ppo-mlp": ([], STATE_SPEC, 6, 8, False),
    # pi0 sharded by decoder layer (both Gemma stacks, SigLIP); Flow-SDE's chain re-scored on each rank
    "ppo-pi0": (["policy=pi0_tiny", "policy.chunk_size=2", "algorithm.num_minibatches=2"], VLA_SPEC, 2, 4, False),
    "grpo-vla-lora": (["algorithm=grpo", "policy=openvla_tiny", "policy.vla.image_size=32", "policy.vla.lora_rank=4",
                       "policy.vla.instruction=push", "algorithm.kl_coef=0.05", "algorithm.group_size=2",
                       "algorithm.num_minibatches=3"], VLA_SPEC, 4, 4, True),
}

# pi0: 37 s; the MLP: 18 s, and grpo-vla-lora's ranks split minibatches, all-reduce and shard the same way
SLOW_CASES = ("ppo-pi0", "ppo-mlp")


# replicate is the simpler strategy (a gradient all-reduce); the default run checks FSDP, which shards too
@pytest.mark.parametrize("strategy", [pytest.param("replicate", marks=pytest.mark.slow), "fsdp"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_one_update_on_two_ranks_gives_the_weights_of_one_rank(ray_cluster, case: str, strategy: str):
    import ray

    from policies.registry import make_policy

    overrides, spec, T, B, episodic = CASES[case]
    cfg = compose([*overrides, "algorithm.update_epochs=2", "algorithm.target_kl=10.0"])
    torch.manual_seed(0)
    batch = _trajectory(make_policy(cfg.policy, spec, 4).eval(), spec, T, B, episodic)
    one = _actors(ray, cfg, spec, 1, strategy)
    two = _actors(ray, cfg, spec, 2, strategy)
    try:
        start = ray.get(one[0].get_weights.remote())
        start = {k: v.clone() for k, v in start.items()}
        stats_one, after_one = _update(ray, one, batch)
        _offload_and_onload(ray, two)  # context switching: each rank parks its shard, then trains on it again
        stats_two, after_two = _update(ray, two, batch)
        trained = ray.get([a.state.remote() for a in two])[0]
        assert all(moved > 0 for moved in _offload_and_onload(ray, two))  # ... with Adam moments now
        assert_same_state(ray.get([a.state.remote() for a in two])[0], trained)
        # a checkpoint of one rank loads on two (whole state in, whole state out)
        state = ray.get(one[0].state.remote())
        ray.get([a.load_state.remote(state) for a in two])
        reloaded = ray.get([a.state.remote() for a in two])[0]
    finally:
        for actor in one + two:
            ray.kill(actor)
    moved = max((after_one[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4, "the update changed nothing: the comparison would prove nothing"
    for key in after_one:
        torch.testing.assert_close(after_two[key], after_one[key], atol=1e-6, rtol=0, msg=key)
    assert_same_state(reloaded, state)
    assert stats_two["samples"] == stats_one["samples"] and stats_two["epochs"] == stats_one["epochs"]
    for key in ("approx_kl", "grad_norm", "policy_loss"):
        assert stats_two[key] == pytest.approx(stats_one[key], rel=1e-4, abs=1e-6), key


def _offload_and_onload(ray, actors: list) -> list[int]:
    """Every rank parks its state, then brings it back; the bytes each parked."""
    moved = ray.get([a.offload.remote() for a in actors])
    ray.get([a.onload.remote() for a in actors])
    return [m["bytes_moved"] for m in moved]


def assert_same_state(got: dict, expected: dict) -> None:
    """Two whole actor states hold the same weights and Adam moments, bit for bit."""
    assert got["policy"].keys() == expected["policy"].keys()
    for key, value in expected["policy"].items():
        assert torch.equal(got["policy"][key], value), key
    assert got["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for index, moments in expected["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["optimizer"]["state"][index][name], moments[name]), (index, name)


# -- the runner with two actor ranks ---------------------------------------------------------
def _first_iteration(cfg, run_dir) -> tuple[dict, dict]:
    """Weights after one training iteration of ``cfg``, and the actor's whole state."""
    from embodied.trainer import Trainer

    trainer = Trainer(cfg, run_dir)
    try:
        trainer._reset_envs()
        trainer._iterate()
        return trainer.workers.actor.call("get_weights")[0], trainer.workers.actor_state()
    finally:
        trainer.close()


@pytest.mark.slow  # 44 s; one update on two FSDP ranks equals one rank in the default run (above)
def test_a_run_on_two_fsdp_ranks_trains_as_one_rank_and_its_checkpoint_loads_on_one(ray_cluster, tmp_path):
    """The runner's split of the rollout workers' trajectories over actor ranks (one trajectory
    cut in two here), the sharded weight sync and a whole-state checkpoint another rank count loads."""
    from embodied.trainer import Trainer
    from tests.conftest import small_config

    two = small_config("placement.actor_workers=2", "placement.actor=0-1", "placement.data_parallel=fsdp")
    weights_two, state_two = _first_iteration(two, tmp_path / "two")
    weights_one, _ = _first_iteration(small_config(), tmp_path / "one")
    for key in weights_one:
        torch.testing.assert_close(weights_two[key], weights_one[key], atol=1e-6, rtol=0, msg=key)

    trainer = Trainer(small_config(), tmp_path / "resumed")
    try:
        trainer.workers.load_actor_state(state_two)
        loaded = trainer.workers.actor_state()
    finally:
        trainer.close()
    assert all(torch.equal(loaded["policy"][k], state_two["policy"][k]) for k in state_two["policy"])
    moments = state_two["optimizer"]["state"]
    assert moments and all(torch.equal(loaded["optimizer"]["state"][i]["exp_avg"], moments[i]["exp_avg"])
                           for i in moments)


@pytest.mark.slow  # 30 s
def test_pi0_in_bfloat16_trains_on_two_fsdp_ranks(ray_cluster):
    """FSDP gathers each unit in one dtype: pi0's bfloat16 layers with float32 norms are sharded part by part
    (a whole layer would be refused), and the update keeps each parameter's dtype."""
    import ray

    from policies.registry import make_policy

    cfg = compose(["policy=pi0_tiny", "policy.chunk_size=2", "algorithm.num_minibatches=2", "policy.vla.dtype=bfloat16",
                   "algorithm.update_epochs=1"])
    torch.manual_seed(0)
    policy = make_policy(cfg.policy, VLA_SPEC, 4).eval()
    batch = _trajectory(policy, VLA_SPEC, 2, 4, False)
    two = _actors(ray, cfg, VLA_SPEC, 2, "fsdp")
    try:
        start = {k: v.clone() for k, v in ray.get([a.get_weights.remote() for a in two])[0].items()}  # FSDP: all
        stats, after = _update(ray, two, batch)
    finally:
        for actor in two:
            ray.kill(actor)
    assert np.isfinite(stats["policy_loss"]) and {k: v.dtype for k, v in after.items()} == {
        k: v.dtype for k, v in policy.state_dict().items()}
    assert any(not torch.equal(after[k], start[k]) for k in start if "gemma_expert" in k)

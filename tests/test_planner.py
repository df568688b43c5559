"""Cost model and planner on synthetic profiles: known optima, memory limits, monotonicity."""

import dataclasses

import pytest

from envs.common import UserError
from scheduler.cost_model import (
    Candidate,
    Curve,
    Network,
    Profile,
    Workload,
    generate_seconds,
    predict,
    remote_env_workers,
)
from scheduler.planner import candidates, plan

WORK = Workload(num_envs=64, steps=50)


def _profile(**changes) -> Profile:
    base = dict(env_step=Curve(0.002, 0.001), infer=Curve(0.004, 0.0005), train=Curve(0.5, 0.0001),
                hop_s=0.001, weight_sync_s=0.05, offload_s=0.2, env_memory=Curve(500, 10),
                rollout_memory=Curve(2000, 5), actor_memory=Curve(6000, 0.1), device_memory=80_000)
    return Profile(**{**base, **changes})


def test_cost_curves_fit_lines_and_clamp_at_zero():
    curve = Curve.fit([1, 2, 4, 8], [1.5, 2.0, 3.0, 5.0])
    assert curve.fixed == pytest.approx(1.0) and curve.per_item == pytest.approx(0.5)
    assert Curve.fit([1, 2], [2.0, 1.0]).per_item == 0.0  # noise never makes a stage cheaper with size
    assert Curve.fit([4], [2.0])(8) == pytest.approx(4.0)


def test_generation_time_matches_a_hand_computation():
    p, w = _profile(hop_s=0.003, message_s=0.002, shared_message_s=0.005), Workload(num_envs=8, steps=10)
    serial = Candidate("colocated", 1, 1, 1)  # env(8) = 0.010, infer(8) = 0.008, one message
    assert generate_seconds(serial, p, w) == pytest.approx(10 * (0.010 + 0.008 + 0.003))
    two = Candidate("colocated", 2, 2, 2)  # slices of 4: env 0.006, infer 0.006, a second message on busy devices
    assert generate_seconds(two, p, w) == pytest.approx(10 * (0.006 + 0.006 + 0.003 + 0.005))
    piped = Candidate("hybrid", 1, 1, 2, stages=2)  # 2 micro-batches of 4: env 0.006 each, infer 0.006 each
    assert generate_seconds(piped, p, w) == pytest.approx(10 * (max(2 * 0.006, 2 * 0.006) + 2 * 0.002)
                                                          + 0.006 + 0.006 + 0.003)
    fan_in = Candidate("disaggregated", 2, 1, 1)  # one rollout worker infers both slices of 4, in turn
    assert generate_seconds(fan_in, p, w) == pytest.approx(10 * (0.006 + 2 * 0.006 + 0.003 + 0.002))


def test_linear_stages_without_switch_costs_favour_colocation():
    """Every stage scales with the devices it gets and switching is free: colocated uses all
    devices for every stage and has no pipeline fill, so it wins."""
    p = _profile(env_step=Curve(0.0, 0.001), infer=Curve(0.0, 0.001), hop_s=0.0, offload_s=0.0)
    choice = plan(p, WORK, devices=4)
    assert choice.best.candidate == Candidate("colocated", 4, 4, 4, 1, False)


def test_memory_that_only_fits_split_forces_a_split_plan():
    """The actor fits on no device beside env or rollout workers and offloading is slow: with
    3 devices the groups get devices of their own, pipelined."""
    p = _profile(env_memory=Curve(40_000, 0), rollout_memory=Curve(35_000, 0), actor_memory=Curve(50_000, 0),
                 offload_s=30.0)
    choice = plan(p, WORK, devices=3)
    assert choice.best.candidate.mode == "disaggregated" and choice.best.candidate.stages > 1
    no_offload = predict(Candidate("colocated", 3, 3, 3, 1, False), p, WORK)
    assert not no_offload.feasible and "MiB" in no_offload.infeasible
    assert not choice.table[-1].feasible  # infeasible plans are listed last, never chosen


def test_a_pipeline_beats_turn_taking_on_the_same_split():
    """Simulator and policy on devices of their own: micro-batches overlap the two, so the
    iteration costs about the slower stage, not their sum."""
    p = _profile(env_step=Curve(0.0, 0.002), infer=Curve(0.0, 0.002), hop_s=0.0)
    turns = predict(Candidate("disaggregated", 1, 1, 1, 1), p, WORK)
    piped = predict(Candidate("disaggregated", 1, 1, 1, 4), p, WORK)
    assert piped.generate_s < 0.6 * turns.generate_s
    best_split = min((x for x in plan(p, WORK, devices=3).table if x.candidate.mode == "disaggregated"),
                     key=lambda x: x.iteration_s)
    assert best_split.candidate.stages > 1


def test_messages_and_weights_that_cross_nodes_pay_the_link():
    """4 devices on 2 nodes: a split with env on node 0 and rollout on node 1 sends every
    message over the link; colocated sends none, but its weight sync reaches node 1."""
    p = _profile(message_mib_per_env=0.5, weights_mib=800.0)
    net = Network(devices_per_node=2, gbps=10.0, latency_s=1e-4)
    split = Candidate("hybrid", 2, 2, 2)  # env 0-1 (node 0), rollout and actor 2-3 (node 1)
    assert remote_env_workers(split, net) == 2
    per_step_link = 1e-4 + net.transfer_s(2 * 32 * 0.5)  # both slices of 32 envs, every step
    assert predict(split, p, WORK, net).generate_s == pytest.approx(
        predict(split, p, WORK).generate_s + WORK.steps * per_step_link)
    assert predict(split, p, WORK, net).switch_s == predict(split, p, WORK).switch_s  # actor beside rollout
    together = Candidate("colocated", 4, 4, 4)
    assert remote_env_workers(together, net) == 0
    assert predict(together, p, WORK, net).generate_s == predict(together, p, WORK).generate_s
    assert predict(together, p, WORK, net).switch_s == pytest.approx(
        predict(together, p, WORK).switch_s + 1e-4 + net.transfer_s(800.0))


def test_a_slow_link_moves_the_best_plan_off_it():
    """Memory forces env, rollout and actor onto devices of their own. On one node the best
    split gives env two devices; on two nodes of 2 over a slow link that split's env workers
    talk across it, and the planner keeps every message on its node instead, and pays for it."""
    p = _profile(env_memory=Curve(40_000, 0), rollout_memory=Curve(35_000, 0), actor_memory=Curve(50_000, 0),
                 offload_s=30.0, message_mib_per_env=4.0)
    net = Network(devices_per_node=2, gbps=1.0)
    one_node = plan(p, WORK, devices=4)
    assert remote_env_workers(one_node.best.candidate, net) > 0
    two_nodes = plan(p, WORK, devices=4, network=net)
    assert remote_env_workers(two_nodes.best.candidate, net) == 0
    assert two_nodes.best.iteration_s > one_node.best.iteration_s


def test_no_plan_when_nothing_fits():
    choice = plan(_profile(device_memory=100.0), WORK, devices=2)
    assert choice.best is None and all(not x.feasible for x in choice.table)


@pytest.mark.parametrize("stage", ["env_step", "infer", "train", "hop_s", "message_s", "shared_message_s",
                                   "weight_sync_s", "offload_s"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_a_slower_stage_never_makes_a_plan_or_the_best_plan_faster(stage, devices):
    base = _profile(message_s=0.0005, shared_message_s=0.001)
    times = []
    for factor in (1.0, 1.5, 2.0, 4.0):
        cost = getattr(base, stage)
        p = dataclasses.replace(base, **{stage: cost.slower(factor) if isinstance(cost, Curve) else cost * factor})
        preds = {c: predict(c, p, WORK).iteration_s for c in candidates(devices)}
        times.append((plan(p, WORK, devices).best.iteration_s, preds))
    for (best_a, preds_a), (best_b, preds_b) in zip(times, times[1:], strict=False):
        assert best_b >= best_a
        assert all(preds_b[c] >= preds_a[c] for c in preds_a)


def test_candidates_cover_every_split_once():
    plans = candidates(4, stages=(1, 2))
    assert len(plans) == len(set(plans))
    assert all(c.total_devices() <= 4 for c in plans)
    assert {c.mode for c in plans} == {"colocated", "hybrid", "disaggregated"}
    assert Candidate("disaggregated", 2, 1, 1, 2) in plans and Candidate("hybrid", 3, 1, 1, 2, True) in plans
    assert all(not c.offload for c in candidates(4, offload=False))


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_every_candidate_is_a_placement_the_runner_accepts(devices):
    """auto runs the planner's choice through make_plan: every candidate must be a valid plan."""
    from embodied.config import compose
    from scheduler.placement import make_plan, to_placement
    from scheduler.runtime.plan import ClusterDevices

    base = compose([]).placement
    cluster = ClusterDevices.single_node("gpu", devices)
    for c in candidates(devices):
        made = make_plan(to_placement(c, base), cluster, num_envs=96)  # 96 splits for every candidate
        assert made.mode == c.mode and made.pipeline_stages == c.stages and made.offload == c.offload
        assert {name: sorted(g.devices) for name, g in made.groups.items()} == {
            name: list(r) for name, r in c.device_sets().items()}


def test_a_saved_profile_answers_what_if_questions_offline(tmp_path, capsys):
    """`embodied plan --profile P --devices N`: no cluster, no measuring; the table and the overrides."""
    from scheduler.profiler import load, save
    from tests.conftest import run_cli

    path = save(_profile(device_kind="gpu", episode_steps=50), tmp_path / "profile.json")
    assert load(path) == _profile(device_kind="gpu", episode_steps=50)
    proc = run_cli("plan", "env.num_envs=64", "--devices", "8", "--profile", str(path), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout)
    assert result["devices"] == 8 and result["best"] == result["candidates"][0]["plan"]
    assert len(result["candidates"]) == len(candidates(8))
    from embodied.commands.plan import show_plans

    assert show_plans(["env.num_envs=64"], 16, str(path), True, devices_per_node=8) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == 2
    with pytest.raises(UserError, match="no such file"):  # the CLI's exit 2, in this process
        show_plans([], None, str(tmp_path / "missing.json"), False)


# -- data-parallel actor ranks ---------------------------------------------------------------
from scheduler.cost_model import device_memory, train_seconds  # noqa: E402


def _ranks(c: Candidate, r: int) -> Candidate:
    return dataclasses.replace(c, actor_ranks=r)


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_one_actor_rank_trains_as_the_profile_measured(kind: str):
    p = _profile(device_kind=kind, allreduce=Curve(0.01, 0.1), gradient_mib=50, gradient_steps=8)
    c = Candidate("colocated", 4, 4, 4)
    assert train_seconds(c, p, WORK) == p.train(WORK.num_envs * WORK.steps)


def test_gpu_ranks_split_the_samples_and_pay_a_ring_all_reduce_per_step():
    p = _profile(device_kind="gpu", train=Curve(0.5, 0.001), allreduce=Curve(0.002, 0.01), gradient_mib=100,
                 gradient_steps=8)
    c = Candidate("colocated", 4, 4, 4)
    n = WORK.num_envs * WORK.steps
    ring = 3 * 0.002 + 2 * 3 / 4 * 100 * 0.01  # (R - 1) latencies, 2 (R - 1) / R of the bytes
    assert train_seconds(_ranks(c, 4), p, WORK) == pytest.approx(p.train(n / 4) + 8 * ring)
    sharded = dataclasses.replace(WORK, sharded=True)  # FSDP: 1.5 times the bytes
    assert train_seconds(_ranks(c, 4), p, sharded) == pytest.approx(p.train(n / 4) + 8 * (3 * 0.002 + 1.5 * 1.5))
    free = dataclasses.replace(p, allreduce=Curve(0.0, 0.0))
    times = [train_seconds(_ranks(c, r), free, WORK) for r in (1, 2, 4)]
    assert times[0] > times[1] > times[2]


def test_cpu_slots_of_one_node_share_its_cores_and_ranks_on_other_nodes_do_not():
    p = _profile(device_kind="cpu", train=Curve(0.5, 0.001))
    c = Candidate("colocated", 4, 4, 4)
    one_node = train_seconds(_ranks(c, 4), p, WORK)
    assert one_node >= train_seconds(c, p, WORK)  # four slots of one node are no faster than one using them all
    four_nodes = train_seconds(_ranks(c, 4), p, WORK, Network(devices_per_node=1))
    assert four_nodes == pytest.approx(p.train(WORK.num_envs * WORK.steps / 4) + 2 * 3 * Network().latency_s)


def test_sharding_divides_the_training_state_over_the_ranks():
    p = _profile(actor_memory=Curve(40_000, 0.5), device_memory=80_000)
    c = Candidate("disaggregated", 1, 1, 4, 1)
    n = WORK.num_envs * WORK.steps
    replicated, sharded = device_memory(_ranks(c, 4), p, WORK), device_memory(_ranks(c, 4), p,
                                                                               dataclasses.replace(WORK, sharded=True))
    actor_devices = [2, 3, 4, 5]
    assert all(replicated[d] == pytest.approx(40_000 + 0.5 * n / 4) for d in actor_devices)
    assert all(sharded[d] == pytest.approx(10_000 + 0.5 * n / 4) for d in actor_devices)


def test_a_policy_too_big_for_one_device_trains_sharded_on_several():
    """FSDP's what-if: 150 GB of training state fits on no 80 GB device, but over 4 sharded ranks."""
    p = _profile(device_kind="gpu", actor_memory=Curve(150_000, 0.0), device_memory=80_000,
                 allreduce=Curve(0.001, 0.001), gradient_mib=1000)
    assert plan(p, WORK, devices=4).best is None
    best = plan(p, dataclasses.replace(WORK, sharded=True), devices=6).best
    assert best is not None and best.candidate.actor_ranks >= 2


def test_ranks_that_do_not_split_the_envs_are_infeasible():
    c = _ranks(Candidate("hybrid", 1, 3, 3), 3)
    assert "actor ranks" in predict(c, _profile(), Workload(num_envs=64, steps=5)).infeasible
    grpo = Workload(num_envs=64, steps=5, group_size=32)
    assert "actor ranks" in predict(_ranks(Candidate("hybrid", 1, 4, 4), 4), _profile(), grpo).infeasible


def test_the_planner_searches_the_data_parallel_degree():
    names = {c.actor_ranks for c in candidates(8) if c.mode == "colocated"}
    assert names == {1, 2, 4, 8}
    p = _profile(device_kind="gpu", train=Curve(2.0, 0.01), allreduce=Curve(0.0001, 0.0001), gradient_mib=10)
    assert plan(p, WORK, devices=4).best.candidate.actor_ranks > 1  # training dominates, reduction is cheap


# -- asynchronous collection and single-rank algorithms (SAC) ------------------------------------------------------

def test_an_asynchronous_iteration_matches_a_hand_computation():
    """The rollout runs during the update: the slower of the two, or the busiest device's work in turn."""
    p = _profile(env_step=Curve(0.0, 0.001), infer=Curve(0.0, 0.0005), train=Curve(0.3, 0.0), hop_s=0.002,
                 weight_sync_s=0.04)
    w = Workload(num_envs=16, steps=10, overlap=True, sync_every=2)
    hybrid = predict(Candidate("hybrid", 1, 1, 1), p, w)  # env on 0; rollout and actor on 1
    generate = 10 * (0.016 + 0.008 + 0.002)
    assert hybrid.generate_s == pytest.approx(generate) and hybrid.train_s == pytest.approx(0.3)
    # device 1 infers 10 steps of 16 (0.08 s) and trains (0.3 s): busier than the rollout (0.26 s) or the update
    assert hybrid.iteration_s == pytest.approx(0.08 + 0.3 + 0.04 / 2)
    colocated = predict(Candidate("colocated", 2, 2, 2), p, w)  # device 0 steps, infers and trains
    assert colocated.iteration_s == pytest.approx(10 * (0.008 + 0.004) + 0.3 + 0.04 / 2)
    lockstep = predict(Candidate("hybrid", 1, 1, 1), p, dataclasses.replace(w, overlap=False))
    assert lockstep.iteration_s == pytest.approx(generate + 0.3 + 0.04)  # a sync every iteration


def test_an_update_slower_than_the_rollout_hides_it_only_on_a_device_of_its_own():
    p = _profile(env_step=Curve(0.0, 0.002), infer=Curve(0.0, 0.0001), train=Curve(1.0, 0.0), hop_s=0.0,
                 weight_sync_s=0.0, offload_s=0.0)
    w = Workload(num_envs=16, steps=10, overlap=True)
    disaggregated = predict(Candidate("disaggregated", 1, 1, 1), p, w)
    assert disaggregated.iteration_s == pytest.approx(1.0)  # the rollout (0.34 s) runs inside the update
    assert predict(Candidate("disaggregated", 1, 1, 1), p, dataclasses.replace(w, overlap=False)).iteration_s \
        == pytest.approx(1.0 + 10 * (0.032 + 0.0016))
    best = plan(p, w, devices=3).best
    assert best.iteration_s <= disaggregated.iteration_s + 1e-9
    assert best.overlapped_s is not None


def test_asynchronous_collection_refuses_offload_and_sac_trains_on_one_rank():
    p = _profile()
    w = Workload(num_envs=64, steps=4, overlap=True, max_actor_ranks=1)
    table = plan(p, w, devices=4).table
    offloaded = [pred for pred in table if pred.candidate.offload]
    assert offloaded and all("offloaded" in pred.infeasible for pred in offloaded)
    several = [pred for pred in table if pred.candidate.actor_ranks > 1 and not pred.candidate.offload]
    assert several and all("at most 1 actor rank" in pred.infeasible for pred in several)
    assert plan(p, w, devices=4).best.candidate.actor_ranks == 1

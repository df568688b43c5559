"""``placement.mode=auto`` on the real workers: profile once, plan, run the plan, report."""

from embodied.runner import Trainer
from scheduler.auto import profile_sizes
from scheduler.cost_model import Candidate
from scheduler.profiler import cached_profile, load
from tests.conftest import small_config


def test_auto_profiles_once_runs_the_chosen_plan_and_reports_its_prediction(ray_cluster, tmp_path):
    profiles = tmp_path / "profiles"
    cfg = small_config("placement.mode=auto", f"placement.profile_dir={profiles}")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        summary = trainer.train()
        plan = trainer.workers.plan
    finally:
        trainer.close()
    report = summary["auto_placement"]
    assert report["profiled_now"] and 0 < report["profile_seconds"] < 120
    assert 0 < report["profile_share"] < 1

    # the run used the plan the planner chose: its mode, micro-batches and groups' devices
    chosen = trainer.workers.auto.choice.best.candidate
    assert isinstance(chosen, Candidate) and report["plan"] == chosen.name()
    assert plan.mode == chosen.mode and plan.pipeline_stages == chosen.stages
    assert {name: sorted(g.devices) for name, g in plan.groups.items()} == {
        name: list(r) for name, r in chosen.device_sets().items()}

    # every stage was measured on this machine, the channel on the real workers
    profile = load(report["profile"])
    assert profile.env_step(4) > 0 and profile.infer(4) > 0 and profile.train(40) > 0
    assert profile.hop_s > 0 and profile.weight_sync_s > 0 and profile.weights_mib > 0
    assert profile.message_mib_per_env > 0 and profile.episode_steps == 50
    # loose: the benchmark (benchmarks/plan_accuracy.py) holds the model to 15%
    assert 0.5 < report["measured_over_predicted"] < 2.0

    # the same config on the same machine reads the cache instead of measuring again
    _, path, measured_now = cached_profile(cfg, profile_sizes(4), 2, profiles, log=print)
    assert not measured_now and str(path) == report["profile"]

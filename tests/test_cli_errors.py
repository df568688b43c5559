"""Bad input: one paragraph naming the fix, exit code 2, no traceback."""

import pytest

from tests.conftest import run_cli

CASES = {
    "unknown env group": (["train", "env=maniskill_pushcub"], ["maniskill_pushcube", "configs/env"]),
    "unknown task": (["train", "env.task=PushCub-v1"], ["PushCube-v1"]),
    "unknown policy group": (["train", "policy=mlpp"], ["mlp"]),
    "unknown policy name": (["train", "policy.name=transformer"], ["policy", "mlp"]),
    "misspelled key": (["train", "algorithm.lrr=3e-4"], ["Did you mean 'algorithm.lr'"]),
    "misspelled section": (["train", "algorithmm.lr=3e-4"], ["algorithm"]),
    "wrong type": (["train", "algorithm.lr=fast"], ["algorithm.lr"]),
    "unknown loss": (["train", "algorithm.loss=ppo2"], ["algorithm.loss", "'ppo'"]),
    "unknown bootstrap rule": (["train", "algorithm.bootstrap=always"], ["algorithm.bootstrap", "all_ends"]),
    "missing checkpoint": (["eval", "checkpoint=/nonexistent/run"], ["/nonexistent/run", "checkpoint="]),
    "missing warm-start checkpoint": (["train", "checkpoint=/nonexistent/run"], ["/nonexistent/run", "checkpoint="]),
    "unknown log-prob level": (["train", "algorithm.logprob_level=sentence"],
                               ["algorithm.logprob_level", "action, chunk, token"]),
    "training the random baseline": (["train", "policy.name=random"], ["nothing to train", "policy=mlp"]),
    "unknown GRPO weighting": (["train", "algorithm=grpo", "algorithm.grpo_weighting=token"],
                               ["algorithm.grpo_weighting", "episode, step"]),
    "critic warm-up without a critic": (["train", "algorithm=grpo", "algorithm.critic_warmup_iterations=3"],
                                        ["critic_warmup_iterations=3", "algorithm=ppo"]),
    "critic lr not a rate": (["train", "algorithm.critic_lr=0"], ["algorithm.critic_lr=0", "> 0"]),
    "negative KL weight": (["train", "algorithm.kl_coef=-0.1"], ["algorithm.kl_coef=-0.1", ">= 0"]),
    "GRPO group too small": (["train", "algorithm=grpo", "algorithm.group_size=1"], ["group_size=1", ">= 2"]),
    "GRPO episode longer than an iteration": (["train", "algorithm=grpo", "algorithm.group_size=4", "env.num_envs=8",
                                               "algorithm.rollout_steps=10"], ["rollout_steps=10", "null"]),
    "unknown LIBERO suite": (["eval", "env=libero_spatial", "env.task=libero_spatail"], ["libero_spatial"]),
    "LIBERO obs mode": (["eval", "env=libero_spatial", "env.obs_mode=depth"], ["obs_mode", "'state'"]),
    "LIBERO task index outside the suite": (["eval", "env=libero_spatial", "eval.tasks=[3,10]"],
                                            ["eval.tasks=[3, 10]", "0..9"]),
    "task subset of a single-task env": (["train", "eval.tasks=[0]"], ["eval.tasks=[0]", "null"]),
    "no trials": (["eval", "env=libero_spatial", "eval.trials_per_task=0"], ["trials_per_task"]),
    "VLA checkpoint not there": (["train", "env=maniskill_pushcube_rgb", "policy=openvla_7b_lora"],
                                 ["checkpoints/openvla-7b", "huggingface-cli download"]),
    "SFT of a policy without tokens": (["sft", "policy=mlp", "sft.demos=1", "sft.demos_dir=/tmp/embodied-test-demos"],
                                       ["token policies", "openvla_tiny"]),
    "bad resume dir": (["train", "resume=/nonexistent/run"], ["resume", "config.yaml"]),
    "placement: overlap hybrid forbids": (
        ["train", "placement.mode=hybrid", "placement.env=0", "placement.rollout=0"],
        ["both use device(s) [0]", "disjoint ranges"]),
    "placement: stages do not divide envs": (
        ["train", "placement.mode=hybrid", "placement.env=0", "placement.rollout=1", "placement.pipeline_stages=3"],
        ["pipeline_stages=3", "multiple of 6"]),
    "placement: stages while colocated": (["train", "placement.pipeline_stages=2"], ["mode=hybrid"]),
    "placement: unknown mode": (["train", "placement.mode=pipelined"], ["disaggregated"]),
    "unknown benchmark": (["bench", "pipelin"], ["pipeline"]),
    "more actor ranks than devices": (["train", "placement.actor_workers=2", "placement.actor=0"],
                                      ["actor_workers=2", "placement.actor at least 2 devices"]),
    "batch does not split over actor ranks": (["train", "env.num_envs=6", "placement.actor_workers=4",
                                               "placement.actor=0-3"], ["num_envs=6", "multiple of 4"]),
    "GRPO group spans actor ranks": (["train", "algorithm=grpo", "env.num_envs=16", "placement.actor_workers=4",
                                      "placement.actor=0-3"], ["group_size=8", "span actor ranks"]),
    "broadcast weight sync with actor ranks": (["train", "placement.weight_sync=broadcast", "placement.actor_workers=2",
                                                "placement.actor=0-1"], ["weight_sync=broadcast", "shared_memory"]),
    "unknown data-parallel strategy": (["train", "placement.data_parallel=zero3"], ["zero3", "replicate, fsdp"]),
}


def _assert_one_paragraph(code: int, stderr: str, must_mention: list[str]) -> None:
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    message = stderr.strip().splitlines()
    assert message and message[0].startswith("error: ")
    assert len(message) <= 3, stderr
    for word in must_mention:
        assert word in stderr, (word, stderr)


@pytest.fixture
def no_ray(monkeypatch):
    """Bad input is refused before any worker starts: starting Ray fails the test."""
    import embodied.cli
    import embodied.runner

    def refuse(*args, **kwargs):
        raise AssertionError("the command started Ray before refusing its input")

    monkeypatch.setattr(embodied.runner, "start_cluster", refuse)
    monkeypatch.setattr(embodied.cli, "start_cluster", refuse)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_paragraph_and_exit_2(name, no_ray, capsys):
    """Through the CLI's ``main`` in this process (a process per case would cost ~8 s of imports
    each); ``test_a_real_process_exits_2_with_one_paragraph`` runs the same path as a user would."""
    from embodied.cli import main

    args, must_mention = CASES[name]
    code = main(args)
    _assert_one_paragraph(code, capsys.readouterr().err, must_mention)


@pytest.mark.parametrize("name", ["misspelled key", "GRPO group too small", "missing checkpoint"])
def test_a_real_process_exits_2_with_one_paragraph(name):
    args, must_mention = CASES[name]
    proc = run_cli(*args, timeout=120)
    assert "Started a local Ray instance" not in proc.stderr
    _assert_one_paragraph(proc.returncode, proc.stderr, must_mention)


def test_placement_beyond_the_clusters_devices_exits_2():
    """The one check that needs the cluster (how many devices it has): after Ray starts, before workers."""
    proc = run_cli("train", "placement.env=0-7", timeout=120)
    _assert_one_paragraph(proc.returncode, proc.stderr, ["placement.env", "ray.num_cpus"])


def test_env_that_fails_to_build_names_the_cause_and_exits_3():
    proc = run_cli("train", "env.control_mode=pd_bogus", "env.num_envs=4", timeout=180)
    assert proc.returncode == 3, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error and "failed to start" in error[0] and "pd_bogus not in supported modes" in error[0]


ASSETS = "assets/reference"
CHECKPOINT_CASES = {
    # (command, the fixture, a file to delete from a copy of it or None, overrides, words the message must have)
    "checkpoint missing a file": ("eval", "openvla_tiny", "model.safetensors", ["env=libero_spatial",
                                  "policy=openvla_7b_libero", "policy.unnorm_key=libero_spatial_no_noops"],
                                  ["missing model.safetensors", "huggingface-cli"]),
    "L1 OFT checkpoint to train": ("train", "openvla_oft_l1_tiny", None, ["env=libero_spatial",
                                   "policy=openvla_oft_7b_libero"], ["L1-regression", "token OFT"]),
    # an unnorm_key the statistics lack, or statistics of another action size: the same path, tested in-process
    # (tests/test_reference_parity.py::test_checkpoint_statistics_are_checked_before_any_worker_starts)
}


@pytest.mark.parametrize("name", sorted(CHECKPOINT_CASES))
def test_bad_checkpoint_gives_one_paragraph_and_exit_2_before_workers_start(name, tmp_path, no_ray, capsys):
    import shutil
    from pathlib import Path

    from embodied.cli import main

    command, fixture, delete, overrides, must_mention = CHECKPOINT_CASES[name]
    model = Path(__file__).resolve().parents[1] / ASSETS / fixture
    if delete:
        model = Path(shutil.copytree(model, tmp_path / fixture))
        (model / delete).unlink()
    code = main([command, f"policy.model_path={model}", "policy.dtype=float32", *overrides])
    _assert_one_paragraph(code, capsys.readouterr().err, must_mention)

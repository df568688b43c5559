"""Bad input: one paragraph naming the fix, exit code 2, no traceback."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from envs.common import UserError
from tests.conftest import REPO, run_cli

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
    "unknown LIBERO rendering": (["eval", "env=libero_spatial", "env.rendering=pretty"],
                                 ["env.rendering='pretty'", "'fast'", "'reference'"]),
    "reference rendering on ManiSkill": (["eval", "env.rendering=reference"],
                                         ["env.rendering=reference is LIBERO's", "env.rendering=fast"]),
    "LIBERO task index outside the suite": (["eval", "env=libero_spatial", "eval.tasks=[3,10]"],
                                            ["eval.tasks=[3, 10]", "0..9"]),
    "task subset of a single-task env": (["train", "eval.tasks=[0]"], ["eval.tasks=[0]", "null"]),
    "no trials": (["eval", "env=libero_spatial", "eval.trials_per_task=0"], ["trials_per_task"]),
    "more trials than stored init states": (["eval", "env=libero_spatial", "eval.trials_per_task=60"],
                                            ["trials_per_task=60", "stores 50 init states", "trials_per_task=50"]),
    "GRPO on LIBERO with its defaults": (["train", "env=libero_spatial", "algorithm=grpo"],
                                         ["group_size=8", "env.num_envs=16"]),
    "env image smaller than the checkpoint's": (["eval", "env=libero_spatial", "policy=openvla_oft_7b_libero",
                                                  "env.image_size=128"],
                                                 ["env.image_size=128", "256 px", "env.image_size=256"]),
    "fast rendering for a public checkpoint": (["eval", "env=libero_spatial", "policy=openvla_7b_libero",
                                                "env.rendering=fast"],
                                               ["env.rendering=fast", "env.rendering=reference",
                                                "policy.vla.camera_rendering=null"]),
    "config file not there": (["train", "--config", "/nonexistent/my.yaml"], ["/nonexistent/my.yaml", "YAML"]),
    "config file with a misspelled key": (["train", "--config", str(REPO / "tests/data/misspelled.yaml")],
                                          ["algorithm.lrr", "Did you mean 'algorithm.lr'"]),
    "config file for a command that composes none": (["evals", "runs/x", "--config",
                                                      str(REPO / "tests/data/misspelled.yaml")],
                                                     ["--config", "embodied evals"]),
    "config file that is a list": (["train", "--config", str(REPO / "tests/data/not_a_mapping.yaml")],
                                   ["not a mapping"]),
    "negative env count": (["eval", "env.num_envs=-4"], ["env.num_envs=-4", ">= 1"]),
    "no envs on LIBERO": (["eval", "env=libero_spatial", "env.num_envs=0"], ["env.num_envs=0", ">= 1"]),
    "no evaluation episodes": (["eval", "eval.episodes=0"], ["eval.episodes=0", ">= 1"]),
    "tiny VLA images smaller than a patch": (["train", "env=maniskill_pushcube_rgb", "policy=openvla_tiny",
                                              "policy.vla.image_size=4"], ["policy.vla.image_size=4", "8 px"]),
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
    "unknown overhead setting": (["bench", "overhead", "state-4069"], ["overhead setting", "state-4096"]),
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
    # progress lines of start-up may come first (an error found once Ray runs); then the one paragraph
    message = [line for line in stderr.strip().splitlines() if not line.startswith("start-up: ")]
    assert message and message[0].startswith("error: ")
    assert len(message) <= 3, stderr
    for word in must_mention:
        assert word in stderr, (word, stderr)


@pytest.fixture
def no_ray(monkeypatch):
    """Bad input is refused before any worker starts: starting Ray fails the test."""
    import embodied.commands.plan
    import embodied.runner

    def refuse(*args, **kwargs):
        raise AssertionError("the command started Ray before refusing its input")

    monkeypatch.setattr(embodied.runner, "start_cluster", refuse)
    monkeypatch.setattr(embodied.commands.plan, "start_cluster", refuse)


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


def test_placement_beyond_the_clusters_devices_exits_2(ray_cluster, tmp_path, capsys):
    """The one check that needs the cluster (how many devices it has): after Ray starts, before workers.
    The CLI's main in this process, on the session's cluster of 2 CPU slots (a process of its own is the
    tests above)."""
    from embodied.cli import main as cli_main

    code = cli_main(["train", "placement.env=0-7", f"runner.run_dir={tmp_path / 'run'}"])
    _assert_one_paragraph(code, capsys.readouterr().err, ["placement.env", "ray.num_cpus"])


def test_env_that_fails_to_build_names_the_cause_and_exits_3():
    proc = run_cli("train", "env.control_mode=pd_bogus", "env.num_envs=4", timeout=180)
    assert proc.returncode == 3, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error and "failed to start" in error[0] and "pd_bogus not in supported modes" in error[0]


ASSETS = Path(__file__).resolve().parents[1] / "assets" / "reference"


def _edit_json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit of a checkpoint copy: ``change`` applied to its JSON file ``name``."""
    def edit(model: Path) -> None:
        data = json.loads((model / name).read_text())
        change(data)
        (model / name).write_text(json.dumps(data))
    return edit


def _delete(name: str) -> Callable[[Path], None]:
    return lambda model: (model / name).unlink()


def _drop_bounds(stats: dict) -> None:
    for key in stats:
        for field in ("min", "max"):
            stats[key]["action"].pop(field)


LIBERO_OPENVLA = ["env=libero_spatial", "policy=openvla_7b_libero", "policy.vla.unnorm_key=libero_spatial_no_noops"]
LIBERO_OFT = ["env=libero_spatial", "policy=openvla_oft_7b_libero", "policy.vla.unnorm_key=libero_spatial_no_noops"]
CHECKPOINT_CASES = {
    # (command, the fixture, an edit of a copy of it or None, overrides, words the message must have)
    "checkpoint missing a file": ("eval", "openvla_tiny", _delete("model.safetensors"), LIBERO_OPENVLA,
                                  ["missing model.safetensors", "huggingface-cli"]),
    "L1 OFT checkpoint to train": ("train", "openvla_oft_l1_tiny", None, ["env=libero_spatial",
                                   "policy=openvla_oft_7b_libero"], ["L1-regression", "token OFT"]),
    "unknown key in timm_overrides": (
        "eval", "openvla_tiny", _edit_json("config.json", lambda c: c["timm_overrides"][0].update(mlp_ratio=3.0)),
        LIBERO_OPENVLA, ["config.json", "timm_overrides", "'mlp_ratio': 3.0", "Remove the other keys"]),
    "CLIP vision backbone": (
        "eval", "openvla_tiny", _edit_json("config.json", lambda c: c["timm_model_ids"].__setitem__(
            1, "vit_large_patch14_clip_336.openai")), LIBERO_OPENVLA, ["vit_large_patch14_clip_336.openai", "CLIP"]),
    "Mistral language model": (
        "eval", "openvla_tiny", _edit_json("config.json", lambda c: c.update(llm_backbone_id="mistral-v0.1-7b-pure")),
        LIBERO_OPENVLA, ["llm_backbone_id='mistral-v0.1-7b-pure'", "Llama"]),
    "dynamic RoPE scaling": (
        "eval", "openvla_tiny", _edit_json("config.json", lambda c: c["text_config"].update(
            rope_scaling={"type": "dynamic", "factor": 2.0})), LIBERO_OPENVLA, ["'dynamic'", "linear"]),
    "processor with a max_size": (
        "eval", "openvla_tiny", _edit_json("preprocessor_config.json", lambda c: c["tvf_resize_params"][0].update(
            max_size=256)), LIBERO_OPENVLA, ["max_size=256", "null"]),
    "config.json that is not JSON": (
        "eval", "openvla_tiny", lambda model: (model / "config.json").write_text("{\"model_type\": "),
        LIBERO_OPENVLA, ["config.json is not valid JSON", "Copy"]),
    "unknown image resize strategy": (
        "eval", "openvla_tiny", _edit_json("preprocessor_config.json", lambda c: c.update(
            image_resize_strategy="resize-magic")), LIBERO_OPENVLA, ["resize-magic", "letterbox"]),
    "processor of a single-backbone checkpoint": (
        "eval", "openvla_tiny", lambda model: (model / "preprocessor_config.json").write_bytes(
            (ASSETS / "openvla_single_tiny" / "preprocessor_config.json").read_bytes()),
        LIBERO_OPENVLA, ["1 backbone transforms", "use_fused_vision_backbone"]),
    "FiLM OFT checkpoint": (
        "eval", "openvla_oft_l1_tiny", lambda model: (model / "vision_backbone--100_checkpoint.pt").write_bytes(b""),
        LIBERO_OFT, ["vision_backbone--100_checkpoint.pt", "FiLM"]),
    "bounds normalisation without min / max": (
        "eval", "openvla_oft_l1_tiny", _edit_json("dataset_statistics.json", _drop_bounds),
        [*LIBERO_OFT, "policy.vla.normalization=bounds"], ["has no ['min', 'max']", "policy.vla.normalization"]),
    "bounds normalisation for OpenVLA": ("eval", "openvla_tiny", None,
                                         [*LIBERO_OPENVLA, "policy.vla.normalization=bounds"],
                                         ["q01 / q99 only", "openvla_oft"]),
    "mean / std normalisation": ("eval", "openvla_oft_l1_tiny", None, [*LIBERO_OFT, "policy.vla.normalization=normal"],
                                 ["Unsupported action/proprio normalization", "bounds_q99"]),
    "ALOHA checkpoint on LIBERO": (
        "eval", "openvla_oft_aloha_tiny", None, ["env=libero_spatial", "policy=openvla_oft_7b_aloha",
                                                 "policy.vla.unnorm_key=aloha1_put_x_into_pot_300_demos"],
        ["14-dim actions", "7-dim"]),
    "an image size other than the checkpoint's": ("eval", "openvla_tiny", None, [*LIBERO_OPENVLA,
                                                  "policy.vla.image_size=100"],
                                                  ["policy.vla.image_size=100", "224 px"]),
    "a camera the env does not render": ("eval", "openvla_oft_l1_tiny", None, [*LIBERO_OFT,
                                          "policy.vla.cameras=[rgb,left_wrist_rgb]"], ["left_wrist_rgb", "wrist_rgb"]),
    # an unnorm_key the statistics lack, or statistics of another action size: the same path, tested in-process
    # (tests/test_reference_parity.py::test_checkpoint_statistics_are_checked_before_any_worker_starts)
}


def _checkpoint_case(name: str, tmp_path: Path) -> list[str]:
    """The case's command line, with a (copied and edited) fixture as ``policy.vla.model_path``."""
    command, fixture, edit, overrides, _ = CHECKPOINT_CASES[name]
    model = ASSETS / fixture
    if edit:
        model = Path(shutil.copytree(model, tmp_path / fixture))
        edit(model)
    return [command, f"policy.vla.model_path={model}", "policy.vla.dtype=float32", *overrides]


@pytest.mark.parametrize("name", sorted(CHECKPOINT_CASES))
def test_bad_checkpoint_gives_one_paragraph_and_exit_2_before_workers_start(name, tmp_path, no_ray, capsys):
    from embodied.cli import main

    code = main(_checkpoint_case(name, tmp_path))
    _assert_one_paragraph(code, capsys.readouterr().err, CHECKPOINT_CASES[name][-1])


def test_a_real_process_refuses_an_unknown_timm_override_before_ray_starts(tmp_path):
    """The issue's case as a user meets it: exit 2, one paragraph, no traceback, no worker started."""
    proc = run_cli(*_checkpoint_case("unknown key in timm_overrides", tmp_path), "eval.trials_per_task=1",
                   timeout=120)
    assert "Started a local Ray instance" not in proc.stderr and "pid=" not in proc.stderr
    _assert_one_paragraph(proc.returncode, proc.stderr, CHECKPOINT_CASES["unknown key in timm_overrides"][-1])


def test_bad_input_found_in_a_worker_is_a_config_error_not_a_crash():
    """A UserError raised in a worker's constructor (Ray's creation-task report) gives its own
    paragraph and exit 2; a policy worker's crash never points at the renderer, an env worker's does."""
    from embodied.cli import EXIT_ENV_CRASH, EXIT_USER_ERROR, _explain_failed_start

    report = ("The actor died because of an error raised in its creation task, ray::ActorWorker.__init__() "
              "(pid=1, ip=1.2.3.4)\n  File \"policies/vla/oft.py\", line 1, in __init__\n"
              "envs.common.UserError: policy.vla.proprio=true needs a `state` observation; this env has none.")
    message, code = _explain_failed_start(report)
    assert code == EXIT_USER_ERROR and message.startswith("policy.vla.proprio=true") and "check-render" not in message
    crash = report.replace("envs.common.UserError: policy.vla.proprio", "RuntimeError: CUDA out of memory")
    message, code = _explain_failed_start(crash)
    assert code == EXIT_ENV_CRASH and "check-render" not in message and "the policy on its own" in message
    message, _ = _explain_failed_start(crash.replace("ActorWorker", "EnvWorker"))
    assert "check-render" in message


LIBERO_OBS = {"rgb": ((224, 224, 3), "uint8"), "wrist_rgb": ((224, 224, 3), "uint8"), "state": ((8,), "float32")}


@pytest.mark.parametrize("overrides, words", [
    ([*LIBERO_OFT, f"policy.vla.model_path={ASSETS / 'openvla_oft_l1_tiny'}",
      "policy.vla.cameras=[rgb,left_wrist_rgb]"],
     ["left_wrist_rgb", "wrist_rgb"]),
    ([*LIBERO_OFT, f"policy.vla.model_path={ASSETS / 'openvla_oft_aloha_tiny'}", "policy.vla.cameras=[rgb]",
      "policy.vla.unnorm_key=aloha1_put_x_into_pot_300_demos", "policy.vla.normalization=bounds"],
     ["state is 8-dim", "14-dim", "policy.vla.proprio=false"]),
], ids=["a camera the env lacks", "proprio of another size"])
def test_policy_is_checked_against_the_envs_observations_before_policy_workers_start(overrides, words):
    """What ``Workers`` checks once the env workers report their observations (LIBERO's here)."""
    from embodied.config import compose
    from envs.common import UserError
    from policies.registry import check_policy_observations

    with pytest.raises(UserError) as err:
        check_policy_observations(compose(overrides).policy, LIBERO_OBS, 14)
    assert all(word in str(err.value) for word in words), str(err.value)


@pytest.mark.parametrize("command", ["eval", "record", "sft", "plan"])
def test_cfg_job_prints_the_config_of_every_command_and_runs_nothing(command, no_ray, capsys):
    """``--cfg job`` is honoured by every command that runs a config (it once started a 500-episode eval)."""
    from embodied.cli import main

    assert main([command, "env=libero_spatial", "eval.trials_per_task=3", "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert "task: libero_spatial" in printed and "trials_per_task: 3" in printed


# -- the command line: each command declares its flags, and only those -----------------------------

HEAVY_PROBE = ("import sys\nfrom embodied.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
               "except SystemExit as done:\n    code = done.code\n"
               "print(code, sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")


def _cli_in_fresh_process(*args: str) -> tuple[int, str, str, str]:
    """``embodied <args>`` in a new interpreter: (exit code, the heavy packages it imported, stdout
    without the probe's line, stderr)."""
    proc = subprocess.run([sys.executable, "-c", HEAVY_PROBE, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    *out, last = proc.stdout.strip().splitlines()
    code, heavy = last.split(" ", 1)
    return int(code), heavy, "\n".join(out), proc.stderr


def test_a_flag_of_another_command_exits_2_naming_it_before_torch_or_ray_is_imported():
    """``eval --faults 3`` was once accepted and ignored; now argparse refuses it, and says whose flag it is."""
    code, heavy, _, stderr = _cli_in_fresh_process("eval", "--faults", "3")
    _assert_one_paragraph(code, stderr, ["embodied eval", "unrecognized arguments: --faults", "embodied chaos"])
    assert heavy == "[]", heavy


@pytest.mark.parametrize("args, must_mention", [
    (["train", "--devices", "2"], ["embodied train", "--devices", "embodied plan"]),
    (["record", "--json"], ["embodied record", "--json", "embodied bench / plan"]),
    (["sft", "env=libero_spatial", "--reference"], ["embodied sft", "--reference", "embodied chaos"]),
    (["evals", "runs/x", "--cfg", "job"], ["embodied evals", "--cfg", "embodied train / sft / eval"]),
    (["bench", "pipeline", "--config", "my.yaml"], ["embodied bench", "--config"]),
    (["check-render", "env=libero_spatial"], ["embodied check-render", "env=libero_spatial"]),
    (["chaos", "--faults", "many"], ["--faults", "invalid int value: 'many'"]),
    (["plan", "--cfg", "yaml"], ["--cfg", "invalid choice"]),
    (["trian", "env=x"], ["invalid choice: 'trian'", "embodied --help"]),
    ([], ["required", "<command>"]),
], ids=["train --devices", "record --json", "sft --reference", "evals --cfg", "bench --config",
        "check-render with an override", "chaos --faults not a number", "--cfg not job", "unknown command",
        "no command"])
def test_a_flag_the_command_does_not_take_is_refused_with_exit_2(args, must_mention, no_ray, capsys):
    from embodied.cli import main

    _assert_one_paragraph(main(args), capsys.readouterr().err, must_mention)


def test_help_lists_every_commands_flags_and_the_exit_codes_without_torch():
    code, heavy, out, _ = _cli_in_fresh_process("--help")
    assert code == 0 and heavy == "[]", (code, heavy)
    for word in ["embodied chaos", "--faults", "--chaos-seed", "embodied plan", "--devices-per-node",
                 "embodied bench", "--iterations", "check-render", "exit codes", "runner.max_worker_restarts"]:
        assert word in out, (word, out)
    code, heavy, out, _ = _cli_in_fresh_process("chaos", "--help")
    assert code == 0 and heavy == "[]" and "--faults" in out and "--config" in out and "--devices" not in out


def _sets(printed: str, *lines: str) -> bool:
    """The printed YAML config has each ``key: value`` line (whole lines: 8 is not 80)."""
    return all(re.search(rf"^\s*{re.escape(line)}$", printed, re.MULTILINE) for line in lines)


def test_flags_and_overrides_of_a_command_still_mix_in_any_order(tmp_path, no_ray, capsys):
    from embodied.cli import main

    assert main(["plan", "--devices", "2", "--cfg", "job", "env.num_envs=8"]) == 0
    assert _sets(capsys.readouterr().out, "num_envs: 8")
    assert main(["train", "env.num_envs=8", "--cfg", "job", "algorithm.lr=0.001"]) == 0
    assert _sets(capsys.readouterr().out, "num_envs: 8", "lr: 0.001")
    settings = tmp_path / "settings.yaml"
    settings.write_text("env: {num_envs: 16, max_episode_steps: 20}\n")
    assert main(["chaos", "--faults", "3", "env.num_envs=8", "--config", str(settings), "--cfg", "job"]) == 0
    assert _sets(capsys.readouterr().out, "num_envs: 8", "max_episode_steps: 20")  # the command line wins


def test_each_failure_has_its_own_exit_code():
    """0 ok, 1 a check said no, 2 bad input, 3 a crash, 4 a worker fault beyond the restart budget."""
    from embodied.cli import EXIT_CODES, EXIT_ENV_CRASH, EXIT_USER_ERROR, EXIT_WORKER_FAULT, _explain
    from envs.subproc import EnvCrashedError
    from scheduler.runtime.faults import RestartBudgetExceeded, WorkerFailure, WorkerFault

    assert sorted(EXIT_CODES) == [0, 1, 2, 3, 4]
    fault = WorkerFault("env", 1, "dead", "rollout", "killed")
    assert _explain(RestartBudgetExceeded(fault, 6, 5, 60.0))[1] == EXIT_WORKER_FAULT == 4
    assert _explain(WorkerFailure("evaluate", [fault], "killed"))[1] == EXIT_WORKER_FAULT
    assert _explain(EnvCrashedError("Env worker process 0 died"))[1] == EXIT_ENV_CRASH == 3
    assert _explain(UserError("bad"))[1] == EXIT_USER_ERROR == 2

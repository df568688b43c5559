"""The memory plan (embodied/memory_plan.py): what each worker will hold, against the node's memory, before any
worker starts; and a failed allocation during a run as a configuration error, never a fault to retry."""

import time

import psutil
import pytest
import torch

from embodied.algorithms.replay import ReplayBuffer, Transitions
from embodied.allocation import (
    AllocationUserError,
    allocation_failure_of,
    allocations_are_config_errors,
    is_allocation_failure,
)
from embodied.config import compose
from embodied.memory_plan import GiB, NodeMemory, check_memory, plan_memory
from envs.common import UserError
from envs.registry import env_static_obs_spec
from scheduler.runtime.worker import WorkerFailure, WorkerFault
from tests.conftest import run_cli

SAC_ON_LIBERO = ["algorithm=sac", "policy=mlp_sac", "env=libero_spatial"]
LAPTOP = NodeMemory(total=int(23.5 * GiB), available=21 * GiB)  # the issue's machine


def _refusal(overrides: list[str], node: NodeMemory = LAPTOP) -> str:
    with pytest.raises(UserError) as refused:
        check_memory(compose(overrides), node=node)
    return str(refused.value)


# -- the static observation specs the buffer is sized from --------------------------------------------------------
def test_libero_spec_gives_the_buffer_the_run_log_reports():
    """The issue's run log: 'replay buffer: 1,000,000 transitions, 187,916 MiB when full', now known before any
    env starts (two 128 px cameras, 8 state floats, a 10-task one-hot, a 128-byte instruction)."""
    spec = env_static_obs_spec(compose(SAC_ON_LIBERO).env)
    assert spec == {"rgb": ((128, 128, 3), "uint8"), "wrist_rgb": ((128, 128, 3), "uint8"), "state": ((8,), "float32"),
                    "task": ((10,), "float32"), "instruction": ((128,), "uint8")}
    assert round(ReplayBuffer.bytes_for(1_000_000, spec, 7) / 2**20) == 187_916


def test_libero_suite_sizes_are_the_benchmarks():
    pytest.importorskip("libero")
    from libero.libero import benchmark

    from envs.libero import COMBINED, SUITE_SIZES, _configure_paths

    _configure_paths()
    suites = benchmark.get_benchmark_dict()
    for suite, size in SUITE_SIZES.items():
        parts = COMBINED.get(suite, (suite,))
        assert sum(suites[part]().n_tasks for part in parts) == size, suite


@pytest.mark.parametrize("overrides", [["env=free"], ["env=free", "env.obs_mode=rgb", "env.image_size=32"],
                                       ["env=gym"]])
def test_a_static_spec_is_the_built_envs(overrides):
    from envs.registry import make_vec_env

    cfg = compose(overrides)
    env = make_vec_env(cfg.env, num_envs=2, num_procs=0)
    try:
        built = {k: (tuple(shape), str(dtype).removeprefix("torch.")) for k, (shape, dtype) in env.obs_spec.items()}
    finally:
        env.close()
    assert env_static_obs_spec(cfg.env) == built


@pytest.mark.integration
@pytest.mark.parametrize("task", ["PushCube-v1", "StackCube-v1"])
def test_maniskill_spec_table_is_the_built_envs(task):
    from envs.maniskill import ManiSkillCPUEnv, maniskill_spec

    for mode in ("state", "rgb"):
        cfg = compose([f"env.task={task}", f"env.obs_mode={mode}", "env.image_size=16"])
        env = ManiSkillCPUEnv(maniskill_spec(cfg.env))
        try:
            built = {k: (tuple(shape), str(dtype)) for k, (shape, dtype) in env.obs_spec.items()}
        finally:
            env.env.close()
        assert env_static_obs_spec(cfg.env) == built, (task, mode)


# -- the plan and its verdict -------------------------------------------------------------------------------------
def test_sac_on_libero_is_refused_with_the_buffer_the_machine_and_a_size_that_fits():
    message = _refusal([*SAC_ON_LIBERO, "env.num_envs=2"])
    for words in ["algorithm.sac.buffer_size=1,000,000", "197,044 bytes", "183.5 GiB", "21.0 GiB available",
                  "23.5 GiB in all", "2 libero envs", "runner.memory_check=warn"]:
        assert words in message, (words, message)
    fits = message.split("algorithm.sac.buffer_size=")[-1].split(".")[0]
    assert 10_000 < int(fits) < 100_000
    check_memory(compose([*SAC_ON_LIBERO, "env.num_envs=2", f"algorithm.sac.buffer_size={fits}"]), node=LAPTOP)


def test_too_many_env_processes_are_refused_naming_a_count_that_fits():
    message = _refusal(["env=libero_spatial", "env.num_envs=16"], NodeMemory(16 * GiB, 12 * GiB))
    assert "16 libero envs" in message and "env.num_envs=" in message
    fits = int(message.split("env.num_envs=")[-1].split(".")[0].split(";")[0])
    assert 2 <= fits < 16 and fits % 2 == 0  # a multiple of placement.env_workers
    check_memory(compose(["env=libero_spatial", f"env.num_envs={fits}"]), node=NodeMemory(16 * GiB, 12 * GiB))


def test_the_default_run_fits_a_small_machine_and_says_its_plan():
    lines = []
    plan = check_memory(compose([]), node=NodeMemory(8 * GiB, 6 * GiB), say=lines.append)
    assert 2 * GiB < plan.host_total() < 6 * GiB
    assert len(lines) == 1 and lines[0].startswith("memory plan: ~") and "6.0 GiB available" in lines[0]
    names = " ".join(i.what for i in plan.items)
    assert "128 maniskill envs" in names and "policy=mlp weights, gradients and Adam moments" in names


def test_the_policy_and_its_adam_state_are_counted():
    plan = plan_memory(compose(["policy=mlp"]), node=LAPTOP)
    rollout, actor = (next(i for i in plan.items if i.group == group and "policy=mlp" in i.what)
                      for group in ("rollout", "actor"))
    assert actor.bytes_each == 4 * rollout.bytes_each  # weights, gradients, two Adam moments (fp32)
    assert rollout.bytes_each == 4 * int(rollout.what.split("(")[1].split(" ")[0].replace(",", ""))


def test_warn_starts_it_and_off_plans_nothing():
    lines = []
    assert check_memory(compose([*SAC_ON_LIBERO, "runner.memory_check=warn"]), node=LAPTOP, say=lines.append)
    assert "warning" in lines[-1] and "algorithm.sac.buffer_size=1,000,000" in lines[-1]
    assert check_memory(compose([*SAC_ON_LIBERO, "runner.memory_check=off"]), node=LAPTOP) is None
    with pytest.raises(UserError, match="runner.memory_check"):
        check_memory(compose(["runner.memory_check=maybe"]), node=LAPTOP)


def test_rollout_only_probes_hold_no_buffer_or_optimizer():
    plan = plan_memory(compose(SAC_ON_LIBERO), rollout_only=True, node=LAPTOP)
    assert not [i for i in plan.items if i.group == "actor" and i.what != "actor worker processes"]


def test_joining_a_cluster_refuses_only_a_worker_no_node_can_hold():
    """On a cluster the workers spread over nodes the driver does not see: the total is not this node's, but the
    actor rank that holds the whole replay buffer must fit on one node."""
    joined = NodeMemory(int(23.5 * GiB), 21 * GiB, joined="10.0.0.1:6379")
    message = _refusal([*SAC_ON_LIBERO, "env.num_envs=2"], joined)
    assert "one actor worker runs on one node" in message and "algorithm.sac.buffer_size=" in message
    check_memory(compose(["env=libero_spatial", "env.num_envs=16"]), node=joined)  # 2 env workers of 13.5 GiB
    with pytest.raises(UserError):
        check_memory(compose(["env=libero_spatial", "env.num_envs=16"]), node=LAPTOP)  # both on this machine: no
    message = _refusal(["env=libero_spatial", "env.num_envs=32"], joined)  # 16 env processes per worker
    assert "one env worker runs on one node" in message
    assert "env.num_envs=24" in message  # 12 processes of 1.6 GiB a worker


def test_on_gpus_the_buffer_is_held_against_the_actors_gpu():
    gpu = NodeMemory(128 * GiB, 120 * GiB, gpus=(16 * GiB,))
    message = _refusal(["algorithm=sac", "policy=mlp_sac", "algorithm.sac.buffer_size=100000000"], gpu)
    assert "GPU 0, which has 16.0 GiB" in message and "algorithm.sac.buffer_size=" in message
    check_memory(compose(["algorithm=sac", "policy=mlp_sac"]), node=gpu)


# -- algorithm presets and the env's own process count -------------------------------------------------------------
def test_an_algorithm_preset_does_not_change_an_env_configs_process_count():
    assert compose(SAC_ON_LIBERO).env.num_envs == 2  # LIBERO's own choice
    assert compose(["algorithm=sac", "env=maniskill_pushcube_rgb"]).env.num_envs == 16


def test_the_sac_preset_still_sets_the_count_of_envs_that_choose_none():
    assert compose(["algorithm=sac", "policy=mlp_sac"]).env.num_envs == 32  # ManiSkill's SAC baseline
    assert compose([*SAC_ON_LIBERO, "env.num_envs=4"]).env.num_envs == 4  # the command line wins


# -- a failed allocation during a run ------------------------------------------------------------------------------
def _transitions(n: int = 2) -> Transitions:
    obs = {"state": torch.zeros(n, 3)}
    return Transitions(obs, torch.zeros(n, 2), torch.zeros(n), {"state": torch.zeros(n, 3)}, torch.zeros(n))


def test_a_buffer_the_allocator_refuses_is_a_config_error_naming_its_setting():
    buffer = ReplayBuffer(10**13, setting="algorithm.sac.buffer_size")  # ~400 TB: the allocator says no at once
    with pytest.raises(AllocationUserError) as refused:
        buffer.add(_transitions())
    assert "algorithm.sac.buffer_size=10,000,000,000,000" in str(refused.value)
    assert "lower algorithm.sac.buffer_size" in str(refused.value)


@pytest.mark.parametrize("err, allocation", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 49152000000 bytes. Error code 12 (Cannot allocate memory)"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 46.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("can't allocate memory"), False),
])
def test_what_counts_as_a_failed_allocation(err, allocation):
    assert is_allocation_failure(err) is allocation


def test_the_actor_names_its_settings_for_an_allocation_that_fails():
    with pytest.raises(AllocationUserError, match="Actor rank 0.*lower the algorithm's memory"):
        with allocations_are_config_errors("Actor rank 0, updating,", "the algorithm's memory"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    with pytest.raises(ValueError):  # anything else stays what it is
        with allocations_are_config_errors("Actor rank 0", "x"):
            raise ValueError("no")


def _failure(detail: str, fault_detail: str) -> WorkerFailure:
    return WorkerFailure("update", [WorkerFault("actor", 0, "crashed", "update", fault_detail)], detail)


def test_a_workers_failed_allocation_is_refused_not_recovered():
    from embodied.recovery import FaultLog, Recovery

    detail = "RayTaskError(RuntimeError): DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 bytes"
    spent = []
    faults = FaultLog(compose([]).runner)
    faults.spend = spent.append  # a restart spent would mean a retry
    recovery = Recovery(workers=None, faults=faults, note=print, restore_actor=lambda: (0, ""))

    def work():
        raise _failure(detail, "RuntimeError: DefaultCPUAllocator: can't allocate memory")

    with pytest.raises(UserError, match=r"actor worker \(update\) could not allocate memory.*sac.buffer_size"):
        recovery.guarded(work)
    assert spent == []
    # an env process killed by a signal names "out of memory" among the causes: still a fault, recovered from
    assert allocation_failure_of(_failure("EnvCrashedError: ... (-9: out of memory or killed, -11: crash)",
                                          "EnvCrashedError: died")) is None


# -- the command the issue ran --------------------------------------------------------------------------------------
def test_the_issues_command_exits_2_before_ray_starts_naming_the_buffer_and_the_memory():
    needed = 183.5 * GiB
    if psutil.virtual_memory().available > needed:
        pytest.skip("this machine holds the buffer: the run would start")
    started = time.perf_counter()
    proc = run_cli("train", *SAC_ON_LIBERO, timeout=120)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert elapsed < 60, elapsed  # imports and the plan; no env, no Ray
    assert "starting Ray" not in proc.stderr and "Started a local Ray instance" not in proc.stderr
    assert "Traceback" not in proc.stderr
    for words in ["error: This run would hold", "algorithm.sac.buffer_size=1,000,000", "183.5 GiB", "GiB available (",
                  "GiB in all)"]:
        assert words in proc.stderr, (words, proc.stderr)


def test_a_buffer_that_cannot_be_allocated_mid_run_stops_it_with_exit_2_not_restarts(tmp_path):
    """The plan skipped (runner.memory_check=off): the actor's first update cannot allocate the buffer, and the run
    stops at once with the setting named, instead of replacing the actor runner.max_worker_restarts times."""
    proc = run_cli("train", "env=free", "algorithm=sac", "policy=mlp_sac", "algorithm.sac.buffer_size=10000000000000",
                   "runner.memory_check=off", "env.num_envs=4", "placement.env_workers=1", "runner.total_env_steps=80",
                   "runner.max_minutes=null", "runner.eval_every=0", "runner.progress=false", "eval.episodes=4",
                   "eval.video_episodes=0", f"runner.run_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error and "could not allocate memory" in error[0] and "lower algorithm.sac.buffer_size" in error[0], error
    assert "replacing the workers" not in proc.stderr

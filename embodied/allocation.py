"""A failed allocation during a run is the run's configuration, not a fault: a worker that cannot allocate what
the settings ask for would fail the same way after every restart. :class:`AllocationUserError` (a UserError: exit 2,
one paragraph naming the settings to lower) is what the replay buffer (embodied/algorithms/replay.py) and the actor
worker raise for one; embodied/recovery.py refuses to retry a worker failure whose report names one
(:func:`allocation_failure_of`). Before a run, embodied/memory_plan.py refuses one that cannot fit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from envs.common import UserError


class AllocationUserError(UserError):
    """A worker could not allocate what the run's settings ask for: a configuration error (exit 2), which
    restarting the worker would only repeat. (Named ``...UserError``: the CLI finds a worker's bad input in Ray's
    report of a failed start by that word.)"""


def is_allocation_failure(err: BaseException) -> bool:
    """``err`` is a failed allocation: ``MemoryError`` (numpy's too), torch's ``OutOfMemoryError`` (CUDA),
    or the CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    return isinstance(err, RuntimeError) and _names_allocation(str(err))


# what a failed allocation's report says (torch's CUDA and CPU allocators, Python's and numpy's MemoryError); not
# "out of memory" alone: an env process's crash report names it as a possible cause of a kill (-9)
ALLOCATION_MARKERS = ("OutOfMemoryError", "can't allocate memory", "MemoryError")


def _names_allocation(text: str) -> bool:
    return any(marker in text for marker in ALLOCATION_MARKERS)


def allocation_error(what: str, err: BaseException | str, settings: str) -> AllocationUserError:
    """The paragraph for a failed allocation of ``what`` (``err``: the allocator's words), naming ``settings``."""
    words = str(err).strip().splitlines()
    detail = words[-1] if words else type(err).__name__
    return AllocationUserError(f"{what} could not allocate memory ({detail[:300]}). The run's settings ask for more "
                           f"memory than this machine has, which a restart cannot change: lower {settings}. "
                           "`embodied train` plans the memory before starting (runner.memory_check=on); its "
                           "start-up line says what each worker holds.")


@contextlib.contextmanager
def allocations_are_config_errors(what: str, settings: str) -> Iterator[None]:
    """A failed allocation inside becomes an :class:`AllocationUserError` naming ``settings``."""
    try:
        yield
    except AllocationUserError:
        raise
    except Exception as err:
        if is_allocation_failure(err):
            raise allocation_error(what, err, settings) from None
        raise


def allocation_failure_of(failure) -> AllocationUserError | None:
    """For a ``WorkerFailure`` whose worker raised a failed allocation (its detail says so): the configuration
    error it is (embodied/recovery.py raises it instead of replacing the worker), else None."""
    details = [failure.detail, *(f.detail for f in failure.faults)]
    named = next((d for d in details if d and _names_allocation(d)), None)
    if named is None:
        return None
    groups = sorted({f.group for f in failure.faults}) or ["a worker"]
    settings = " or ".join(GROUP_SETTINGS.get(g, "env.num_envs") for g in groups)
    return allocation_error(f"{', '.join(groups)} worker ({failure.call})", named, settings)


# the settings that size what each group's workers hold (what a failed allocation there names)
GROUP_SETTINGS = {
    "env": "env.num_envs (or env.image_size)",
    "rollout": "env.num_envs, algorithm.rollout_steps or the policy (policy=...)",
    "actor": "the algorithm's memory (algorithm.sac.buffer_size), its batch (env.num_envs x algorithm.rollout_steps, "
             "algorithm.num_minibatches) or the policy (policy=...)",
}

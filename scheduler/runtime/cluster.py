"""Start a local Ray cluster, or join an existing one."""

from __future__ import annotations

import os
import tempfile

from envs.rendering import ensure_vulkan_icd
from scheduler.runtime import reaper
from scheduler.runtime.plan import ClusterDevices, Device

# Ray 2.60 turns token auth on by default and writes ~/.ray/auth_token; a local
# research cluster does not need it, and tests must not write to the home dir.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

_reaper: reaper.Reaper | None = None  # the local cluster's, while this process runs one


def start_cluster(address: str | None = None, num_cpus: int | None = None,
                  num_gpus: int | None = None) -> dict:
    """Connect to Ray (no-op if connected); returns the cluster's resources.

    ``address=None`` starts a local cluster with ``num_cpus`` CPU slots (default: all
    cores) and ``num_gpus`` GPUs (default: what CUDA sees). That cluster ends with this
    process however it ends, SIGKILL included (:mod:`scheduler.runtime.reaper`); a cluster
    joined at ``address`` is left as it is.
    """
    import ray

    # workers inherit the driver's environment: pick the Vulkan driver here, once
    ensure_vulkan_icd()
    if not ray.is_initialized():
        kwargs: dict = dict(include_dashboard=False, log_to_driver=True, logging_level="ERROR")
        if address is None:
            kwargs.update(num_cpus=num_cpus or os.cpu_count(), num_gpus=num_gpus,
                          _temp_dir=os.environ.get("EMBODIED_RAY_TMP", os.path.join(tempfile.gettempdir(), "ray")))
            _start_local(ray, kwargs)
        else:
            kwargs["address"] = address
            ray.init(**kwargs)
    return dict(ray.cluster_resources())


def _start_local(ray, kwargs: dict) -> None:
    """``ray.init`` of a local cluster whose every process carries this run's token, after the
    reaper that ends them with the driver (scheduler/runtime/reaper.py). RAY_ADDRESS in the
    environment makes ``ray.init`` join that cluster instead: then there is nothing of ours to end."""
    global _reaper
    _end_reaper()  # one left by a ray.shutdown() called without stop_cluster()
    token = reaper.new_token()
    os.environ[reaper.RUN_VAR] = token  # before ray.init: gcs_server, the raylet and all below inherit it
    _reaper = reaper.start(token)
    try:
        ray.init(**kwargs)
    except BaseException:
        _end_reaper()
        raise
    node = ray._private.worker._global_node
    if node is None or not node.head:
        _end_reaper()
    else:
        _reaper.watch_session(node.get_session_dir_path())


def _end_reaper() -> None:
    global _reaper
    if _reaper is not None:
        _reaper.stop()
        _reaper = None
    os.environ.pop(reaper.RUN_VAR, None)


def cluster_devices():
    """The cluster's devices, numbered node by node (head node first, then by address).

    GPUs if any node has one, else CPU slots. Returns a
    :class:`~scheduler.runtime.plan.ClusterDevices`.
    """
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    nodes.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeManagerAddress"], n["NodeID"]))
    kind = "gpu" if any(n["Resources"].get("GPU", 0) >= 1 for n in nodes) else "cpu"
    resource = "GPU" if kind == "gpu" else "CPU"
    devices: list = []
    for node in nodes:
        for local in range(int(node["Resources"].get(resource, 0))):
            devices.append(Device(len(devices), node["NodeID"], local))
    return ClusterDevices(kind, devices)


def stop_cluster() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _end_reaper()

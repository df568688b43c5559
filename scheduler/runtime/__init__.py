"""The runtime: what runs a Plan once it is chosen. Worker groups of Ray actors (``worker.py``), the
channel between env and rollout workers (``channel.py``), the cluster (``cluster.py``), deadlines and
fault detection (``faults.py``), weight sync (``weight_sync.py``, ``weight_sync_strategies.py``),
offload and context switching (``offload.py``, ``context_switch.py``), the batch layout
(``layout.py``), data-parallel actor ranks (``data_parallel.py``) and the Plan itself (``plan.py``).

It knows nothing of RL or of how a plan is chosen: the planner (``scheduler/placement.py``,
``profiler.py``, ``cost_model.py``, ``planner.py``, ``auto.py``) is the layer above it, and
``embodied/`` above that (docs/architecture.md, "Layers").
"""

"""Predicted iteration time and per-device memory of an execution plan (pure functions).

A :class:`Profile` holds a fitted cost curve per stage, measured on this machine by
``scheduler/profiler.py`` as the workers run the stage (on a GPU, or a CPU slot; a CPU
actor's update uses every core, the other groups being idle then):
``seconds(n) = fixed_s + per_item_s * n`` for ``n`` envs stepped, observations inferred or
samples trained, and the same shape for memory. A :class:`Candidate` says which
devices each worker group gets and how many micro-batches (pipeline stages) an env
worker's slice is cut into. :func:`predict` combines them as the runner executes:

- messages: every micro-batch an env worker steps is one message through the channel and
  back (observations out, actions in). ``hop_s`` is the round trip of a lone message,
  ``message_s`` the cost of each further message of a step, ``shared_message_s`` the same
  when env and rollout workers share every device (colocated: no device is free to absorb
  Ray's work); all are measured on the real workers, since Ray calls cost CPU time that a
  core also needs for stepping and inferring;
- generation, ``S = 1`` (env and rollout take turns): per step, the ``De`` env workers step
  their slices in parallel, then each rollout worker infers the ``De / Dr`` slices it serves:
  ``T * (env(N / De) + (De / Dr) * infer(N / De) + hop + (De - 1) * message)`` (colocated:
  ``shared_message``);
- generation, ``S > 1`` (pipelined): per step each env worker steps ``S`` micro-batches of
  ``m = N / (De * S)`` envs while the rollout workers infer on the others; the slower side
  sets the pace, the ``De * S`` messages add their cost, and one micro-batch of each fills
  and drains the pipe:
  ``T * (max(S * env(m), (De * S / Dr) * infer(m)) + De * S * message) + env(m) + infer(m) + hop``;
- training: the PPO update over ``N * T`` samples on the actor's device; with ``R`` data-parallel
  actor ranks (``actor_ranks``), each trains on ``N * T / R`` of them and every gradient step
  adds a ring all-reduce of the gradients: ``(R - 1) * allreduce.fixed + 2 (R - 1) / R *
  allreduce.per_item * gradient_mib`` from the two-rank curve the profiler measured on a real
  process group (FSDP2 moves 1.5 times the bytes: two all-gathers and a reduce-scatter), plus
  the link where the ranks span nodes. CPU slots of one node share its cores, so ranks there
  are only as fast together as one rank using them all;
- several nodes (:class:`Network`): a message between an env worker and the rollout worker
  serving it on another node also crosses the link (latency, then its bytes at the link's
  bandwidth, which a pipeline's other micro-batches can hide), and a weight sync to rollout
  workers on other nodes sends the weights over it;
- switches: where the actor shares a device with env or rollout workers and ``offload``
  is on, one offload and one onload per iteration; plus one weight sync (every
  ``sync_every`` iterations under asynchronous collection);
- asynchronous collection (``Workload.overlap``, ``runner.collection=async``): the next
  rollout runs while the actor updates, so an iteration lasts as long as the slower of the two,
  or as the busiest device's work where groups share one: a device does the stepping, inferring
  and training of every group on it, one after another. No offload (the actor is busy while
  the envs run), and an algorithm may train on a single rank (``max_actor_ranks``: SAC's replay
  buffer and target critics are one rank's).

Memory per device is the sum of the groups resident on it; with offload a device holds
the larger of its generation phase (env + rollout) and its training phase (actor: its share
of the samples' activations, and of the weights, gradients and Adam state when sharded). A
GRPO workload (``group_size > 1``) also needs every micro-batch and every actor rank's share
to hold whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("colocated", "disaggregated", "hybrid")


@dataclass(frozen=True)
class Curve:
    """``fixed + per_item * n``: seconds (or MiB) for ``n`` items on one device."""

    fixed: float
    per_item: float

    def __call__(self, n: float) -> float:
        return self.fixed + self.per_item * n

    @classmethod
    def fit(cls, items: list[float], values: list[float]) -> Curve:
        """Least-squares line through ``(items, values)``, clamped to non-negative terms."""
        if len(items) == 1 or len(set(items)) == 1:
            return cls(0.0, max(values[0], 0.0) / max(items[0], 1e-12))
        n = len(items)
        mean_x, mean_y = sum(items) / n, sum(values) / n
        var = sum((x - mean_x) ** 2 for x in items)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(items, values, strict=True)) / var, 0.0)
        return cls(max(mean_y - slope * mean_x, 0.0), slope)

    def slower(self, factor: float) -> Curve:
        return Curve(self.fixed * factor, self.per_item * factor)


@dataclass(frozen=True)
class Profile:
    """Stage costs on one device. Times in seconds, memory in MiB."""

    env_step: Curve  # one step of n envs
    infer: Curve  # one policy act on n observations
    train: Curve  # one update of the run's algorithm (PPO: all epochs) over n samples
    hop_s: float = 0.0  # a lone message's env -> rollout -> env round trip through the channel
    message_s: float = 0.0  # each further message of a step (pipelined micro-batches, more env workers)
    shared_message_s: float = 0.0  # the same where env and rollout workers share every device (colocated)
    weight_sync_s: float = 0.0
    offload_s: float = 0.0  # the actor's offload + onload, once each
    env_memory: Curve = Curve(0.0, 0.0)  # n envs
    rollout_memory: Curve = Curve(0.0, 0.0)  # a policy copy inferring on n observations
    actor_memory: Curve = Curve(0.0, 0.0)  # weights, gradients and optimizer state training on n samples
    device_memory: float = float("inf")  # what one device holds
    weights_mib: float = 0.0  # the policy's parameters and buffers, as a weight sync sends them
    message_mib_per_env: float = 0.0  # one env's observation and action, as a message carries them
    episode_steps: int = 0  # the env's episode length in decisions (an iteration of rollout_steps: null)
    device_kind: str = "cpu"  # "gpu" or "cpu" (CPU slots share host memory: offloading frees nothing)
    allreduce: Curve = Curve(0.0, 0.0)  # one all-reduce of n MiB between two actor ranks
    gradient_mib: float = 0.0  # the trainable parameters' gradients, as a data-parallel step reduces them
    gradient_steps: int = 1  # optimizer steps per update (epochs x minibatches)
    parameters: int = 0  # the policy's, which placement.data_parallel=auto decides by


@dataclass(frozen=True)
class Network:
    """The cluster's shape for a what-if: ``devices_per_node`` devices per node (None: one
    node holds them all) joined by links of ``gbps`` gigabits per second and ``latency_s``."""

    devices_per_node: int | None = None
    gbps: float = 100.0
    latency_s: float = 20e-6

    def node(self, device: int) -> int:
        return device // self.devices_per_node if self.devices_per_node else 0

    def transfer_s(self, mib: float) -> float:
        """Seconds to move ``mib`` MiB over the link, latency excluded."""
        return mib * 8 * 2**20 / (self.gbps * 1e9)


ONE_NODE = Network()


@dataclass(frozen=True)
class Workload:
    num_envs: int  # N
    steps: int  # T: decisions per env per iteration
    group_size: int = 1  # GRPO: envs per group, which must not span micro-batches
    sharded: bool = False  # several actor ranks shard the policy (FSDP2) instead of replicating it
    overlap: bool = False  # asynchronous collection: the next rollout runs during the update
    sync_every: int = 1  # iterations per weight sync (runner.weight_sync_every; asynchronous collection)
    max_actor_ranks: int | None = None  # the most data-parallel actor ranks the algorithm trains on (None: any)


@dataclass(frozen=True)
class Candidate:
    """A plan: device counts per group, micro-batches per env worker, offload. Devices are
    numbered env first, then rollout, then actor: colocated groups all use ``0..D-1``; a hybrid
    actor shares the rollout workers' devices (the policy's weights are there already). One
    env worker and one rollout worker per device; ``actor_ranks`` data-parallel actor ranks, on
    the first devices of the actor's."""

    mode: str
    env_devices: int
    rollout_devices: int
    actor_devices: int
    stages: int = 1
    offload: bool = False
    actor_ranks: int = 1

    def name(self) -> str:
        ranks = f" ranks={self.actor_ranks}" if self.actor_ranks > 1 else ""
        return (f"{self.mode} env={self.env_devices} rollout={self.rollout_devices} actor={self.actor_devices}"
                f"{ranks} stages={self.stages}{' offload' if self.offload else ''}")

    def device_sets(self) -> dict[str, range]:
        """Which device indices each group uses."""
        e, r, a = self.env_devices, self.rollout_devices, self.actor_devices
        if self.mode == "colocated":
            return {"env": range(e), "rollout": range(r), "actor": range(a)}
        if self.mode == "hybrid":
            return {"env": range(e), "rollout": range(e, e + r), "actor": range(e, e + a)}
        return {"env": range(e), "rollout": range(e, e + r), "actor": range(e + r, e + r + a)}

    def total_devices(self) -> int:
        return max(max(s, default=-1) for s in self.device_sets().values()) + 1


@dataclass
class Prediction:
    candidate: Candidate
    generate_s: float
    train_s: float
    switch_s: float
    memory: dict[int, float] = field(default_factory=dict)  # device -> peak MiB
    infeasible: str = ""  # why the plan cannot run ("" when it can)
    overlapped_s: float | None = None  # asynchronous collection: rollout and update together (else None)

    @property
    def iteration_s(self) -> float:
        together = self.generate_s + self.train_s if self.overlapped_s is None else self.overlapped_s
        return together + self.switch_s

    @property
    def feasible(self) -> bool:
        return not self.infeasible


def remote_env_workers(c: Candidate, net: Network) -> int:
    """Env workers whose rollout worker (env rank ``r`` is served by rollout rank ``r % Dr``)
    is on another node."""
    sets = c.device_sets()
    env, rollout = list(sets["env"]), list(sets["rollout"])
    return sum(net.node(env[r]) != net.node(rollout[r % len(rollout)]) for r in range(len(env)))


def generate_seconds(c: Candidate, p: Profile, w: Workload, net: Network = ONE_NODE) -> float:
    """Time of one iteration's rollout: ``w.steps`` steps of every env (see the module doc)."""
    env_slice = w.num_envs / c.env_devices
    served = c.env_devices / c.rollout_devices  # env slices (micro-batches) per rollout worker
    remote = remote_env_workers(c, net)
    latency = net.latency_s if remote else 0.0
    link = net.transfer_s(remote * env_slice * p.message_mib_per_env)  # a step's remote bytes
    if c.stages == 1:
        further = p.shared_message_s if c.mode == "colocated" else p.message_s
        per_step = (p.env_step(env_slice) + served * p.infer(env_slice) + p.hop_s
                    + (c.env_devices - 1) * further + latency + link)
        return w.steps * per_step
    micro = env_slice / c.stages
    pace = max(c.stages * p.env_step(micro), c.stages * served * p.infer(micro), link)
    messages = c.env_devices * c.stages * p.message_s
    fill = p.env_step(micro) + p.infer(micro) + p.hop_s + latency
    return w.steps * (pace + messages) + fill


def allreduce_seconds(ranks: list[int], p: Profile, w: Workload, net: Network = ONE_NODE) -> float:
    """One gradient step's reduction over the actor ranks on devices ``ranks`` (a ring)."""
    r = len(ranks)
    if r == 1:
        return 0.0
    volume = (1.5 if w.sharded else 1.0) * 2 * (r - 1) / r * p.gradient_mib
    seconds = (r - 1) * p.allreduce.fixed + volume * p.allreduce.per_item
    if len({net.node(d) for d in ranks}) > 1:
        seconds += 2 * (r - 1) * net.latency_s + net.transfer_s(volume)
    return seconds


def train_seconds(c: Candidate, p: Profile, w: Workload, net: Network = ONE_NODE) -> float:
    """The update over the iteration's samples, split over ``c.actor_ranks`` ranks (see the module doc)."""
    ranks = list(c.device_sets()["actor"])[:c.actor_ranks]
    share = w.num_envs * w.steps / len(ranks)
    crowd = 1
    if p.device_kind == "cpu":  # the slots of a node share its cores
        per_node = [net.node(d) for d in ranks]
        crowd = max(per_node.count(node) for node in set(per_node))
    return p.train(share) * crowd + p.gradient_steps * allreduce_seconds(ranks, p, w, net)


def weight_sync_seconds(c: Candidate, p: Profile, net: Network = ONE_NODE) -> float:
    """The measured (one-node) sync, plus sending the weights to rollout workers on other nodes."""
    sets = c.device_sets()
    actor_node = net.node(sets["actor"][0])
    if all(net.node(d) == actor_node for d in sets["rollout"]):
        return p.weight_sync_s
    return p.weight_sync_s + net.latency_s + net.transfer_s(p.weights_mib)


def overlapped_seconds(c: Candidate, p: Profile, w: Workload, generate_s: float, train_s: float) -> float:
    """An asynchronous iteration's rollout and update, run at once: the slower of the two, or the busiest
    device, which steps, infers and trains for every group on it in turn (see the module doc)."""
    sets = c.device_sets()
    micro = w.num_envs / (c.env_devices * c.stages)
    served = c.env_devices / c.rollout_devices
    busy: dict[int, float] = {}
    work = ([(d, w.steps * c.stages * p.env_step(micro)) for d in sets["env"]]
            + [(d, w.steps * c.stages * served * p.infer(micro)) for d in sets["rollout"]]
            + [(d, train_s) for d in list(sets["actor"])[:c.actor_ranks]])
    for device, seconds in work:
        busy[device] = busy.get(device, 0.0) + seconds
    return max(generate_s, train_s, *busy.values())


def shares_actor(c: Candidate) -> bool:
    sets = c.device_sets()
    return bool(set(sets["actor"]) & (set(sets["env"]) | set(sets["rollout"])))


def device_memory(c: Candidate, p: Profile, w: Workload) -> dict[int, float]:
    """Peak MiB per device: generation-phase groups and the actor, summed or (offload) alternating."""
    sets = c.device_sets()
    generation: dict[int, float] = {}
    for d in sets["env"]:
        generation[d] = generation.get(d, 0.0) + p.env_memory(w.num_envs / c.env_devices)
    for d in sets["rollout"]:
        generation[d] = generation.get(d, 0.0) + p.rollout_memory(w.num_envs / c.rollout_devices)
    peak = dict(generation)
    share = w.num_envs * w.steps / c.actor_ranks
    state = p.actor_memory.fixed / c.actor_ranks if w.sharded else p.actor_memory.fixed  # weights, grads, Adam
    actor = state + p.actor_memory.per_item * share
    for d in sets["actor"][:c.actor_ranks]:
        peak[d] = max(generation.get(d, 0.0), actor) if c.offload else generation.get(d, 0.0) + actor
    return peak


def predict(c: Candidate, p: Profile, w: Workload, net: Network = ONE_NODE) -> Prediction:
    """Predicted iteration time and memory of plan ``c`` for workload ``w`` under profile ``p``
    on a cluster shaped as ``net``."""
    sync = weight_sync_seconds(c, p, net) / (w.sync_every if w.overlap else 1)
    switch = sync + (p.offload_s if c.offload and shares_actor(c) else 0.0)
    generate, train = generate_seconds(c, p, w, net), train_seconds(c, p, w, net)
    out = Prediction(c, generate, train, switch, device_memory(c, p, w),
                     overlapped_s=overlapped_seconds(c, p, w, generate, train) if w.overlap else None)
    full = [d for d, mib in out.memory.items() if mib > p.device_memory]
    if w.overlap and c.offload:
        out.infeasible = "asynchronous collection keeps the actor busy while the envs run: it cannot be offloaded"
    elif w.max_actor_ranks is not None and c.actor_ranks > w.max_actor_ranks:
        out.infeasible = f"the algorithm trains on at most {w.max_actor_ranks} actor rank(s)"
    elif full:
        out.infeasible = (f"needs {max(out.memory.values()):.0f} MiB on device {full[0]}, "
                          f"which holds {p.device_memory:.0f}")
    elif w.num_envs % (c.env_devices * c.stages):
        out.infeasible = f"{w.num_envs} envs do not split into {c.env_devices} x {c.stages} micro-batches"
    elif (w.num_envs // (c.env_devices * c.stages)) % w.group_size:
        out.infeasible = f"micro-batches of {w.num_envs // (c.env_devices * c.stages)} envs split GRPO groups"
    elif c.actor_ranks > c.actor_devices:
        out.infeasible = f"{c.actor_ranks} actor ranks on {c.actor_devices} device(s): one device each"
    elif w.num_envs % c.actor_ranks or (w.num_envs // c.actor_ranks) % w.group_size:
        out.infeasible = f"{w.num_envs} envs do not split into {c.actor_ranks} actor ranks' shares of whole groups"
    return out

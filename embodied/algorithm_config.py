"""The ``algorithm`` section of the schema (embodied/config.py holds the rest): the keys the
on-policy algorithms read (PPO, GRPO) flat, and SAC's in ``algorithm.sac``.

An algorithm reads ``algorithm.name``, ``lr``, ``gamma``, ``bootstrap`` and ``rollout_steps`` and the
keys documented for it here; ``configs/algorithm/<name>.yaml`` holds how its option differs from
these defaults (the default run's, PPO).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from embodied.config_ranges import ranged


@dataclass
class SACConfig:
    """``algorithm.sac``: soft actor-critic (embodied/algorithms/sac.py), and demo-mixed (RLPD)."""

    buffer_size: int = ranged(1_000_000, 1)  # replay capacity in transitions (the oldest are overwritten)
    # keep the replay buffer in checkpoints, so `resume=` continues with it (its size is in the run log);
    # false: a resumed run refills it from scratch
    save_buffer: bool = True
    batch_size: int = ranged(256, 1)  # transitions per gradient step
    learning_starts: int = ranged(4000, 0)  # transitions in the buffer before the first gradient step
    utd: float = ranged(0.5, 0, above=True)  # update-to-data ratio: gradient steps per env step collected
    tau: float = ranged(0.01, 0, 1, above=True)  # Polyak rate of the target critics: target += tau * (Q - target)
    target_every: int = ranged(1, 1)  # gradient steps between target updates
    actor_every: int = ranged(1, 1)  # gradient steps between actor (and temperature) steps (TD3's delay)
    q_lr: float | None = ranged(None, 0, above=True)  # the critics' learning rate; None: algorithm.lr
    alpha: float = ranged(0.2, 0, above=True)  # initial entropy temperature
    autotune: bool = True  # learn the temperature so the policy's entropy tracks target_entropy
    alpha_lr: float = ranged(3e-4, 0, above=True)
    target_entropy: float | None = ranged(None)  # any value; None: -action_dim (the SAC paper's heuristic)
    # bootstrap the target from n steps ahead: r_t + ... + gamma^(n-1) r_(t+n-1) + gamma^n V(s_(t+n)), cut at
    # episode ends and at the end of an iteration's rollout (then fewer steps, discounted as many)
    n_step: int = ranged(1, 1)
    # RLPD: the share of every batch drawn from demonstrations, the motion-planner demos `embodied sft` uses
    # (sft.demos of them, from sft.demo_seed on, cached in sft.demos_dir); 0: plain SAC. RLPD draws half,
    # with LayerNorm critics (policy.net.q_layer_norm, on by default)
    demo_fraction: float = ranged(0.0, 0, 1)


@dataclass
class AlgorithmConfig:
    name: str = "ppo"  # the algorithm (embodied/algorithms/registry.py: ppo, grpo); configs/algorithm/ files set it
    advantage: str = "gae"  # registered in embodied/algorithms/advantages.py
    loss: str = "ppo"  # registered in embodied/algorithms/losses.py
    lr: float = ranged(3e-4, 0, above=True)
    anneal_lr: bool = False  # linearly decay lr to 0 over runner.total_env_steps
    gamma: float = ranged(0.8, 0, 1)
    gae_lambda: float = ranged(0.9, 0, 1)
    # decisions per env per iteration (env steps; action chunks of chunk_size steps for chunked VLAs);
    # None: one episode, the env's max_episode_steps
    rollout_steps: int | None = ranged(25, 1)
    update_epochs: int = ranged(8, 1)
    num_minibatches: int = ranged(16, 1)
    clip_coef: float = ranged(0.2, 0, above=True)
    # upper ratio clip 1 + this (asymmetric, "clip-higher"); None: clip_coef
    clip_coef_high: float | None = ranged(None, 0, above=True)
    clip_vloss: bool = False
    vf_coef: float = ranged(0.5, 0)
    ent_coef: float = ranged(0.0)  # entropy bonus weight (any sign)
    max_grad_norm: float = ranged(0.5, 0, above=True)
    target_kl: float | None = ranged(0.1, 0, above=True)  # stop an update's epochs early past this KL
    normalize_advantages: bool = True
    # what one PPO ratio covers for token policies (VLAs): "token" (one ratio per action token),
    # "action" (the sum over an action's tokens) or "chunk" (over a whole action chunk); a Gaussian
    # policy's log-prob is already one action's. See embodied/algorithms/logprob_levels.py
    logprob_level: str = "action"
    # where an episode ends, add gamma * V(final obs) to the reward at: "all_ends" (ManiSkill's
    # convention: success ends an episode only to reset the env, its value carries on),
    # "time_limit" (truncations only: terminations are true terminal states) or "none"
    bootstrap: str = "all_ends"
    # GRPO (advantage: grpo): envs per group. Every iteration the envs are reset, a group's envs
    # from one initial state (one seed), and each env's first episode is scored by its outcome
    # (its return) against its group's: A = (R - mean) / (std + 1e-6); later steps are not trained on
    group_size: int = ranged(1, 1)
    filter_uniform_groups: bool = False  # GRPO: drop groups whose episodes all scored the same (A = 0)
    # GRPO: "episode" weighs every episode the same in the loss (the GRPO paper's 1/|o_i|), "step"
    # every step (DAPO's token-level sum: long, usually failed, episodes count more)
    grpo_weighting: str = "episode"
    # PPO from a warm start: the first N updates train only the critic (no policy loss; only the
    # policy's critic parameters step), so a fresh value head's random advantages never move the
    # warm-started actor. 0: actor and critic from the first update
    critic_warmup_iterations: int = ranged(0, 0)
    # learning rate of the critic's own parameters (a VLA's new value head needs a far larger one than
    # the fine-tuned backbone); None: algorithm.lr. anneal_lr scales both alike
    critic_lr: float | None = ranged(None, 0, above=True)
    # beta of a KL(policy || warm start) penalty on the sampled actions' log-probs (0: none)
    kl_coef: float = ranged(0.0, 0)
    sac: SACConfig = field(default_factory=SACConfig)  # algorithm=sac only

"""VLA policies behind the Policy protocol (tiny OpenVLA, OpenVLA-OFT and Qwen2.5-VL VLA, CPU):
log-probs at every level, sampling, action chunks, LoRA, loading a saved directory. The token-action
tests also run on policy=mlp_tokens, the same action path on an MLP trunk."""


from types import SimpleNamespace

import pytest
import torch

from embodied.algorithms.losses import kl_to_reference
from embodied.algorithms.ppo import critic_warmup_update, ppo_update
from embodied.config import compose
from envs.messages import Trajectory
from policies.registry import make_policy

SPEC = {"rgb": ((96, 96, 3), torch.uint8), "state": ((9,), torch.float32)}
ACTION_DIM = 4


MODELS = ["openvla_tiny", "openvla_oft_tiny", "qwen_vl_tiny"]
# every policy on the VLAs' token-action path: the VLAs and the MLP trunk (policies/mlp_tokens.py)
TOKEN_POLICIES = [*MODELS, "mlp_tokens", "mlp_tokens policy.net.token_head=logits"]


def _policy(model: str, *overrides: str, seed: int = 0):
    """``model``: a policy config's name, optionally followed by overrides of its own."""
    model, *own = model.split()
    cfg = compose([f"policy={model}", "policy.vla.instruction=push the cube", *own, *overrides]).policy
    torch.manual_seed(seed)
    return make_policy(cfg, SPEC, ACTION_DIM)


def _obs(batch: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"rgb": torch.randint(0, 256, (batch, 96, 96, 3), generator=g, dtype=torch.uint8),
            "state": torch.randn(batch, 9, generator=g)}


@pytest.fixture(scope="module", params=TOKEN_POLICIES)
def policy(request):
    return _policy(request.param, "policy.chunk_size=1").eval()


@pytest.fixture(scope="module", params=TOKEN_POLICIES)
def chunked(request):
    """The same models decoding a chunk of 3 actions per decision."""
    return _policy(request.param, "policy.chunk_size=3").eval()


def test_rollout_log_probs_equal_the_teacher_forced_ones(chunked):
    tokens = 3 * ACTION_DIM
    obs, noise = _obs(), torch.randn(6, tokens, generator=torch.Generator().manual_seed(1))
    bins, logprob, value = chunked.act(obs, noise=noise)
    token_logp, entropy, value_again = chunked.token_logprobs(obs, bins)
    new_logp, total_entropy, _ = chunked.evaluate(obs, bins)
    torch.testing.assert_close(token_logp, logprob, atol=1e-4, rtol=0)  # KV-cached (or parallel) vs one pass
    torch.testing.assert_close(new_logp, token_logp)
    torch.testing.assert_close(total_entropy, entropy.sum(-1))
    torch.testing.assert_close(value_again, value, atol=1e-5, rtol=0)
    assert bins.shape == logprob.shape == (6, tokens) and bool((token_logp < 0).all())


def test_log_prob_levels_sum_consistently(chunked):
    """chunk = sum of its actions = sum of its tokens; an action = sum of its A tokens."""
    from embodied.algorithms.logprob_levels import group_logprobs

    bins, token_logp, _ = chunked.act(_obs(), noise=torch.randn(6, 3 * ACTION_DIM))
    token = group_logprobs(token_logp, "token", ACTION_DIM)
    action = group_logprobs(token_logp, "action", ACTION_DIM)
    chunk = group_logprobs(token_logp, "chunk", ACTION_DIM)
    assert token.shape == (6, 12) and action.shape == (6, 3) and chunk.shape == (6, 1)
    torch.testing.assert_close(action[:, 1], token_logp[:, ACTION_DIM:2 * ACTION_DIM].sum(-1))
    torch.testing.assert_close(chunk[:, 0], action.sum(-1))
    torch.testing.assert_close(chunk[:, 0], token.sum(-1))
    assert not torch.allclose(action[:, 0], action[:, 1])  # the actions of a chunk are scored apart


def test_a_chunk_decodes_into_actions_in_order(chunked):
    bins, _, _ = chunked.act(_obs(), deterministic=True)
    actions = chunked.to_env(bins)
    assert actions.shape == (6, 3, ACTION_DIM) and bool((actions.abs() <= 1).all())
    second = chunked.actions.decode(chunked.actions.action_ids[bins[:, ACTION_DIM:2 * ACTION_DIM].long()])
    assert torch.equal(actions[:, 1], second)


def test_sampling_follows_the_noise_and_not_the_batch_split(policy):
    obs, noise = _obs(), torch.randn(6, ACTION_DIM, generator=torch.Generator().manual_seed(2))
    bins, _, _ = policy.act(obs, noise=noise)
    assert torch.equal(policy.act(obs, noise=noise)[0], bins)
    half = policy.act({k: v[:3] for k, v in obs.items()}, noise=noise[:3])[0]
    assert torch.equal(half, bins[:3])
    assert not torch.equal(policy.act(obs, noise=-noise)[0], bins)


def test_greedy_actions_are_each_tokens_mode_and_decode_into_the_box(policy):
    obs = _obs()
    bins, _, _ = policy.act(obs, deterministic=True)
    logp, _ = policy.bin_distributions(obs, bins)
    assert torch.equal(logp.argmax(-1), bins.long())
    actions = policy.to_env(bins)
    assert actions.shape == (6, ACTION_DIM) and bool((actions.abs() <= 1).all())


@pytest.mark.parametrize("model", MODELS)
def test_lora_update_changes_only_adapters_and_value_head(model):
    policy = _policy(model, "policy.vla.lora_rank=4")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    # the new heads train from scratch: the value head, and OFT's proprio projector
    assert trainable and all("lora_" in n or n.startswith(("value_head", "proprio_projector")) for n in trainable)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    obs = _obs(8)
    bins, logprob, value = policy.act(obs)
    batch = Trajectory(obs={k: v[None] for k, v in obs.items()}, actions=bins[None], logprobs=logprob[None],
                       values=value[None], rewards=torch.randn(1, 8), dones=torch.ones(1, 8, dtype=torch.bool),
                       next_value=torch.zeros(8))
    cfg = compose(["algorithm.update_epochs=1", "algorithm.num_minibatches=2",
                   "algorithm.logprob_level=token"]).algorithm
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    ppo_update(policy, optimizer, batch, cfg)
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert any("lora_" in n for n in changed) and any(n.startswith("value_head") for n in changed)


@pytest.mark.parametrize("model", MODELS)
def test_a_saved_model_directory_loads_offline_and_acts_identically(tmp_path, monkeypatch, model):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    policy = _policy(model, "policy.chunk_size=1").eval()
    policy.save_pretrained(tmp_path)
    loaded = _policy(model, f"policy.vla.model_path={tmp_path}", "policy.chunk_size=1", seed=1).eval()
    loaded.value_head.load_state_dict(policy.value_head.state_dict())
    obs, noise = _obs(), torch.randn(6, ACTION_DIM, generator=torch.Generator().manual_seed(3))
    for a, b in zip(loaded.act(obs, noise=noise), policy.act(obs, noise=noise), strict=True):
        assert torch.equal(a, b)
    bins = policy.act(obs, noise=noise)[0]
    for a, b in zip(loaded.bin_distributions(obs, bins), policy.bin_distributions(obs, bins), strict=True):
        assert torch.equal(a, b)  # every action token's (log-softmaxed) logits


@pytest.mark.parametrize("model", MODELS)
def test_policy_needs_images(model):
    from envs.common import UserError

    cfg = compose([f"policy={model}"]).policy
    with pytest.raises(UserError, match="obs_mode: rgb"):
        make_policy(cfg, {"state": ((9,), torch.float32)}, ACTION_DIM)




def test_a_checkpoints_norm_stats_unnormalise_its_actions(tmp_path, monkeypatch):
    """Real OpenVLA checkpoints carry per-dataset q01/q99 (config.json ``norm_stats``)."""
    from envs.common import UserError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    policy = _policy("openvla_tiny")
    stats = {"q01": [-0.5, 0.0, 0.0, 0.0], "q99": [0.5, 2.0, 2.0, 2.0], "mask": [True, True, True, False]}
    policy.model.config.norm_stats = {"bridge_orig": {"action": stats}}
    policy.save_pretrained(tmp_path)
    loaded = _policy("openvla_tiny", f"policy.vla.model_path={tmp_path}")
    actions = loaded.to_env(torch.tensor([[0.0, 255.0, 128.0, 0.0], [255.0, 0.0, 0.0, 255.0]]))
    assert -0.5 <= float(actions[:, 0].min()) < -0.49 and 0.49 < float(actions[:, 0].max()) <= 0.5
    assert 1.99 < float(actions[0, 1]) <= 2.0 and 0.99 < float(actions[0, 2]) < 1.01  # bin 128: mid-range
    assert -1.0 <= float(actions[0, 3]) < -0.99  # the unmasked dimension stays in [-1, 1]
    policy.model.config.norm_stats["fractal"] = {"action": stats}
    policy.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"policy.vla.unnorm_key=None: .*\['bridge_orig', 'fractal'\]"):
        _policy("openvla_tiny", f"policy.vla.model_path={tmp_path}")
    assert _policy("openvla_tiny", f"policy.vla.model_path={tmp_path}", "policy.vla.unnorm_key=fractal").action_dim == 4


@pytest.mark.parametrize("model", MODELS)
def test_dataset_stats_travel_with_the_weights_and_the_model_directory(tmp_path, monkeypatch, model):
    """SFT sets the demos' q01 / q99: a checkpoint's state dict and a save_pretrained directory
    carry them, and a state dict saved before they existed loads as [-1, 1] actions."""
    from policies.vla.action_tokenizer import ActionStats

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    policy = _policy(model, "policy.chunk_size=1")
    stats = ActionStats(torch.tensor([-0.1, 0.0, -2.0, -1.0]), torch.tensor([0.1, 0.5, 2.0, 1.0]),
                        torch.tensor([True, True, True, False]))
    policy.set_action_stats(stats)
    bins = torch.tensor([[0.0, 255.0, 128.0, 0.0]])
    expected = policy.to_env(bins)
    assert float(expected[0, 0]) == pytest.approx(-0.1, abs=1e-3) and 0.49 < float(expected[0, 1]) <= 0.5

    fresh = _policy(model, "policy.chunk_size=1", seed=1)
    assert not torch.allclose(fresh.to_env(bins), expected)
    fresh.load_state_dict(policy.state_dict())
    torch.testing.assert_close(fresh.to_env(bins), expected)

    policy.save_pretrained(tmp_path)
    policy = _policy(model, f"policy.vla.model_path={tmp_path}", "policy.chunk_size=1")
    torch.testing.assert_close(policy.to_env(bins), expected)

    old = {k: v for k, v in policy.state_dict().items() if k != "action_stats"}
    fresh.load_state_dict(old)
    torch.testing.assert_close(fresh.to_env(bins), _policy(model, "policy.chunk_size=1").to_env(bins))


def test_openvla_prompts_end_with_the_empty_piece_its_training_saw():
    """OpenVLA's Llama tokenizer ends "Out: " on the lone word-boundary piece (29871); the tiny byte
    tokenizer has none. Appended once, where missing, with its mask."""
    policy = _policy("openvla_tiny")
    assert policy.empty_piece is None
    plain, plain_mask = policy._prompt_ids(_obs(2))
    policy.empty_piece = 7
    ids, mask = policy._prompt_ids(_obs(2))
    assert torch.equal(ids[:, :-1], plain) and ids[:, -1].tolist() == [7, 7] and mask[:, -1].tolist() == [1, 1]
    policy.empty_piece = int(plain[0, -1])  # the prompt already ends with it: nothing appended
    assert torch.equal(policy._prompt_ids(_obs(2))[0], plain)


@pytest.mark.parametrize("model", ["cnn", "openvla_oft_tiny"])
def test_critic_warmup_update_trains_only_the_critic_and_fits_the_returns(model):
    """Both share an encoder between actor and critic: a critic-only update must leave the encoder
    and the actor bit-identical (the warm start's actions unchanged) while the value loss falls."""
    if model == "cnn":
        torch.manual_seed(0)
        policy = make_policy(compose(["policy=cnn"]).policy, SPEC, ACTION_DIM)
    else:
        policy = _policy(model)
    obs = _obs(16)
    actions, logprob, value = policy.act(obs)
    rewards = torch.linspace(-1, 1, 16)[None]
    batch = Trajectory(obs={k: v[None] for k, v in obs.items()}, actions=actions[None], logprobs=logprob[None],
                       values=value[None], rewards=rewards, dones=torch.ones(1, 16, dtype=torch.bool),
                       next_value=torch.zeros(16))
    cfg = compose(["algorithm.update_epochs=40", "algorithm.num_minibatches=1", "algorithm.target_kl=null"]).algorithm
    critic = {n for n, _ in policy.named_parameters() if n.startswith(policy.critic_modules)}
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    stats = critic_warmup_update(policy, optimizer, batch, cfg)
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert critic and changed == critic
    assert stats["critic_only"] == 1.0
    new_value = policy.value(obs)
    assert ((new_value - rewards[0]) ** 2).mean() < 0.5 * ((value - rewards[0]) ** 2).mean()
    # the next, full update moves the actor too
    ppo_update(policy, optimizer, batch, compose(["algorithm.update_epochs=1"]).algorithm)
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters() if n not in critic)


@pytest.mark.parametrize("kl_coef", [0.0, 3.0])
def test_kl_coef_pulls_a_drifted_policy_back_to_its_reference(kl_coef):
    """With a reference (the warm start) and kl_coef > 0, the update shrinks the KL between them;
    with kl_coef 0 the reference is ignored."""
    import copy

    policy = _policy("openvla_oft_tiny")
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    with torch.no_grad():  # drift every weight away from the reference
        for param in policy.parameters():
            param.add_(0.01 * torch.randn_like(param))
    obs = _obs(16)
    actions, logprob, value = policy.act(obs)

    def kl() -> float:
        with torch.no_grad():
            return kl_to_reference(policy.evaluate(obs, actions)[0], reference.evaluate(obs, actions)[0]).item()

    batch = Trajectory(obs={k: v[None] for k, v in obs.items()}, actions=actions[None], logprobs=logprob[None],
                       values=value[None], rewards=torch.zeros(1, 16), dones=torch.ones(1, 16, dtype=torch.bool),
                       next_value=torch.zeros(16))
    cfg = compose(["algorithm.update_epochs=10", "algorithm.num_minibatches=1", "algorithm.target_kl=null",
                   "algorithm.vf_coef=0", "algorithm.normalize_advantages=false",
                   f"algorithm.kl_coef={kl_coef}"]).algorithm
    before = kl()
    stats = ppo_update(policy, torch.optim.Adam(policy.parameters(), lr=1e-3), batch, cfg, reference=reference)
    if kl_coef:
        assert kl() < 0.5 * before and stats["kl_to_reference"] > 0
    else:
        assert "kl_to_reference" not in stats


def test_critic_lr_puts_the_critic_in_its_own_group_and_annealing_keeps_the_ratio():
    from embodied.algorithms.ppo import optimizer_groups
    from embodied.workers.actor_worker import ActorWorker

    policy = _policy("openvla_oft_tiny")
    cfg = compose(["algorithm.lr=1e-5", "algorithm.critic_lr=1e-3"]).algorithm
    actor_group, critic_group = optimizer_groups(policy, cfg)
    head = {id(p) for p in policy.value_head.parameters()}
    assert {id(p) for p in critic_group["params"]} == head and critic_group["lr"] == 1e-3
    assert not head & {id(p) for p in actor_group["params"]} and actor_group["lr"] == 1e-5
    assert len(actor_group["params"]) + len(critic_group["params"]) == len(list(policy.parameters()))
    optimizer = torch.optim.Adam(optimizer_groups(policy, cfg))
    ActorWorker.set_lr(SimpleNamespace(optimizer=optimizer), 0.5e-5)  # annealed to half
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5e-5, 0.5e-3])
    assert len(optimizer_groups(policy, compose([]).algorithm)) == 1  # no critic_lr: one group, as before

import gymnasium as gym
import numpy as np
import pytest
import torch

from visppo.config import ModelConfig
from visppo.policy import ActorCritic

OBS = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 64, 64), np.uint8),
                       "state": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)})


def _obs(n=6):
    return {"pixels": torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8), "state": torch.randn(n, 4)}


def test_gaussian_logp_is_of_the_unclipped_sample():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(init_log_std=1.0))
    obs = _obs(64)
    action, logp, value = pol.act(obs)
    assert (action.abs() > 1).any(), "with std e^1 some samples leave the bounds"
    lp, ent, v = pol.score_actions(obs, action)
    torch.testing.assert_close(lp, logp)
    torch.testing.assert_close(v, value)
    mean = pol.actor(pol.encoder(obs))
    expected = torch.distributions.Normal(mean, torch.e).log_prob(action).sum(-1)
    torch.testing.assert_close(lp, expected)
    assert pol.log_std.shape == (2,)  # state-independent


def test_categorical_for_discrete():
    pol = ActorCritic(OBS, gym.spaces.Discrete(5), ModelConfig())
    action, logp, value = pol.act(_obs())
    assert action.dtype == torch.long and action.shape == (6,)
    assert torch.all(logp <= 0) and value.shape == (6,)
    det, _, _ = pol.act(_obs(), deterministic=True)
    assert det.shape == (6,)


@pytest.mark.parametrize("share", [True, False])
def test_shared_or_separate_critic_encoder(share):
    pol = ActorCritic(OBS, gym.spaces.Discrete(3), ModelConfig(share_encoder=share))
    assert (pol.critic_encoder is None) == share
    n_enc = sum(p.numel() for p in pol.encoder.parameters())
    assert len(pol.encoder_parameters()) == (1 if share else 2) * len(list(pol.encoder.parameters()))
    # the critic's gradient reaches the actor's encoder only when shared
    obs = _obs()
    pol.value(obs).sum().backward()
    reached = pol.encoder.pixels.convs[0].weight.grad is not None
    assert reached == share and n_enc > 0


def test_shared_layers_feed_both_heads_and_both_losses_train_them():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,)), ModelConfig(shared_layers=2, hidden_dim=32))
    assert pol.actor[0].in_features == 32 and pol.critic[0].in_features == 32
    obs, action = _obs(), torch.zeros(6, 2)
    logp, _, value = pol.score_actions(obs, action)
    first = pol.encoder.shared[0].weight
    logp.sum().backward(retain_graph=True)
    from_actor = first.grad.clone()
    pol.zero_grad()
    value.sum().backward()
    assert from_actor.abs().sum() > 0 and first.grad.abs().sum() > 0
    separate = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,)), ModelConfig(shared_layers=1, share_encoder=False))
    assert separate.critic_encoder.shared is not separate.encoder.shared  # the critic's encoder has its own


def test_unsupported_action_space():
    with pytest.raises(ValueError, match="not supported"):
        ActorCritic(OBS, gym.spaces.MultiBinary(3), ModelConfig())


@pytest.mark.parametrize("action_space, share_encoder", [
    (gym.spaces.Box(-1, 1, (2,), np.float32), True),
    (gym.spaces.Box(-1, 1, (2,), np.float32), False),
    (gym.spaces.Discrete(5), True),
])
def test_acting_in_chunks_draws_what_one_pass_draws(action_space, share_encoder):
    """``act(chunk=3)`` and ``value(chunk=3)`` over 10 observations: the encoders never see more than
    3 at a time, and for the same RNG state the actions, log-probs and values are one pass's."""
    torch.manual_seed(0)
    space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 24, 24), np.uint8)})
    policy = ActorCritic(space, action_space, ModelConfig(feature_dim=16, hidden_dim=16,
                                                          share_encoder=share_encoder)).eval()
    obs = {"pixels": torch.randint(0, 256, (10, 3, 24, 24), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(1))}
    with torch.inference_mode():
        torch.manual_seed(7)
        whole = policy.act(obs)
        seen = []
        for enc in policy.encoders():
            enc.register_forward_pre_hook(lambda module, args: seen.append(args[0]["pixels"].shape[0]))
        torch.manual_seed(7)
        chunked = policy.act(obs, chunk=3)
        assert max(seen) == 3 and sum(seen) == 10 * len(policy.encoders())
        for mine, theirs in zip(chunked, whole, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        seen.clear()
        torch.testing.assert_close(policy.value(obs, chunk=3), whole[2], rtol=1e-5, atol=1e-6)
        assert max(seen) == 3


@pytest.mark.parametrize("discrete", [False, True], ids=["gaussian", "categorical"])
def test_under_bf16_autocast_the_heads_last_layers_run_in_fp32(discrete):
    """The trunk may run in bf16; the Gaussian's mean (or the logits) and the value come out of an
    fp32 last layer, so log-probs and values are not rounded to bf16 before the loss sees them."""
    torch.manual_seed(0)
    space = gym.spaces.Discrete(5) if discrete else gym.spaces.Box(-1, 1, (2,), np.float32)
    pol = ActorCritic(OBS, space, ModelConfig(init_log_std=-2.0))
    with torch.no_grad():  # logits of ~0.01 (the head's small init) round to bf16 within any tolerance
        pol.actor[-1].weight.mul_(100)
    obs = _obs(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        action, logp, value = pol.act(obs)
        lp, ent, v = pol.score_actions(obs, action)
        feats = pol.encoder(obs)
        actor_hidden, critic_hidden = pol.actor[:-1](feats), pol.critic[:-1](feats)
    assert {t.dtype for t in (logp, value, lp, ent, v)} == {torch.float32}
    out = pol.actor[-1](actor_hidden.float())  # fp32 weights on the bf16 hidden layer, outside autocast
    dist = torch.distributions.Categorical(logits=out) if discrete else torch.distributions.Normal(out, pol.log_std.exp())
    expected = dist.log_prob(action) if discrete else dist.log_prob(action).sum(-1)
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(v, pol.critic[-1](critic_hidden.float()).squeeze(-1), rtol=0, atol=1e-5)

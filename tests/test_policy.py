import gymnasium as gym
import numpy as np
import pytest
import torch

from visppo.config import ConfigError, ModelConfig
from visppo.policy import ActorCritic, recon_error, recon_target

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


def test_privileged_critic_reads_the_state_and_the_actor_the_frames():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,)), ModelConfig(privileged_critic=True))
    assert pol.critic_encoder.pixels is None and pol.encoder.state is None
    assert pol.trunk_parameters() == list(pol.encoder.pixels.trunk().parameters())
    obs, action = _obs(), torch.zeros(6, 2)
    other = {"pixels": torch.randint(0, 256, obs["pixels"].shape, dtype=torch.uint8), "state": obs["state"]}
    mean = lambda o: pol.actor(pol.encoder(o))  # noqa: E731  (the head's small gain hides it in a log-prob)
    logp, _, value = pol.score_actions(obs, action)
    _, _, value_p = pol.score_actions(other, action)
    assert torch.equal(value, value_p) and not torch.equal(mean(obs), mean(other))  # the value ignores the frames
    moved = {"pixels": obs["pixels"], "state": obs["state"] + 1.0}
    logp_s, _, value_s = pol.score_actions(moved, action)
    assert torch.equal(logp, logp_s) and not torch.equal(value, value_s)  # the policy ignores the state
    torch.testing.assert_close(pol.value(obs), value)
    value.sum().backward()  # the value loss never reaches the frames' encoder
    assert all(p.grad is None for p in pol.encoder.parameters())
    with pytest.raises(ConfigError, match="env.state=true"):
        ActorCritic(gym.spaces.Dict({"pixels": OBS["pixels"]}), gym.spaces.Box(-1, 1, (2,)),
                    ModelConfig(privileged_critic=True))


def test_detached_actor_leaves_the_encoder_to_the_critic():
    torch.manual_seed(0)
    plain = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,)), ModelConfig())
    detached = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,)), ModelConfig(detach_actor=True))
    detached.load_state_dict(plain.state_dict())
    obs, action = _obs(), torch.zeros(6, 2)
    logp, entropy, value = plain.score_actions(obs, action)
    logp_d, entropy_d, value_d = detached.score_actions(obs, action)
    assert torch.equal(logp, logp_d) and torch.equal(value, value_d)  # same forward pass
    conv = lambda pol: pol.encoder.pixels.convs[0].weight.grad  # noqa: E731
    logp.sum().backward()
    logp_d.sum().backward()
    assert conv(plain).abs().sum() > 0 and conv(detached) is None  # the policy's gradient stops at the head
    assert detached.actor[0].weight.grad.abs().sum() > 0
    value_d.sum().backward()
    assert conv(detached).abs().sum() > 0  # the critic's still trains the encoder
    # the DrAC pass detaches the same way
    aug = {k: v.flip(-1) for k, v in obs.items()}
    detached.zero_grad()
    lp, _, _, _, aug_dist, _ = detached.score_actions_augmented(obs, aug, action)
    (lp.sum() + aug_dist.mean.sum()).backward()
    assert conv(detached) is None


def test_unsupported_action_space():
    with pytest.raises(ValueError, match="not supported"):
        ActorCritic(OBS, gym.spaces.MultiBinary(3), ModelConfig())


def test_norm_value_maps_the_heads_normalised_output_back_to_return_units():
    """The value is ``head * std + mean``; the loss's scale is the std, floored at 1."""
    torch.manual_seed(0)
    plain = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig())
    torch.manual_seed(0)
    normed = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(norm_value=True))
    obs = _obs()
    torch.testing.assert_close(normed.value(obs), plain.value(obs))  # before any statistics: identity
    normed.value_mean.fill_(150.0)
    normed.value_var.fill_(400.0)
    torch.testing.assert_close(normed.value(obs), plain.value(obs) * 20.0 + 150.0)
    torch.testing.assert_close(normed.act(obs)[2], normed.value(obs))
    assert float(normed.value_scale()) == 20.0 and plain.value_scale() == 1.0
    normed.value_var.fill_(0.25)  # returns that barely vary are not blown up
    assert float(normed.value_scale()) == 1.0
    assert {"value_count", "value_mean", "value_var"} <= normed.state_dict().keys()
    assert "value_mean" not in plain.state_dict()  # older checkpoints load as before


def test_reconstruction_error_is_the_decoders_squared_error_on_the_pooled_frames():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(recon_size=8))
    obs, action = _obs(), torch.randn(6, 2)
    lp, ent, v, errors = pol.score_actions_aux(obs, action)
    assert errors.keys() == {"recon_loss"}
    err = errors["recon_loss"]
    ref = pol.score_actions(obs, action)
    for got, want in zip((lp, ent, v), ref):  # the RL outputs are score_actions' own
        torch.testing.assert_close(got, want)
    # by hand: 8x8 blocks of the 64x64 frames, averaged, in [0, 1]
    blocks = obs["pixels"].float().div(255).view(6, 3, 8, 8, 8, 8).mean((3, 5))
    pred = pol.decoder(pol.encoder(obs)).view(6, 3, 8, 8)
    torch.testing.assert_close(err, (pred - blocks).square().sum((1, 2, 3)))
    assert ActorCritic(OBS, gym.spaces.Discrete(3), ModelConfig()).decoder is None


def test_motion_target_adds_each_frames_change_scaled_and_the_decoder_predicts_it():
    torch.manual_seed(0)
    pixels = torch.randint(0, 256, (4, 9, 16, 16), dtype=torch.uint8)  # three stacked RGB frames
    pooled = pixels.float().div(255).view(4, 9, 4, 4, 4, 4).mean((3, 5))  # 4x4 blocks by hand
    torch.testing.assert_close(recon_target(pixels, 4), pooled)
    moved = recon_target(pixels, 4, motion=3.0)
    assert moved.shape == (4, 15, 4, 4)
    torch.testing.assert_close(moved[:, :9], pooled)
    torch.testing.assert_close(moved[:, 9:12], 3.0 * (pooled[:, 3:6] - pooled[:, 0:3]))  # middle minus oldest
    torch.testing.assert_close(moved[:, 12:], 3.0 * (pooled[:, 6:9] - pooled[:, 3:6]))  # newest minus middle
    still = pixels[:, :3].repeat(1, 3, 1, 1)  # nothing moved: the changes are 0 and add no error
    assert recon_target(still, 4, motion=3.0)[:, 9:].abs().max() == 0
    torch.testing.assert_close(recon_error(moved, moved + 0.5), torch.full((4,), 0.25 * 15 * 16))
    space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (9, 16, 16), np.uint8)})
    pol = ActorCritic(space, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(recon_size=4, recon_motion=3.0))
    err = pol.score_actions_aux({"pixels": pixels}, torch.randn(4, 2))[3]["recon_loss"]
    pred = pol.decoder(pol.encoder({"pixels": pixels})).view(4, 15, 4, 4)
    torch.testing.assert_close(err, (pred - moved).square().sum((1, 2, 3)))


def test_reconstruction_trains_the_encoder_even_with_a_detached_actor():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(recon_size=8, detach_actor=True))
    obs = _obs(16)
    err = pol.score_actions_aux(obs, torch.randn(16, 2))[3]["recon_loss"]
    err.mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pol.encoder.parameters())
    assert pol.actor[0].weight.grad is None  # only the decoder's loss was taken
    opt = torch.optim.Adam(pol.parameters(), 1e-3)
    first = float(err.mean())
    for _ in range(30):  # the loss's gradient is a descent direction: the frames become predictable
        opt.zero_grad()
        pol.score_actions_aux(obs, torch.randn(16, 2))[3]["recon_loss"].mean().backward()
        opt.step()
    assert float(pol.score_actions_aux(obs, torch.randn(16, 2))[3]["recon_loss"].mean()) < 0.5 * first


def test_inverse_dynamics_error_is_the_heads_squared_error_on_the_previous_action():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(invdyn=True))
    obs, action, prev = _obs(), torch.randn(6, 2), torch.rand(6, 2) * 2 - 1
    lp, ent, v, errors = pol.score_actions_aux(obs, action, prev)
    for got, want in zip((lp, ent, v), pol.score_actions(obs, action)):  # the RL outputs are score_actions' own
        torch.testing.assert_close(got, want)
    assert errors.keys() == {"invdyn_loss"} and pol.decoder is None
    torch.testing.assert_close(errors["invdyn_loss"], (pol.invdyn(pol.encoder(obs)) - prev).square().sum(1))
    assert pol.score_actions_aux(obs, action)[3] == {}  # no previous actions given: no term
    assert ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig()).invdyn is None


def test_reward_error_is_the_heads_squared_error_on_the_previous_reward():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(reward_head=True))
    obs, action, prev_r = _obs(), torch.randn(6, 2), torch.rand(6) * 2
    lp, ent, v, errors = pol.score_actions_aux(obs, action, None, prev_r)
    for got, want in zip((lp, ent, v), pol.score_actions(obs, action)):
        torch.testing.assert_close(got, want)
    assert errors.keys() == {"reward_loss"} and pol.invdyn is None
    torch.testing.assert_close(errors["reward_loss"], (pol.reward_head(pol.encoder(obs)).squeeze(-1) - prev_r).square())
    assert pol.score_actions_aux(obs, action)[3] == {}  # no previous rewards given: no term
    assert ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig()).reward_head is None


def test_reward_head_fits_a_reward_the_frames_determine():
    """The head learns a reward that is a function of the pixels (the mean brightness of one
    corner), so the loss does train it and the encoder under it."""
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(reward_head=True))
    obs = _obs(64)
    reward = (obs["pixels"][:, :, :4, :4].float().mean((1, 2, 3)) > 127).float()
    opt = torch.optim.Adam(pol.parameters(), lr=1e-3)
    first = float(pol.score_actions_aux(obs, torch.zeros(64, 2), None, reward)[3]["reward_loss"].mean())
    for _ in range(200):
        opt.zero_grad()
        pol.score_actions_aux(obs, torch.zeros(64, 2), None, reward)[3]["reward_loss"].mean().backward()
        opt.step()
    assert float(pol.score_actions_aux(obs, torch.zeros(64, 2), None, reward)[3]["reward_loss"].mean()) < 0.2 * first


def test_inverse_dynamics_trains_the_encoder_even_with_a_detached_actor():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(invdyn=True, detach_actor=True))
    obs, prev = _obs(16), torch.rand(16, 2) * 2 - 1
    pol.score_actions_aux(obs, torch.randn(16, 2), prev)[3]["invdyn_loss"].mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pol.encoder.parameters())
    assert pol.actor[0].weight.grad is None and pol.critic[0].weight.grad is None


def test_inverse_dynamics_refuses_discrete_actions():
    from visppo.config import ConfigError

    with pytest.raises(ConfigError, match="model.invdyn"):
        ActorCritic(OBS, gym.spaces.Discrete(3), ModelConfig(invdyn=True))


def test_beta_actions_stay_in_the_bounds_and_score_as_a_scaled_beta():
    torch.manual_seed(0)
    space = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 4.0], np.float32))
    pol = ActorCritic(OBS, space, ModelConfig(action_dist="beta"))
    assert not hasattr(pol, "log_std")
    obs = _obs(256)
    action, logp, value = pol.act(obs)
    low, high = torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 4.0])
    assert ((action >= low) & (action <= high)).all()
    assert action[:, 1].max() > 2.0, "the second dimension spans its own bounds, [0, 4]"
    lp, ent, v = pol.score_actions(obs, action)
    torch.testing.assert_close(lp, logp)
    torch.testing.assert_close(v, value)
    # by hand: concentrations 1 + softplus of the head's two halves; density over the unit
    # interval divided by the map's slope (2 and 4)
    out = pol.actor(pol.encoder(obs))
    c1, c0 = 1 + torch.nn.functional.softplus(out[:, :2]), 1 + torch.nn.functional.softplus(out[:, 2:])
    unit = (action - low) / (high - low)
    beta = torch.distributions.Beta(c1, c0)
    torch.testing.assert_close(lp, (beta.log_prob(unit) - torch.log(high - low)).sum(-1))
    torch.testing.assert_close(ent, (beta.entropy() + torch.log(high - low)).sum(-1))
    mean, _, _ = pol.act(obs, deterministic=True)
    torch.testing.assert_close(mean, low + (high - low) * c1 / (c1 + c0))


def test_beta_log_prob_is_finite_at_the_bounds_and_its_gradient_reaches_the_head():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(action_dist="beta"))
    obs = _obs(4)
    edge = torch.tensor([[-1.0, 1.0], [1.0, -1.0], [0.0, 0.0], [-1.0, -1.0]])
    lp, ent, _ = pol.score_actions(obs, edge)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    lp.sum().backward()
    assert pol.actor[-1].weight.grad.abs().sum() > 0


def test_beta_matches_the_uniform_density_when_both_concentrations_are_one():
    pol = ActorCritic(OBS, gym.spaces.Box(-2, 2, (3,), np.float32), ModelConfig(action_dist="beta"))
    with torch.no_grad():  # softplus(-40) ~ 0: Beta(1, 1) is uniform on [-2, 2], density 1/4 per dimension
        pol.actor[-1].weight.zero_()
        pol.actor[-1].bias.fill_(-40.0)
    lp, ent, _ = pol.score_actions(_obs(3), torch.zeros(3, 3))
    torch.testing.assert_close(lp, torch.full((3,), 3 * np.log(0.25), dtype=torch.float32))
    torch.testing.assert_close(ent, torch.full((3,), 3 * np.log(4.0), dtype=torch.float32))


@pytest.mark.parametrize("space", [gym.spaces.Discrete(3), gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)])
def test_beta_refuses_discrete_and_unbounded_actions(space):
    from visppo.config import ConfigError
    with pytest.raises(ConfigError, match="action_dist"):
        ActorCritic(OBS, space, ModelConfig(action_dist="beta"))


def test_given_noise_the_gaussian_acts_mean_plus_std_times_it_and_scores_it_as_the_gaussian():
    torch.manual_seed(0)
    pol = ActorCritic(OBS, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(init_log_std=-0.5))
    obs, noise = _obs(5), torch.randn(5, 2)
    action, logp, _ = pol.act(obs, noise=noise)
    mean = pol.actor(pol.encoder(obs))
    torch.testing.assert_close(action, mean + np.exp(-0.5) * noise)
    expected = torch.distributions.Normal(mean, np.exp(-0.5)).log_prob(action).sum(-1)
    torch.testing.assert_close(logp, expected)
    torch.testing.assert_close(pol.score_actions(obs, action)[0], logp)
    det, _, _ = pol.act(obs, deterministic=True, noise=noise)  # evaluation ignores the noise
    torch.testing.assert_close(det, mean)


@pytest.mark.parametrize("space, cfg", [(gym.spaces.Discrete(3), ModelConfig()),
                                        (gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(action_dist="beta"))])
def test_noise_is_refused_for_policies_without_a_gaussian(space, cfg):
    pol = ActorCritic(OBS, space, cfg)
    with pytest.raises(ValueError, match="Gaussian"):
        pol.act(_obs(2), noise=torch.zeros(2, 2))

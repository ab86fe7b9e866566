import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from visppo.config import ModelConfig
from visppo.health import activation_health, probe_index
from visppo.policy import ActorCritic

PIXELS = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 64, 64), np.uint8)})
ACTIONS = gym.spaces.Box(-1, 1, (2,), np.float32)


def _policy(**model) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(PIXELS, ACTIONS, ModelConfig(encoder="nature", **model))


def _batch(n=64):
    torch.manual_seed(1)
    return {"pixels": torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8)}, torch.randn(n, 2)


def test_a_fresh_policy_is_healthy():
    h = activation_health(_policy(), [_batch()])
    assert h["health/saturated_actor"] < 0.05 and h["health/saturated_critic"] < 0.05
    assert h["health/dead_features"] < 0.5
    assert math.isnan(h["health/saturated_encoder"]), "the Nature CNN's features are ReLU: no tanh to count"


def test_grown_features_saturate_both_heads():
    """Features grown large (what a value loss in return units can pull them to) push nearly
    every tanh unit of both heads past 0.99."""
    pol = _policy()
    with torch.no_grad():
        pol.encoder.pixels.proj[0].weight.mul_(1e4)
        pol.encoder.pixels.proj[0].bias.fill_(100.0)  # every unit fires: none dead, all large
    h = activation_health(pol, [_batch()])
    assert h["health/saturated_actor"] > 0.9 and h["health/saturated_critic"] > 0.9


def test_dead_features_are_counted_exactly():
    pol = _policy()
    with torch.no_grad():
        pol.encoder.pixels.proj[0].bias[:64] = -10.0  # 64 of 256 ReLUs never fire on any frame
        pol.encoder.pixels.proj[0].bias[64:] = 10.0  # the rest always fire (and vary with the frame)
    assert activation_health(pol, [_batch()])["health/dead_features"] == 64 / 256


def test_the_encoder_part_counts_shared_tanh_layers_and_hooks_are_removed():
    pol = _policy(shared_layers=2)
    h = activation_health(pol, [_batch()])
    assert 0.0 <= h["health/saturated_encoder"] < 0.05
    assert h["health/dead_features"] == 0.0, "tanh features vary with every frame"
    assert all(not m._forward_hooks for m in pol.modules()), "the probe leaves no hook behind"


def test_probe_index_spreads_over_the_rollout():
    idx = probe_index(1024, 256)
    assert len(idx) == 256 and idx[0] == 0 and idx[-1] == 1023 and (idx.diff() > 0).all()
    assert probe_index(10, 256).tolist() == list(range(10))


def test_a_gaussian_mean_beyond_the_bounds_is_counted():
    """A Gaussian's samples are clipped to the bounds: a mean past one is a torque pinned at its limit."""
    pol = _policy()
    with torch.no_grad():
        pol.actor[-1].weight.zero_()
        pol.actor[-1].bias.copy_(torch.tensor([-2.2, 0.5]))  # first action pinned, second inside
    h = activation_health(pol, [_batch()], action_space=ACTIONS)
    assert h["health/mean_out_of_bounds"] == 0.5
    wide = gym.spaces.Box(np.array([-3.0, -np.inf], np.float32), np.array([3.0, np.inf], np.float32))
    assert activation_health(pol, [_batch()], action_space=wide)["health/mean_out_of_bounds"] == 0.0, \
        "unbounded dimensions are left out, the bounded one is inside"
    assert math.isnan(activation_health(pol, [_batch()])["health/mean_out_of_bounds"]), "no bounds given"


def test_scoring_in_chunks_changes_no_scalar():
    """memory.infer_chunk_size bounds the pass, not the statistics: one sample at a time reads the
    same dead features (over every sample) and means out of bounds as the whole batch at once."""
    pol = _policy(shared_layers=1)
    with torch.no_grad():  # the first mean straddles its bound: each chunk's share differs
        pol.actor[-1].weight.mul_(30)
        pol.actor[-1].bias.copy_(torch.tensor([-1.0, 0.0]))
    obs, actions = _batch()
    whole = activation_health(pol, [(obs, actions)], action_space=ACTIONS)
    for chunk in (1, 5, 64):
        parts = [({k: v[i:i + chunk] for k, v in obs.items()}, actions[i:i + chunk]) for i in range(0, 64, chunk)]
        assert activation_health(pol, parts, action_space=ACTIONS) == pytest.approx(whole, nan_ok=True)
    assert 0 < whole["health/mean_out_of_bounds"] < 0.5
    assert whole["health/dead_features"] < 1  # one sample alone would read every feature as dead


@pytest.mark.cuda
def test_the_mean_out_of_bounds_is_measured_on_the_gpu():
    """The bounds meet the mean on its own device (a CPU tensor beside a CUDA one would raise)."""
    pol = _policy().cuda()
    obs, actions = _batch()
    h = activation_health(pol, [({k: v.cuda() for k, v in obs.items()}, actions.cuda())], action_space=ACTIONS)
    assert 0.0 <= h["health/mean_out_of_bounds"] <= 1.0


def test_the_critic_encoders_tanh_units_count_in_the_encoder_part():
    """Kills: _part() leaving critic_encoder.* out of "encoder" (its units are then dropped: a
    saturated critic encoder with share_encoder=false reads as healthy)."""
    from visppo.health import activation_health

    pol = _policy(share_encoder=False, shared_layers=1)
    with torch.no_grad():
        pol.critic_encoder.shared[0].weight.zero_()
        pol.critic_encoder.shared[0].bias.fill_(10.0)  # every unit of the critic's copy saturated
        pol.encoder.shared[0].weight.zero_()
        pol.encoder.shared[0].bias.fill_(0.5)  # none of the actor's (tanh(0.5) = 0.46)
    h = activation_health(pol, [_batch()])
    assert h["health/saturated_encoder"] == 0.5  # equal unit counts, one copy saturated


@pytest.mark.parametrize("level, saturated", [(0.95, 0.0), (0.995, 1.0)])
def test_saturation_is_counted_above_0_99_exactly(level, saturated):
    """Kills: a looser threshold (|tanh| > 0.9 counts units that still pass 10% of their gradient)."""
    from visppo.health import activation_health

    pol = _policy()
    with torch.no_grad():
        pol.actor[0].weight.zero_()
        pol.actor[0].bias.fill_(math.atanh(level))
    assert activation_health(pol, [_batch()])["health/saturated_actor"] == saturated


def test_a_feature_constant_at_a_nonzero_value_is_dead_too():
    """Kills: dead_features counting only units stuck at 0 (a ReLU unit whose input ignores the frame
    is as useless at 5 as at 0: "the same on every sample", as the module documents)."""
    from visppo.health import activation_health

    pol = _policy()
    with torch.no_grad():
        pol.encoder.pixels.proj[0].weight[:32].zero_()
        pol.encoder.pixels.proj[0].bias[:32] = 5.0  # 32 units fire, at 5, on every frame
        pol.encoder.pixels.proj[0].bias[32:] = 10.0  # the rest vary with the frame
    assert activation_health(pol, [_batch()])["health/dead_features"] == 32 / 256

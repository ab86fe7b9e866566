"""ValueNorm: the critic's target statistics, owned by the policy (model.norm_value)."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from visppo.checkpoint import without_removed_tensors
from visppo.config import ModelConfig
from visppo.policy import ActorCritic
from visppo.value_norm import ValueNorm, renamed_old_keys

OBS = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 32, 32), np.uint8)})
ACT = gym.spaces.Box(-1, 1, (2,), np.float32)


def test_update_keeps_the_running_mean_and_variance_of_every_rollouts_returns():
    torch.manual_seed(0)
    norm = ValueNorm()
    first, second = 150 + 20 * torch.randn(6, 4), 300 + 5 * torch.randn(6, 4)
    norm.update(first)
    assert norm.count.item() == 24
    assert norm.mean.item() == pytest.approx(first.double().mean().item())
    assert norm.var.item() == pytest.approx(first.double().var(unbiased=False).item())
    norm.update(second)
    both = torch.cat([first, second]).double()
    assert norm.count.item() == 48
    assert norm.mean.item() == pytest.approx(both.mean().item())
    assert norm.var.item() == pytest.approx(both.var(unbiased=False).item())
    assert float(norm.scale()) == pytest.approx(both.std(unbiased=False).item(), rel=1e-6)


def test_scale_is_floored_at_one_and_normalize_inverts_denormalize():
    norm = ValueNorm()
    norm.mean.fill_(150.0)
    norm.var.fill_(400.0)
    x = torch.tensor([-1.0, 0.0, 2.5])
    torch.testing.assert_close(norm.denormalize(x), torch.tensor([130.0, 150.0, 200.0]))
    torch.testing.assert_close(norm.normalize(norm.denormalize(x)), x)
    norm.var.fill_(0.25)  # returns that barely vary are not blown up
    assert float(norm.scale()) == 1.0


def test_the_policy_saves_its_statistics_under_value_norm():
    normed = ActorCritic(OBS, ACT, ModelConfig(norm_value=True))
    assert {"value_norm.count", "value_norm.mean", "value_norm.var"} <= normed.state_dict().keys()
    assert not any(k.startswith("value_norm") for k in ActorCritic(OBS, ACT, ModelConfig()).state_dict())


def test_a_checkpoint_saved_before_value_norm_loads_with_its_statistics():
    """checkpoint.without_removed_tensors, which every load goes through, renames them. Older checkpoints hold value_count/value_mean/value_var at the policy's top level."""
    source = ActorCritic(OBS, ACT, ModelConfig(norm_value=True))
    source.value_norm.update(torch.tensor([100.0, 140.0, 180.0]))
    old = {("value_" + k.split(".")[1] if k.startswith("value_norm.") else k): v
           for k, v in source.state_dict().items()}
    assert "value_mean" in old and "value_norm.mean" not in old
    target = ActorCritic(OBS, ACT, ModelConfig(norm_value=True))
    target.load_state_dict(without_removed_tensors(old))  # strict: every key under its new name
    assert target.value_norm.mean.item() == pytest.approx(140.0)
    assert target.value_norm.count.item() == 3


def test_renamed_old_keys_leaves_a_current_state_dict_alone():
    state = {"value_norm.mean": torch.zeros(()), "critic.0.weight": torch.zeros(1)}
    assert renamed_old_keys(state) is state
    assert renamed_old_keys({"p.value_mean": 1, "q": 2}, "p.") == {"p.value_norm.mean": 1, "q": 2}

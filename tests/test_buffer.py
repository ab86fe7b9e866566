import gymnasium as gym
import numpy as np
import pytest
import torch

from visppo.buffer import (
    ReturnScale,
    RolloutBuffer,
    compute_gae,
    explained_variance,
    merge_moments,
    micro_batches,
    minibatches,
)


def _gae(rewards, values, last, term, trunc, final, gamma=0.9, lam=0.8):
    t = lambda x: torch.tensor(x, dtype=torch.float32).view(-1, 1)  # noqa: E731
    return compute_gae(t(rewards), t(values), torch.tensor([last], dtype=torch.float32),
                       t(term).bool(), t(trunc).bool(), t(final), gamma, lam)


def test_gae_no_episode_end_matches_hand_computation():
    # gamma 0.9, lambda 0.8, V = [1, 2, 3], last value 4, rewards [1, 1, 1]
    adv, ret = _gae([1, 1, 1], [1, 2, 3], 4.0, [0, 0, 0], [0, 0, 0], [0, 0, 0])
    d2 = 1 + 0.9 * 4 - 3          # 1.6
    d1 = 1 + 0.9 * 3 - 2          # 1.7
    d0 = 1 + 0.9 * 2 - 1          # 1.8
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert adv.view(-1).tolist() == pytest.approx([a0, a1, a2], rel=1e-6)
    assert ret.view(-1).tolist() == pytest.approx([a0 + 1, a1 + 2, a2 + 3], rel=1e-6)


def test_gae_termination_bootstraps_zero_and_cuts_trace():
    adv, _ = _gae([1, 1, 1], [1, 2, 3], 4.0, [0, 1, 0], [0, 0, 0], [0, 99, 0])
    a2 = 1 + 0.9 * 4 - 3          # 1.6, a new episode
    a1 = 1 + 0.0 - 2              # -1, terminated: no bootstrap (final value ignored), no trace
    a0 = (1 + 0.9 * 2 - 1) + 0.72 * a1
    assert adv.view(-1).tolist() == pytest.approx([a0, a1, a2], rel=1e-6)


def test_gae_truncation_bootstraps_final_observation_value():
    adv, _ = _gae([1, 1, 1], [1, 2, 3], 4.0, [0, 0, 0], [0, 1, 0], [0, 5, 0])
    a2 = 1 + 0.9 * 4 - 3
    a1 = 1 + 0.9 * 5 - 2          # 3.5: bootstrap with V(final obs) = 5, not V(next obs) = 3
    a0 = (1 + 0.9 * 2 - 1) + 0.72 * a1
    assert adv.view(-1).tolist() == pytest.approx([a0, a1, a2], rel=1e-6)


def test_gae_a_step_both_terminated_and_truncated_is_a_termination():
    """A time limit that falls on the terminal step (gymnasium reports both): no bootstrap, one cut."""
    adv, _ = _gae([1, 1, 1], [1, 2, 3], 4.0, [0, 1, 0], [0, 1, 0], [0, 99, 0])
    a2 = 1 + 0.9 * 4 - 3
    a1 = 1 + 0.0 - 2              # as the termination-only case: the trace is cut once, not flipped
    a0 = (1 + 0.9 * 2 - 1) + 0.72 * a1
    assert adv.view(-1).tolist() == pytest.approx([a0, a1, a2], rel=1e-6)


def test_gae_last_step_truncated_uses_final_value_not_last_value():
    adv, _ = _gae([0, 0], [0, 0], 100.0, [0, 0], [0, 1], [0, 2])
    assert adv.view(-1).tolist() == pytest.approx([0.72 * 1.8, 1.8], rel=1e-6)


def test_gae_envs_are_independent():
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.zeros(2, 2)
    z = torch.zeros(2, 2, dtype=torch.bool)
    adv, _ = compute_gae(r, v, torch.zeros(2), z, z, torch.zeros(2, 2), 1.0, 1.0)
    assert adv.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def _spaces(frame_stack=3, size=84, state=True):
    spaces = {"pixels": gym.spaces.Box(0, 255, (3 * frame_stack, size, size), np.uint8)}
    if state:
        spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (7,), np.float32)
    return gym.spaces.Dict(spaces), gym.spaces.Box(-1, 1, (2,), np.float32)


def test_buffer_stores_uint8_frames_and_its_bytes_are_what_the_shapes_say():
    obs_space, act_space = _spaces()
    buf = RolloutBuffer(16, 4, obs_space, act_space)
    assert buf.obs["pixels"].dtype == torch.uint8
    assert buf.obs["pixels"].shape == (16, 4, 9, 84, 84)
    assert buf.obs["state"].dtype == torch.float32
    n = 16 * 4
    expected = n * 9 * 84 * 84 + n * 7 * 4 + n * 2 * 4 + n * 4 * 6 + n * 2  # 6 float scalars, 2 bools
    assert buf.nbytes() == expected


def test_buffer_gather_keeps_uint8_and_picks_the_right_samples():
    obs_space, act_space = _spaces(frame_stack=1, size=8, state=False)
    buf = RolloutBuffer(3, 2, obs_space, act_space)
    buf.obs["pixels"].copy_(torch.arange(6, dtype=torch.uint8).view(3, 2, 1, 1, 1).expand(3, 2, 3, 8, 8))
    buf.rewards.copy_(torch.arange(6.0).view(3, 2))
    out = buf.gather(torch.tensor([5, 0]), torch.device("cpu"))
    assert out["obs.pixels"].dtype == torch.uint8
    assert out["obs.pixels"][:, 0, 0, 0].tolist() == [5, 0]


def test_discrete_actions_are_long():
    obs_space, _ = _spaces(state=False)
    buf = RolloutBuffer(2, 2, obs_space, gym.spaces.Discrete(5))
    assert buf.actions.dtype == torch.long and buf.actions.shape == (2, 2)


def test_minibatches_are_a_permutation_and_micro_batches_tile_them():
    g = torch.Generator().manual_seed(0)
    mbs = minibatches(10, 4, g)
    assert [len(m) for m in mbs] == [4, 4, 2]
    assert sorted(torch.cat(mbs).tolist()) == list(range(10))
    micro = list(micro_batches(mbs[0], 3))
    assert [len(m) for m in micro] == [3, 1]
    assert torch.equal(torch.cat(micro), mbs[0])


def test_channels_last_buffer_holds_the_same_frames_and_gathers_them_in_that_layout():
    obs_space, act_space = _spaces(frame_stack=2, size=8)
    plain = RolloutBuffer(4, 3, obs_space, act_space)
    cl = RolloutBuffer(4, 3, obs_space, act_space, channels_last=True)
    assert cl.obs["pixels"].shape == plain.obs["pixels"].shape == (4, 3, 6, 8, 8)
    assert cl.obs["pixels"].stride()[2] == 1  # channels innermost in memory
    assert cl.nbytes() == plain.nbytes()
    g = torch.Generator().manual_seed(0)
    for t in range(4):  # written a step at a time, as collection does
        frames = torch.randint(0, 256, (3, 6, 8, 8), generator=g, dtype=torch.uint8)
        plain.obs["pixels"][t].copy_(frames)
        cl.obs["pixels"][t, 1:].copy_(frames[1:])
        cl.obs["pixels"][t, :1].copy_(frames[:1])
    index = torch.tensor([11, 0, 5, 6])
    a, b = plain.gather(index, torch.device("cpu")), cl.gather(index, torch.device("cpu"))
    assert torch.equal(a["obs.pixels"], b["obs.pixels"]) and torch.equal(a["obs.state"], b["obs.state"])
    assert b["obs.pixels"].is_contiguous(memory_format=torch.channels_last)  # no transpose per minibatch
    assert cl.flat(cl.obs["pixels"]).data_ptr() == cl.obs["pixels"].data_ptr()  # flat is a view


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
def test_pinned_buffer_gathers_through_staging_to_cuda(channels_last):
    obs_space, act_space = _spaces(frame_stack=1, size=8, state=False)
    buf = RolloutBuffer(4, 2, obs_space, act_space, pin_memory=True, channels_last=channels_last)
    assert buf.obs["pixels"].is_pinned()
    buf.obs["pixels"].copy_(torch.arange(8, dtype=torch.uint8).view(4, 2, 1, 1, 1).expand(buf.obs["pixels"].shape))
    buf.rewards.copy_(torch.arange(8.0).view(4, 2))
    buf.returns.copy_(torch.arange(8.0).view(4, 2))
    for _ in range(3):  # both staging sets, then reuse
        out = buf.gather(torch.tensor([7, 1, 3]), torch.device("cuda"))
        assert out["returns"].device.type == "cuda"
        assert out["returns"].cpu().tolist() == [7.0, 1.0, 3.0]
    # back to back with no host sync between: a staging set reused before its copy landed would
    # hand the first gather the third one's samples
    indices = [[7, 1, 3], [0, 2, 4], [6, 5, 1]]
    outs = [buf.gather(torch.tensor(i), torch.device("cuda")) for i in indices]
    for i, out in zip(indices, outs, strict=True):
        assert out["returns"].cpu().tolist() == [float(j) for j in i]
        assert out["obs.pixels"][:, 0, 0, 0].cpu().tolist() == i
        assert out["obs.pixels"].dtype == torch.uint8
        assert out["obs.pixels"].is_contiguous(memory_format=torch.channels_last) == channels_last


def test_return_scale_discounts_per_env_resets_at_episode_ends_and_carries_on():
    scale = ReturnScale(num_envs=2, gamma=0.5)
    rewards = torch.tensor([[1.0, 0.5], [2.0, 0.5], [3.0, 0.5]])
    ended = torch.tensor([[False, False], [True, False], [False, False]])
    g = scale.discounted_returns(rewards, ended)
    # env 0: 1, 0.5*1+2 = 2.5 (ends), 3; env 1: 0.5, 0.75, 0.875
    assert torch.allclose(g, torch.tensor([[1.0, 0.5], [2.5, 0.75], [3.0, 0.875]], dtype=torch.float64))
    g2 = scale.discounted_returns(torch.tensor([[1.0, 1.0]]), torch.tensor([[True, False]]))
    assert torch.allclose(g2, torch.tensor([[2.5, 1.4375]], dtype=torch.float64))  # 0.5*3+1, 0.5*0.875+1
    assert scale.running.tolist() == [0.0, 1.4375]  # env 0's episode ended


def test_return_scale_statistics_equal_numpy_over_everything_seen_in_any_batching():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, size=1000)
    one, many = ReturnScale(1, 0.9), ReturnScale(1, 0.9)
    one.add(torch.tensor(values))
    for part in np.split(values, [1, 7, 300, 301, 999]):
        many.add(torch.tensor(part))
    for s in (one, many):  # the prior (count 1e-4, var 1) weighs 1e-7 of the data
        assert s.mean == pytest.approx(values.mean(), rel=1e-5)
        assert s.var == pytest.approx(values.var(), rel=1e-5)
    assert many.mean == pytest.approx(one.mean, rel=1e-12) and many.var == pytest.approx(one.var, rel=1e-12)
    assert one.std == pytest.approx(values.std(), rel=1e-5)


def test_return_scale_state_round_trips():
    a = ReturnScale(3, 0.99)
    a.add(a.discounted_returns(torch.rand(5, 3), torch.rand(5, 3) > 0.7))
    b = ReturnScale(3, 0.99)
    b.load_state_dict(a.state_dict())
    assert (b.count, b.mean, b.var) == (a.count, a.mean, a.var) and torch.equal(b.running, a.running)


def test_explained_variance_against_hand_computed_numbers():
    returns = torch.tensor([[1.0, 3.0], [5.0, 7.0]])  # [T, N]; mean 4, unbiased variance 20/3
    # residuals -1, 0, 1, 0: unbiased variance 2/3, so 1 - (2/3) / (20/3) = 0.9
    assert explained_variance(torch.tensor([[2.0, 3.0], [4.0, 7.0]]), returns) == pytest.approx(0.9)
    assert explained_variance(returns.clone(), returns) == pytest.approx(1.0)
    assert explained_variance(torch.full((2, 2), 4.0), returns) == pytest.approx(0.0)  # the mean: no better
    assert explained_variance(-returns, returns) == pytest.approx(1.0 - 4.0)  # residual 2x the returns
    assert np.isnan(explained_variance(torch.zeros(2, 2), torch.ones(2, 2)))


def test_merge_moments_equals_the_moments_of_both_samples_together():
    a, b = torch.tensor([1.0, 2.0, 6.0]), torch.tensor([10.0, 12.0])
    both = torch.cat([a, b])
    count, mean, var = merge_moments(0, 0.0, 1.0, 3, a.mean().item(), a.var(unbiased=False).item())
    assert (count, mean, var) == (3, pytest.approx(3.0), pytest.approx(a.var(unbiased=False).item()))
    count, mean, var = merge_moments(count, mean, var, 2, b.mean().item(), b.var(unbiased=False).item())
    assert (count, mean, var) == (5, pytest.approx(both.mean().item()), pytest.approx(both.var(unbiased=False).item()))
    assert merge_moments(4, 1.0, 2.0, 0, 0.0, 0.0) == (4, 1.0, 2.0)


def test_gae_takes_a_host_last_value_beside_a_buffer_on_another_device():
    """infer() returns host tensors while ``memory.buffer_device=device`` keeps the buffer on the
    GPU: the bootstrap value must follow the buffer (the meta device stands in for CUDA here)."""
    meta = lambda x: torch.tensor(x, dtype=torch.float32).view(-1, 1).to("meta")  # noqa: E731
    adv, ret = compute_gae(meta([1, 1]), meta([1, 2]), torch.tensor([4.0]), meta([0, 0]).bool(),
                           meta([0, 1]).bool(), meta([0, 5]), 0.9, 0.8)
    assert adv.device.type == ret.device.type == "meta" and adv.shape == (2, 1)

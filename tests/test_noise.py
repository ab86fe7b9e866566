import numpy as np
import pytest
import torch

from visppo.noise import ColoredNoise


def _series(beta: float, steps: int = 4000, envs: int = 8, seed: int = 0) -> np.ndarray:
    """``[steps, envs, 1]`` noise as collection draws it, one long sequence per env."""
    noise = ColoredNoise(beta, envs, 1, steps, seed)
    return np.stack([noise.sample().numpy() for _ in range(steps)])


def _lag1(x: np.ndarray) -> float:
    """The mean lag-1 autocorrelation over envs."""
    return float(np.mean([np.corrcoef(x[:-1, i, 0], x[1:, i, 0])[0, 1] for i in range(x.shape[1])]))


def test_each_step_is_unit_gaussian_and_white_noise_is_uncorrelated():
    x = _series(0.0)
    assert abs(x.mean()) < 0.05 and abs(x.std() - 1.0) < 0.05
    assert abs(_lag1(x)) < 0.05


def test_a_higher_beta_correlates_neighbouring_steps_more():
    lag = {beta: _lag1(_series(beta)) for beta in (0.5, 1.0, 2.0)}
    assert 0.1 < lag[0.5] < lag[1.0] < lag[2.0]
    assert lag[2.0] > 0.9  # red noise: a random walk, nearly constant step to step
    assert abs(_series(0.5).std() - 1.0) < 0.1  # the marginal stays unit variance


def test_sample_has_one_row_per_env_and_the_envs_are_independent():
    noise = ColoredNoise(1.0, 3, 2, 100, seed=1)
    first = noise.sample()
    assert first.shape == (3, 2) and first.dtype == torch.float32
    assert len({tuple(row.tolist()) for row in first}) == 3


def test_restart_gives_only_the_named_envs_a_fresh_sequence():
    a, b = ColoredNoise(0.5, 3, 1, 50, seed=2), ColoredNoise(0.5, 3, 1, 50, seed=2)
    for _ in range(5):
        a.sample(), b.sample()
    a.restart(np.array([1]))
    assert a.t.tolist() == [5, 0, 5]
    after_a, after_b = a.sample(), b.sample()
    assert after_a[0] == after_b[0] and after_a[2] == after_b[2]
    assert after_a[1] != after_b[1]
    assert after_a[1] == torch.as_tensor(a.series[1, 0, 0], dtype=torch.float32)


def test_a_sequence_that_runs_out_is_replaced_not_repeated():
    noise = ColoredNoise(1.0, 1, 1, 4, seed=3)
    first = [noise.sample().item() for _ in range(4)]
    second = [noise.sample().item() for _ in range(4)]
    assert noise.t.tolist() == [4] and first != second


def test_the_same_seed_draws_the_same_noise_and_a_saved_state_goes_on_exactly():
    a, b = ColoredNoise(0.5, 2, 2, 20, seed=4), ColoredNoise(0.5, 2, 2, 20, seed=4)
    assert torch.equal(a.sample(), b.sample())
    state = a.state_dict()
    resumed = ColoredNoise(0.5, 2, 2, 20, seed=99)
    resumed.load_state_dict(state)
    for _ in range(25):  # past the end of the sequence: the redraw comes from the saved stream
        assert torch.equal(resumed.sample(), a.sample())
    a.restart(np.array([0])), resumed.restart(np.array([0]))
    assert torch.equal(resumed.sample(), a.sample())


def test_the_saved_state_loads_with_weights_only_and_must_fit(tmp_path):
    noise = ColoredNoise(0.5, 2, 1, 10, seed=5)
    torch.save({"noise": noise.state_dict()}, tmp_path / "n.pt")
    loaded = torch.load(tmp_path / "n.pt", weights_only=True)["noise"]
    other = ColoredNoise(0.5, 2, 1, 10, seed=6)
    other.load_state_dict(loaded)
    assert torch.equal(other.sample(), noise.sample())
    with pytest.raises(ValueError, match="does not fit"):
        ColoredNoise(0.5, 3, 1, 10, seed=6).load_state_dict(loaded)


def test_a_too_short_sequence_is_refused():
    with pytest.raises(ValueError, match="length"):
        ColoredNoise(0.5, 1, 1, 1, seed=0)

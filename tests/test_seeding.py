"""visppo.seeding: training and evaluation never share an episode seed; runs and envs do not on these samples."""

import numpy as np
import pytest
from conftest import tiny_overrides

from visppo import seeding
from visppo.config import load_config
from visppo.envs import make_env


def _training_seeds(run_seed: int, envs: int = 8, episodes: int = 50, rank: int = 0) -> set[int]:
    return {seeding.episode_seed(seeding.env_seed(run_seed, rank, i), k, seeding.TRAIN)
            for i in range(envs) for k in range(episodes)}


def test_runs_with_neighbouring_seeds_share_no_episode():
    # with gymnasium's s + i, seeds 1 and 2 of 8 envs would share the streams of 7 envs
    runs = [_training_seeds(s) for s in (1, 2, 3)]
    assert all(len(r) == 8 * 50 for r in runs)
    assert not runs[0] & runs[1] and not runs[1] & runs[2] and not runs[0] & runs[2]


def test_ranks_of_one_run_share_no_episode():
    assert not _training_seeds(1, rank=0) & _training_seeds(1, rank=1)


def test_evaluation_seeds_never_training_seeds():
    train = set().union(*(_training_seeds(s) for s in range(4)))
    evaluation = {seeding.episode_seed(base, i, seeding.EVAL) for base in range(4) for i in range(100)}
    assert not train & evaluation
    assert {seeding.stream_of(s) for s in train} == {seeding.TRAIN}
    assert {seeding.stream_of(s) for s in evaluation} == {seeding.EVAL}
    assert max(train) < 2**31 <= min(evaluation) < 2**32


def test_seeds_are_reproducible_and_depend_on_every_coordinate():
    assert seeding.env_seed(5, 0, 3) == seeding.env_seed(5, 0, 3)
    assert len({seeding.env_seed(5, 0, 3), seeding.env_seed(6, 0, 3), seeding.env_seed(5, 1, 3),
                seeding.env_seed(5, 0, 4)}) == 4
    assert seeding.episode_seed(7, 2, seeding.TRAIN) != seeding.episode_seed(7, 3, seeding.TRAIN)


def test_bad_coordinates_are_refused():
    with pytest.raises(ValueError):
        seeding.env_seed(-1, 0, 0)
    with pytest.raises(ValueError):
        seeding.episode_seed(1, 0, 2)


def test_an_env_seeds_its_episodes_in_its_stream():
    cfg = load_config(None, ["env.id=visppo/DotReach-v0"])
    train_env, eval_env = make_env(cfg), make_env(cfg, seeding.EVAL)
    seen = []
    for env in (train_env, eval_env):
        inner = env.env
        calls = []
        original = inner.reset
        inner.reset = lambda *, seed=None, options=None, _o=original, _c=calls: (_c.append(seed), _o(seed=seed))[1]
        env.reset(seed=3)
        env.reset()
        seen.append(calls)
    assert seen[0] == [seeding.episode_seed(3, k, seeding.TRAIN) for k in range(2)]
    assert seen[1] == [seeding.episode_seed(3, k, seeding.EVAL) for k in range(2)]
    first = [np.asarray(make_env(cfg, seeding.EVAL).reset(seed=3)[0]["pixels"]) for _ in range(2)]
    assert np.array_equal(first[0], first[1])


def test_training_resets_its_envs_with_the_derived_seeds(tmp_path):
    from conftest import tiny_overrides

    from visppo.loop import start_run

    cfg = load_config(None, tiny_overrides(tmp_path / "run", **{"train.seed": 4}))
    with start_run(cfg, None) as run:
        bases = list(run.envs.get_attr("base_seed"))
        streams = set(run.envs.get_attr("stream"))
    assert bases == [seeding.env_seed(4, 0, i) for i in range(cfg.ppo.num_envs)]
    assert streams == {seeding.TRAIN}


def test_a_ranks_envs_are_seeded_from_its_rank(tmp_path, monkeypatch):
    """Rank 1 of a run seeds env i with env_seed(run seed, 1, i): not rank 0's episodes again. The
    rank is set by patching Context.from_env (a world of one: no process group), and the run stops
    at its first reset, whose seeds are recorded."""
    from visppo import distributed, loop

    class Reset(Exception):
        pass

    seen = []

    def start(envs, seed):
        seen.extend(seed)
        raise Reset

    monkeypatch.setattr(distributed.Context, "from_env", classmethod(lambda cls, env=None: cls(rank=1)))
    monkeypatch.setattr(loop.RolloutState, "start", staticmethod(start))
    cfg = load_config(None, tiny_overrides(tmp_path / "run", **{"train.seed": 4}))
    with pytest.raises(Reset), loop.start_run(cfg, None):
        pass
    assert seen == [seeding.env_seed(4, 1, i) for i in range(cfg.ppo.num_envs)]
    assert not set(seen) & {seeding.env_seed(4, 0, i) for i in range(cfg.ppo.num_envs)}

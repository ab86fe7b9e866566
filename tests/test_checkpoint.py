import os
import random

import numpy as np
import pytest
import torch
from conftest import tiny_overrides

from visppo.checkpoint import (
    CheckpointError,
    atomic_save,
    load,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from visppo.config import load_config


def test_atomic_save_round_trips_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "ck" / "latest.pt"
    atomic_save({"model": {"w": torch.arange(3.0)}, "iteration": 4}, path)
    assert load(path)["iteration"] == 4
    assert [p.name for p in path.parent.iterdir()] == ["latest.pt"]


def test_a_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "latest.pt"
    atomic_save({"model": {}, "iteration": 1}, path)

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        atomic_save({"model": {}, "iteration": 2}, path)
    monkeypatch.undo()
    assert load(path)["iteration"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['VISPPO_MARKER']}",))


def test_a_checkpoint_with_a_pickled_payload_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("VISPPO_MARKER", str(marker))
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": Payload()}, path)
    with pytest.raises(CheckpointError, match="refused") as refused:
        load(path)
    assert not marker.exists()
    # the message names what was refused, without torch's advice or its terminal escape codes
    assert "unsupported global posix.system" in str(refused.value) or "unsupported global os.system" in str(refused.value)
    assert "\x1b" not in str(refused.value) and "two options" not in str(refused.value)


def test_corrupt_and_missing_checkpoints(tmp_path):
    good = tmp_path / "good.pt"
    atomic_save({"model": {"w": torch.zeros(1000)}}, good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="corrupt"):
        load(bad)
    with pytest.raises(CheckpointError, match="not found"):
        load(tmp_path / "missing.pt")
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(CheckpointError, match="not a visppo checkpoint"):
        load(other)


def test_an_unreadable_checkpoint_says_so_not_that_it_is_corrupt(tmp_path, monkeypatch):
    """Permissions are faked (root reads anything); the file itself is fine."""
    path = tmp_path / "latest.pt"
    atomic_save({"model": {"w": torch.zeros(3)}}, path)

    def refuse(f, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(f))

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError, match=r"latest\.pt cannot be read \(Permission denied\)") as info:
        load(path)
    assert "corrupt" not in str(info.value)


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = tmp_path / "rng.pt"
    atomic_save({"model": {}, "rng": rng_state()}, path)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(load(path)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_run_moved_to_a_machine_with_fewer_gpus_restores_the_gpus_it_has(monkeypatch):
    """A checkpoint holds one RNG state per GPU of the machine that saved it (two here): on a
    one-GPU machine the first is restored, not an IndexError. (CUDA faked.)"""
    state = {**rng_state(), "cuda": [torch.zeros(3, dtype=torch.uint8), torch.ones(3, dtype=torch.uint8)]}
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((device, state)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.extend(enumerate(states)))
    set_rng_state(state)
    assert [(device, s.tolist()) for device, s in restored] == [(0, [0, 0, 0])]


def _save(run_dir, iteration, keep):
    cfg = load_config(None, ["env.id=visppo/DotReach-v0", f"run.keep_checkpoints={keep}"])
    policy = torch.nn.Linear(2, 1)
    save_checkpoint(run_dir, cfg, policy, torch.optim.SGD(policy.parameters(), lr=0.1), None, iteration,
                    64 * iteration, {}, [{}], [])


def _numbered(run_dir):
    return sorted(int(p.stem[5:]) for p in (run_dir / "checkpoints").glob("iter_*.pt"))


def test_checkpoints_keep_the_last_few_numbered_ones_and_latest_is_the_newest(tmp_path):
    for iteration in range(1, 6):
        _save(tmp_path, iteration, keep=3)
    assert _numbered(tmp_path) == [3, 4, 5]
    assert load(tmp_path / "checkpoints" / "latest.pt")["iteration"] == 5


def test_pruning_goes_by_number_past_a_million_iterations(tmp_path):
    """iter_999999.pt sorts after iter_1000000.pt by name: by number it is the older, and goes."""
    for iteration in (999_998, 999_999, 1_000_000, 1_000_001):
        _save(tmp_path, iteration, keep=2)
    assert _numbered(tmp_path) == [1_000_000, 1_000_001]


def test_a_branch_resumed_from_an_older_checkpoint_keeps_its_own_newest_ones(tmp_path):
    """Resumed from iter 4 of a run that reached 8, the new branch's last three stay; 8 is left alone."""
    for iteration in (2, 4, 6, 8):
        _save(tmp_path, iteration, keep=3)
    assert _numbered(tmp_path) == [4, 6, 8]
    for iteration in (5, 6, 7):  # the resumed branch, checkpointing every iteration
        _save(tmp_path, iteration, keep=3)
    assert _numbered(tmp_path) == [5, 6, 7, 8]
    assert load(tmp_path / "checkpoints" / "latest.pt")["iteration"] == 7


def test_latest_is_written_before_the_numbered_checkpoint(tmp_path, monkeypatch):
    """A kill between the two saves must leave latest.pt the newest checkpoint, not one interval behind."""
    import visppo.checkpoint as checkpoint

    written, real = [], checkpoint.atomic_save
    monkeypatch.setattr(checkpoint, "atomic_save", lambda state, path: (written.append(path.name), real(state, path)))
    _save(tmp_path, 1, keep=3)
    assert written == ["latest.pt", "iter_000001.pt"]


def test_a_bad_checkpoint_points_at_the_newest_written_one_not_the_highest_number(tmp_path):
    """After a resume from iter 4, the abandoned branch's iter 8 is older than the new branch's 7."""
    from visppo.checkpoint import _other_checkpoints

    for iteration in (2, 4, 6, 8, 5, 6, 7):
        _save(tmp_path, iteration, keep=3)
    folder = tmp_path / "checkpoints"
    for age, name in enumerate(["iter_000008.pt", "iter_000005.pt", "iter_000006.pt", "iter_000007.pt"]):
        os.utime(folder / name, ns=(10**18 + age * 10**9,) * 2)  # the order they were written in
    assert f"--resume {folder / 'iter_000007.pt'} " in _other_checkpoints(folder / "latest.pt")


class _Envs:
    """The two calls a checkpoint makes of a vector env: its envs' episode counters."""

    def __init__(self, episodes):
        self.episode = list(episodes)

    def get_attr(self, name):
        return list(getattr(self, name))

    def set_attr(self, name, values):
        setattr(self, name, list(values))


def _trained_state(seed: int):
    """A model, an Adam optimizer with moments, a used generator and a GradScaler off its default."""
    torch.manual_seed(seed)
    policy = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    policy(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    generator = torch.Generator().manual_seed(seed)
    torch.randperm(10, generator=generator)
    return policy, optimizer, generator


# --------------------------------------------------------------------------- checkpoint.py


def test_a_checkpoint_restores_every_state_it_saves_in_one_round_trip(tmp_path):
    """Kills (each alone): restore() skipping the optimizer, the minibatch generator, the env
    episode counters, the reward scale or the GradScaler; save_checkpoint() writing an empty
    scaler; restore() returning the saved iteration instead of the next one. The exact-resume
    tests in test_resume.py take a minute each and never exercise the fp16 scaler (CPU runs)."""
    from visppo.buffer import ReturnScale
    from visppo.checkpoint import rank_state, restore

    cfg = load_config(None, tiny_overrides(tmp_path))
    policy, optimizer, generator = _trained_state(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=3)
    reward_scale = ReturnScale(2, 0.99)
    reward_scale.add(reward_scale.discounted_returns(torch.tensor([[1.0, 2.0], [3.0, -1.0]]),
                                                    torch.tensor([[False, True], [False, False]])))
    saved_scale = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in reward_scale.state_dict().items()}
    envs = _Envs([5, 9])
    path = save_checkpoint(tmp_path / "run", cfg, policy, optimizer, scaler, 7, 448, {},
                           [rank_state(generator, envs, reward_scale)], [])
    expected_draw = torch.randperm(10, generator=torch.Generator().set_state(generator.get_state()))

    new_policy, new_optimizer, new_generator = _trained_state(2)
    new_scaler = torch.amp.GradScaler("cpu")  # 65536 by default
    new_reward_scale = ReturnScale(2, 0.99)
    new_envs = _Envs([0, 0])
    first, step = restore(load(path), new_policy, new_optimizer, new_scaler, new_generator, new_envs,
                          new_reward_scale)

    assert (first, step) == (8, 448)
    assert new_envs.episode == [5, 9]
    assert new_scaler.get_scale() == 2.0**7 and new_scaler.get_growth_interval() == 3
    assert new_reward_scale.count > 1  # restored: the saved statistics had seen returns (a fresh one has 1e-4)
    assert torch.equal(torch.randperm(10, generator=new_generator), expected_draw)
    for key, value in saved_scale.items():
        got = new_reward_scale.state_dict()[key]
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), key
    old_state, new_state = optimizer.state_dict()["state"], new_optimizer.state_dict()["state"]
    for index in old_state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new_state[index][key], old_state[index][key]), (index, key)


def test_each_rank_of_a_multi_process_run_resumes_its_own_streams():
    """Kills: resume_for_rank() handing every rank rank 0's RNGs, minibatch order and env episodes
    (only the torchrun subprocess test in test_distributed.py would notice, and it is slow)."""
    from visppo import distributed
    from visppo.checkpoint import resume_for_rank

    ranks = [{"rng": f"rng{r}", "minibatch_generator": f"gen{r}", "env_episodes": [r, r]} for r in range(2)]
    ckpt = {"model": {}, "iteration": 3, **ranks[0], "world_size": 2, "ranks": ranks}
    mine = resume_for_rank(ckpt, distributed.Context(rank=1, world=2, local_rank=1, local_world=2))
    assert (mine["rng"], mine["minibatch_generator"], mine["env_episodes"]) == ("rng1", "gen1", [1, 1])
    assert mine["iteration"] == 3
    assert resume_for_rank(ckpt, distributed.Context(rank=0, world=2, local_rank=0, local_world=2))["rng"] == "rng0"

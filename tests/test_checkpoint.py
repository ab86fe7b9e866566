import os
import random

import numpy as np
import pytest
import torch

from visppo.checkpoint import CheckpointError, atomic_save, load, rng_state, set_rng_state


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
    with pytest.raises(CheckpointError, match="refused"):
        load(path)
    assert not marker.exists()


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

"""Runs survive: exact resume in-process, and SIGKILL of a real `visppo train` process."""

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import tiny_overrides

import visppo.checkpoint as ckpt_module
from visppo.checkpoint import load, load_for_resume
from visppo.config import load_config
from visppo.loop import train

# episodes of 16 steps, rollouts of 32: every iteration starts on fresh episodes
EXACT = {"env.max_episode_steps": 16, "ppo.total_steps": 256, "run.checkpoint_every": 1,
         "train.deterministic": "true", "ppo.minibatch_size": 24}


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("extra", [{}, {"ppo.norm_reward": "true"}], ids=["plain", "norm_reward"])
def test_a_resumed_run_ends_with_the_same_parameters_as_an_uninterrupted_one(tmp_path, monkeypatch, extra):
    """With ppo.norm_reward the return statistics must be restored too: the scale after the cut
    depends on every reward seen before it."""
    full = train(load_config(None, tiny_overrides(tmp_path / "full", **EXACT, **extra)))

    real_save = ckpt_module.save_checkpoint

    def crash_after_second(*args):
        path = real_save(*args)
        if args[5] == 2:  # the iteration
            raise Interrupted
        return path

    monkeypatch.setattr(ckpt_module, "save_checkpoint", crash_after_second)
    with pytest.raises(Interrupted):
        train(load_config(None, tiny_overrides(tmp_path / "cut", **EXACT, **extra)))
    monkeypatch.undo()
    cfg, ckpt = load_for_resume(tmp_path / "cut" / "run")
    assert ckpt["iteration"] == 2 and ckpt["global_step"] == 128
    resumed = train(cfg, resume=ckpt)

    a = load(full / "checkpoints" / "latest.pt")
    b = load(resumed / "checkpoints" / "latest.pt")
    assert a["global_step"] == b["global_step"] == 256
    if "ppo.norm_reward" in extra:
        assert a["reward_scale"]["count"] == b["reward_scale"]["count"] == pytest.approx(256, abs=1e-3)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    steps = [int(r["global_step"]) for r in csv.DictReader((resumed / "metrics.csv").open())]
    assert steps == [64, 128, 192, 256]
    # the logged return is a mean over the last 100 episodes: after the cut, over the same ones
    logged = [[float(r["episode_return"]) for r in csv.DictReader((d / "metrics.csv").open())] for d in (full, resumed)]
    assert logged[0] == logged[1]
    assert len(b["recent_episodes"]) == 4 * 64 // 16  # every episode of the run (fewer than 100)


def test_a_resume_between_two_rows_keeps_counting_the_episodes_column(tmp_path, monkeypatch):
    """run.log_every=2 with a checkpoint every iteration: the cut after iteration 3 falls between
    rows, and the row at 4 still counts the episodes of iterations 3 and 4."""
    extra = {**EXACT, "run.log_every": 2}
    full = train(load_config(None, tiny_overrides(tmp_path / "full", **extra)))
    real_save = ckpt_module.save_checkpoint

    def crash_after_third(*args, **kwargs):
        path = real_save(*args, **kwargs)
        if args[5] == 3:  # the iteration
            raise Interrupted
        return path

    monkeypatch.setattr(ckpt_module, "save_checkpoint", crash_after_third)
    with pytest.raises(Interrupted):
        train(load_config(None, tiny_overrides(tmp_path / "cut", **extra)))
    monkeypatch.undo()
    cfg, ckpt = load_for_resume(tmp_path / "cut" / "run")
    assert ckpt["episodes_since_row"] == 4  # 2 envs x 32 steps in episodes of 16
    resumed = train(cfg, resume=ckpt)
    counts = [[int(float(r["episodes"])) for r in csv.DictReader((d / "metrics.csv").open())] for d in (full, resumed)]
    assert counts[0] == counts[1] == [8, 8]


SLOW_SAVE = textwrap.dedent("""
    import sys, time, pathlib, torch
    import visppo.checkpoint as ck
    real = torch.save
    marker = pathlib.Path(sys.argv[1])
    def slow_save(obj, f, *a, **k):
        real(obj, f, *a, **k)
        if obj.get("iteration") == 3:   # the third checkpoint: hang mid-write, before fsync+rename
            f.flush()
            marker.write_text(str(getattr(f, "name", "")))
            time.sleep(60)
    ck.torch.save = slow_save
    from visppo.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _spawn(args, script=None, marker=None):
    if script is None:
        cmd = [sys.executable, "-m", "visppo", *args]
    else:
        cmd = [sys.executable, "-c", script, str(marker), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out")


def _resume_and_check(run_dir, total):
    res = subprocess.run([sys.executable, "-m", "visppo", "train", "--resume", str(run_dir)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for path in (run_dir / "checkpoints").glob("*.pt"):
        load(path)  # every checkpoint left is complete
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    steps = [int(r["global_step"]) for r in csv.DictReader((run_dir / "metrics.csv").open())]
    assert steps == list(range(64, total + 1, 64)), steps
    assert load(run_dir / "checkpoints" / "latest.pt")["global_step"] == total


@pytest.mark.timeout(600)
def test_sigkill_mid_training_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", *tiny_overrides(tmp_path, **{"ppo.total_steps": 640, "run.checkpoint_every": 2})]
    proc = _spawn(args)
    latest = run_dir / "checkpoints" / "iter_000004.pt"
    _wait_for(latest.exists, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    step = load(run_dir / "checkpoints" / "latest.pt")["global_step"]
    assert step >= 4 * 64  # latest.pt is written before iter_000004.pt, so it holds iteration 4 or later
    _resume_and_check(run_dir, 640)


@pytest.mark.timeout(600)
def test_sigkill_while_a_checkpoint_is_being_written_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    marker = tmp_path / "writing"
    args = ["train", *tiny_overrides(tmp_path, **{"ppo.total_steps": 320, "run.checkpoint_every": 1})]
    proc = _spawn(args, SLOW_SAVE, marker)
    _wait_for(marker.exists, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert load(run_dir / "checkpoints" / "latest.pt")["iteration"] == 2  # the old one, complete
    assert list((run_dir / "checkpoints").glob(".*.tmp")), "the kill hit the write"
    _resume_and_check(run_dir, 320)


def test_a_resumed_run_starts_its_episodes_discounted_returns_from_zero(tmp_path):
    """A resume starts new episodes in every env, so ``ppo.norm_reward``'s running discounted
    returns start from 0 (as after any episode's end); its mean and variance are restored."""
    from visppo.loop import start_run

    cut = {"ppo.norm_reward": "true", "run.checkpoint_every": 1, "env.max_episode_steps": 50,
           "ppo.total_steps": 64}  # one rollout of 32 steps: the cut falls inside every env's episode
    train(load_config(None, tiny_overrides(tmp_path, **cut)))
    cfg, ckpt = load_for_resume(tmp_path / "run", ["ppo.total_steps=128"])
    assert ckpt["reward_scale"]["running"].abs().sum() > 0  # the cut episodes' partial returns
    with start_run(cfg, ckpt) as run:
        assert torch.all(run.reward_scale.running == 0)
        assert run.reward_scale.count == ckpt["reward_scale"]["count"]
        assert run.reward_scale.var == ckpt["reward_scale"]["var"]

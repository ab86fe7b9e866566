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
from visppo.errors import UserError
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
    assert ckpt["updates_since_row"][1] == 0 and ckpt["updates_since_row"][0] > 0
    resumed = train(cfg, resume=ckpt)
    counts = [[(int(float(r["episodes"])), int(float(r["optimizer_steps"])))
               for r in csv.DictReader((d / "metrics.csv").open())] for d in (full, resumed)]
    assert counts[0] == counts[1] and [episodes for episodes, _ in counts[0]] == [8, 8]
    assert counts[0][1][1] == 2 * ckpt["updates_since_row"][0]  # iterations 3 and 4, not 4 alone


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


def test_a_branch_from_an_earlier_checkpoint_is_the_runs_head_before_its_first_save(tmp_path, monkeypatch):
    """Resume from iter_2 of a 4-iteration run, crash before the branch saves: `--resume RUN` goes on
    from iteration 2 (the branch), not from the abandoned iteration 4 whose metrics rows are gone."""
    run_dir = train(load_config(None, tiny_overrides(tmp_path, **EXACT, **{"run.keep_checkpoints": 10})))
    assert load(run_dir / "checkpoints" / "latest.pt")["iteration"] == 4
    cfg, ckpt = load_for_resume(run_dir / "checkpoints" / "iter_000002.pt")

    def killed(*args, **kwargs):
        raise Interrupted

    monkeypatch.setattr(ckpt_module, "save_checkpoint", killed)
    with pytest.raises(Interrupted):
        train(cfg, resume=ckpt)
    monkeypatch.undo()
    assert load(run_dir / "checkpoints" / "latest.pt")["iteration"] == 2
    cfg, ckpt = load_for_resume(run_dir)
    assert ckpt["iteration"] == 2
    train(cfg, resume=ckpt)
    steps = [int(r["global_step"]) for r in csv.DictReader((run_dir / "metrics.csv").open())]
    assert steps == [64, 128, 192, 256]


def test_a_resume_stopped_once_the_logs_dropped_the_later_rows_is_on_the_branch(tmp_path, monkeypatch):
    """A Ctrl-C (or a full disk, a kill) just after the logger dropped the rows after iteration 2:
    latest.pt is already iteration 2's, so the run and its log agree, and `--resume RUN` fills in
    every row."""
    import visppo.loop as loop_module

    run_dir = train(load_config(None, tiny_overrides(tmp_path, **EXACT, **{"run.keep_checkpoints": 10})))
    cfg, ckpt = load_for_resume(run_dir / "checkpoints" / "iter_000002.pt")
    real = loop_module.Logger

    def opened_then_stopped(*args, **kwargs):
        real(*args, **kwargs).close()  # the rows after the checkpoint are gone now
        raise Interrupted

    monkeypatch.setattr(loop_module, "Logger", opened_then_stopped)
    with pytest.raises(Interrupted):
        train(cfg, resume=ckpt)
    monkeypatch.undo()
    assert [int(r["global_step"]) for r in csv.DictReader((run_dir / "metrics.csv").open())] == [64, 128]
    assert load(run_dir / "checkpoints" / "latest.pt")["iteration"] == 2
    cfg, ckpt = load_for_resume(run_dir)
    train(cfg, resume=ckpt)
    steps = [int(r["global_step"]) for r in csv.DictReader((run_dir / "metrics.csv").open())]
    assert steps == [64, 128, 192, 256]


def test_a_checkpoint_written_after_it_was_read_stops_the_resume(tmp_path):
    """The resume read the checkpoint before it took the run's lock: if the run that held the lock
    saved in between, going on from the older state would redo that work over it."""
    run_dir = train(load_config(None, tiny_overrides(tmp_path, **EXACT)))
    cfg, ckpt = load_for_resume(run_dir, ["ppo.total_steps=320"])
    latest = run_dir / "checkpoints" / "latest.pt"
    os.utime(latest, ns=(latest.stat().st_atime_ns, latest.stat().st_mtime_ns + 1))  # a save since
    before = (run_dir / "metrics.csv").read_bytes()
    with pytest.raises(UserError, match="written while this resume started"):
        train(cfg, resume=ckpt)
    assert (run_dir / "metrics.csv").read_bytes() == before


def test_a_run_moved_to_another_machine_may_change_its_devices_but_not_its_precision_silently(tmp_path, capsys):
    """train.device and rollout.device are the machine's (a GPU run resumed on a CPU): resumable. The
    precision the run trained in is kept unless train.amp is given: `auto` resolved again elsewhere
    would switch it (here the checkpoint says bf16, as a GPU run's would, and auto picks fp32)."""
    from visppo.cli import main

    run_dir = train(load_config(None, tiny_overrides(tmp_path, **{"train.amp": "auto"})))
    latest = run_dir / "checkpoints" / "latest.pt"
    ckpt = torch.load(latest, weights_only=True)
    assert ckpt["amp"] == "off"
    ckpt["amp"] = "bf16"
    torch.save(ckpt, latest)
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}
    assert main(["train", "--resume", str(run_dir), "ppo.total_steps=192"]) == 2
    err = capsys.readouterr().err
    assert "the run trained with amp bf16, and its train.amp=auto picks off here" in err
    assert "train.amp=bf16" in err and "train.amp=off" in err
    assert {p: p.read_bytes() for p in before} == before  # refused: nothing changed
    assert main(["train", "--resume", str(run_dir), "ppo.total_steps=192", "train.amp=off",
                 "train.device=auto", "rollout.device=cpu"]) == 0
    resumed = load(latest)
    assert resumed["global_step"] == 192 and resumed["amp"] == "off"
    assert resumed["config"]["train"]["device"] == "auto" and resumed["config"]["train"]["amp"] == "off"

"""Run directories have one writer; SIGINT / SIGTERM save a final checkpoint; faults keep data."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import one_error_line, run_main, tiny_overrides

import visppo.checkpoint as ckpt_module
from visppo.checkpoint import load, run_dir_lock
from visppo.config import load_config
from visppo.loop import default_run_dir


@pytest.fixture
def finished_run(tmp_path, capsys):
    """A tiny run of 128 steps, finished: config.yaml, metrics.csv, checkpoints."""
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path, **{"run.checkpoint_every": 1}))
    assert code == 0, err
    return tmp_path / "run"


# --------------------------------------------------------------------------- the lock


def test_a_second_train_on_a_locked_run_dir_is_refused_naming_the_holder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 2
    one_error_line(err, "in use", f"pid {os.getpid()}")
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"], "the refused run wrote nothing"


def test_a_second_train_on_a_live_run_before_its_first_checkpoint_is_told_it_is_in_use(tmp_path, capsys):
    """Its config.yaml is written: the run is not a stopped one to delete but a live one."""
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        (run_dir / "config.yaml").write_text("env:\n  id: visppo/DotReach-v0\n")
        code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 2
    line = one_error_line(err, "in use", f"pid {os.getpid()}")
    assert "delete" not in line
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))  # the lock gone: a stopped run
    assert code == 2 and "delete it" in err


def test_resume_of_a_locked_run_is_refused_and_touches_nothing(finished_run, capsys):
    temp = finished_run / "checkpoints" / ".latest.pt.other.tmp"
    with _held_elsewhere(finished_run) as pid:
        temp.write_bytes(b"half")  # the holder's save in flight
        before = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*") if p.is_file()}
        code, err = run_main(capsys, "train", "--resume", str(finished_run), "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "in use", f"pid {pid}")
    assert temp.exists(), "the other process's temporary file must survive"
    after = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*") if p.is_file()}
    assert before == after


class _held_elsewhere:
    """The run-dir lock held by another process (a child), for the length of a with block."""

    def __init__(self, run_dir):
        code = ("import sys, time, pathlib; from visppo.checkpoint import run_dir_lock\n"
                "with run_dir_lock(pathlib.Path(sys.argv[1])):\n"
                "    print('locked', flush=True); time.sleep(120)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE,
                                     text=True)

    def __enter__(self):
        assert self.proc.stdout.readline().strip() == "locked"
        return self.proc.pid

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def test_the_lock_of_a_sigkilled_process_never_blocks(tmp_path):
    holder = _held_elsewhere(tmp_path / "run")
    with holder:
        pass  # SIGKILLed on the way out, lock file left behind with its pid
    assert (tmp_path / "run" / ".lock").read_text().strip() == str(holder.proc.pid)
    with run_dir_lock(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())


def test_the_lock_sweeps_an_evaluation_videos_temporary_that_a_kill_left(tmp_path):
    videos = tmp_path / "run" / "videos"
    videos.mkdir(parents=True)
    (videos / ".iter_000002.x1y2z3ab.mp4").write_bytes(b"half a video")
    (videos / "iter_000001.mp4").write_bytes(b"a whole one")
    with run_dir_lock(tmp_path / "run"):
        assert sorted(p.name for p in videos.iterdir()) == ["iter_000001.mp4"]


def test_the_lock_is_released_when_a_run_fails(tmp_path, monkeypatch):
    from visppo.loop import train

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", "latest.pt")

    monkeypatch.setattr(ckpt_module, "atomic_save", full_disk)
    from visppo.errors import RunError
    with pytest.raises(RunError, match="no space left.*start the run again") as failed:  # no checkpoint yet
        train(load_config(None, tiny_overrides(tmp_path)))
    assert "--resume" not in str(failed.value)
    with run_dir_lock(tmp_path / "run"):  # free again
        pass


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with run_dir_lock(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
    assert "cannot be locked here (No locks available)" in capsys.readouterr().err


def test_a_run_dir_that_cannot_be_created_is_an_error_not_a_traceback(tmp_path):
    from visppo.errors import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot be written"):
        with run_dir_lock(tmp_path / "file" / "run"):
            pass


def test_default_run_dirs_started_in_the_same_second_differ():
    cfg = load_config(None, tiny_overrides())
    names = {default_run_dir(cfg) for _ in range(50)}
    assert len(names) == 50


# --------------------------------------------------------------------------- signals


SLOW_ITERATIONS = """
import sys, time
import visppo.loop as t
real = t.collect_rollout
def slow(run):
    time.sleep(1.0)
    return real(run)
t.collect_rollout = slow
from visppo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start_long_run(tmp_path, slow=False, **extra):
    args = ["train", *tiny_overrides(tmp_path, **{"ppo.total_steps": 64 * 10_000, "run.checkpoint_every": 10_000,
                                                  "train.threads": 1, **extra})]
    cmd = [sys.executable, "-c", SLOW_ITERATIONS, *args] if slow else [sys.executable, "-m", "visppo", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a shell gives a command


def _wait_for_rows(proc, metrics, rows=2, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) > rows:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[1][-2000:])
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum,code,vector", [(signal.SIGTERM, 143, "sync"), (signal.SIGINT, 130, "async")])
def test_a_signal_writes_a_final_checkpoint_and_says_how_to_resume(tmp_path, signum, code, vector):
    """SIGTERM to the learner (a cluster's pre-emption); SIGINT to the whole process group, env
    workers included (a Ctrl-C in a terminal): the workers must stay alive for the checkpoint."""
    run_dir = tmp_path / "run"
    proc = _start_long_run(tmp_path, **{"env.vector": vector})
    _wait_for_rows(proc, run_dir / "metrics.csv")
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert f"visppo train --resume {run_dir}" in last and "latest.pt" in last, err
    assert "Traceback" not in err and "error" not in err, err
    ckpt = load(run_dir / "checkpoints" / "latest.pt")
    steps = [int(r["global_step"]) for r in csv.DictReader((run_dir / "metrics.csv").open())]
    assert ckpt["global_step"] == steps[-1], "the checkpoint is the last logged iteration's"
    with run_dir_lock(run_dir):  # released
        pass
    if signum == signal.SIGTERM:  # the final checkpoint resumes
        res = subprocess.run([sys.executable, "-m", "visppo", "train", "--resume", str(run_dir),
                              f"ppo.total_steps={ckpt['global_step'] + 64}"], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert load(run_dir / "checkpoints" / "latest.pt")["global_step"] == ckpt["global_step"] + 64


@pytest.mark.timeout(600)
def test_a_second_signal_aborts_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_long_run(tmp_path, slow=True)  # iterations of over a second
    _wait_for_rows(proc, run_dir / "metrics.csv")
    os.kill(proc.pid, signal.SIGINT)
    first = proc.stderr.readline()
    while "SIGINT" not in first:  # the first one is received: a checkpoint is due
        first = proc.stderr.readline()
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "aborted" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (run_dir / "checkpoints").exists(), "no checkpoint was due: none written"

"""Issue 59's silent wrong behaviour and lost work: each item a test (the env's own: test_user_env.py)."""

from __future__ import annotations

import errno
import io
import os
import shutil
import signal

import pytest
import torch
from conftest import one_error_line, run_main, tiny_overrides

import visppo.atomic as atomic_module
import visppo.loop as train_module
from visppo.metrics import Logger


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two finished tiny runs (seeds 1 and 2), 128 steps, a checkpoint per iteration."""
    from visppo.cli import main

    base = tmp_path_factory.mktemp("runs")
    for seed in (1, 2):
        args = tiny_overrides(base / f"s{seed}", **{"run.checkpoint_every": 1, "train.seed": seed})
        assert main(["train", *args]) == 0
    return base / "s1" / "run", base / "s2" / "run"


@pytest.fixture
def run_copy(two_runs, tmp_path):
    shutil.copytree(two_runs[0], tmp_path / "run")
    return tmp_path / "run"


# --------------------------------------------------------------------------- items 1, 2: keys that stop learning


@pytest.mark.parametrize(("override", "needle"), [
    ("ppo.max_grad_norm=0", "weights never change"),  # item 1
    ("train.max_bad_steps=0", "healthy run"),  # item 2
    ("ppo.clip_coef=0", "policy stops changing"),
    ("ppo.adam_eps=0", "NaN"),
    ("ppo.max_grad_norm=-1", "must be positive"),
])
def test_items1_2_keys_that_would_silently_stop_learning_are_refused(capsys, override, needle):
    code, err = run_main(capsys, "config", override)
    assert code == 2
    one_error_line(err, override.split("=")[0], needle)


def test_item2_max_bad_steps_0_is_refused_on_resume_too(run_copy, capsys):
    before = (run_copy / "checkpoints" / "latest.pt").read_bytes()
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256", "train.max_bad_steps=0")
    assert code == 2
    one_error_line(err, "train.max_bad_steps must be positive")
    assert (run_copy / "checkpoints" / "latest.pt").read_bytes() == before


# --------------------------------------------------------------------------- item 3: a cut metrics.csv


ROW = {"iteration": 2, "episode_return": 1.5, "loss/policy": 0.25}


def _logger(run_dir, initial_step):
    return Logger(run_dir, 1000, initial_step=initial_step, tensorboard=False, progress=False)


@pytest.mark.parametrize("cut", ["header", "row"])
def test_item3_a_line_cut_by_a_kill_is_dropped_and_the_next_row_is_whole(tmp_path, cut):
    header = "global_step," + ",".join(ROW) + "\r\n"
    text = header[:20] if cut == "header" else header + "64,1,0.5,0.1\r\n" + "128,2,0."
    (tmp_path / "metrics.csv").write_text(text, newline="")
    logger = _logger(tmp_path, 128)
    logger.log(192, ROW)
    logger.close()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == header.strip(), "the whole header, never half of one"
    assert lines[1:] == (["192,2,1.5,0.25"] if cut == "header" else ["64,1,0.5,0.1", "192,2,1.5,0.25"])


def test_item3_a_resumed_run_over_a_cut_header_plots(run_copy, capsys, tmp_path):
    metrics = run_copy / "metrics.csv"
    metrics.write_bytes(metrics.read_bytes()[:40])  # the header cut in half (no newline)
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=192")
    assert code == 0, err
    rows = metrics.read_text().splitlines()
    assert rows[0].startswith("global_step,iteration,") and len(rows) == 2
    assert len(rows[1].split(",")) == len(rows[0].split(","))
    code, err = run_main(capsys, "plot", run_copy, "--out", tmp_path / "curves.png")
    assert code == 0, err


def test_metrics_csv_that_is_a_directory_is_one_line(run_copy, capsys):
    (run_copy / "metrics.csv").unlink()
    (run_copy / "metrics.csv").mkdir()
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=192")
    assert code == 2
    one_error_line(err, "metrics.csv is a directory", "move it away")


# --------------------------------------------------------------------------- item 4: a full disk


class _FullAfter(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_item4_a_full_disk_during_torch_save_is_one_line_and_the_last_checkpoint_stays(tmp_path, capsys,
                                                                                       monkeypatch):
    real_fdopen, saves = os.fdopen, []

    def fdopen(fd, mode="r", *args, **kw):
        f = real_fdopen(fd, mode, *args, **kw)
        if "b" in mode and ".pt." in os.readlink(f"/proc/self/fd/{fd}"):
            saves.append(1)
            if len(saves) > 2:  # iteration 1's latest.pt and iter_000001.pt fit; iteration 2's latest.pt does not
                return _FullAfter(f, 1000)
        return f

    monkeypatch.setattr(atomic_module.os, "fdopen", fdopen)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path, **{"run.checkpoint_every": 1}))
    assert code == 1, err
    one_error_line(err, "no space left on the device writing", "latest.pt",
                   f"visppo train --resume {tmp_path / 'run'}")
    assert "Traceback" not in err and "enforce fail" not in err
    assert torch.load(tmp_path / "run" / "checkpoints" / "latest.pt", weights_only=True)["iteration"] == 1
    assert not list((tmp_path / "run").rglob("*.tmp"))


def test_item4_a_full_disk_at_the_first_config_yaml_advises_no_resume_and_leaves_nothing(tmp_path, capsys,
                                                                                         monkeypatch):
    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(train_module, "atomic_write_text", full)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 1
    line = one_error_line(err, "no space left", "config.yaml", "start the run again")
    assert "--resume" not in line
    assert not (tmp_path / "run").exists(), "no .lock left behind"


# --------------------------------------------------------------------------- item 5: a signal before the first iteration


def test_item5_a_signal_after_the_run_dir_is_made_leaves_nothing_and_the_dir_starts_again(tmp_path, capsys,
                                                                                          monkeypatch):
    real_open = train_module.open_logs

    def open_then_sigterm(run, resuming):
        real_open(run, resuming)
        assert (run.dir / "config.yaml").is_file() and (run.dir / ".lock").is_file()
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_module, "open_logs", open_then_sigterm)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 143, err
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(train_module, "open_logs", real_open)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 0, err


def test_item5_a_run_dir_without_a_checkpoint_is_not_offered_for_resume(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("env: {}\n")
    (tmp_path / "run" / "metrics.csv").write_text("global_step\n")
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 2
    line = one_error_line(err, "already holds a run", "before its first checkpoint")
    assert "--resume" not in line


# --------------------------------------------------------------------------- item 7: another run's checkpoint


def test_item7_a_link_to_another_runs_checkpoint_is_refused(run_copy, two_runs, capsys):
    latest = run_copy / "checkpoints" / "latest.pt"
    latest.unlink()
    latest.symlink_to(two_runs[1] / "checkpoints" / "latest.pt")
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "is a link to", "outside this run's checkpoints")


def test_item7_a_copy_of_another_runs_checkpoint_is_refused(run_copy, two_runs, capsys):
    shutil.copy(two_runs[1] / "checkpoints" / "iter_000001.pt", run_copy / "checkpoints" / "latest.pt")
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "not this run's checkpoint", "train.seed=2")


def test_item7_config_yaml_says_the_resumed_total_steps(run_copy, capsys):
    from visppo.config import load_config

    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=192")
    assert code == 0, err
    assert load_config(run_copy / "config.yaml").ppo.total_steps == 192


def _edit_config(run_dir, section, key, value):
    import yaml

    path = run_dir / "config.yaml"
    data = yaml.safe_load(path.read_text())
    data[section][key] = value
    path.write_text(yaml.safe_dump(data))
    return path.read_bytes()


def test_item7_an_edited_config_yaml_is_named_with_the_value_to_set_back(run_copy, capsys):
    before = _edit_config(run_copy, "ppo", "learning_rate", 0.125)
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "ppo.learning_rate=", "set ppo.learning_rate back to", "if it was edited")
    assert (run_copy / "config.yaml").read_bytes() == before  # nothing written over the edit


def test_item7_a_resumable_key_edited_in_config_yaml_asks_for_an_override(run_copy, capsys):
    before = _edit_config(run_copy, "ppo", "total_steps", 256)
    code, err = run_main(capsys, "train", "--resume", run_copy)
    assert code == 2
    one_error_line(err, "says ppo.total_steps=256 but the checkpoint has 128", "ppo.total_steps=256")
    assert (run_copy / "config.yaml").read_bytes() == before
    numbered = run_copy / "checkpoints" / "iter_000002.pt"
    code, err = run_main(capsys, "train", "--resume", numbered)  # the command it gives resumes that same file
    assert code == 2 and f"visppo train --resume {numbered} ppo.total_steps=256" in one_error_line(err)
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")  # as it says
    assert code == 0, err


# --------------------------------------------------------------------------- commands


@pytest.mark.parametrize(("args", "needle"), [
    (["probe", "--budget", "abc", "train.device=cpu"], "--budget 'abc' is not a size"),
    (["probe", "--budget=-1GiB", "train.device=cpu"], "--budget '-1GiB' is not a size"),
    (["probe", "--budget", "1e30TiB", "train.device=cpu"], "--budget '1e30TiB' is not a size"),
    (["probe", "--budget", "99999999TiB", "train.device=cpu"], "--budget 99999999TiB is out of range"),
    (["eval", "nowhere", "--seed", "-1"], "--seed must be in 0 .. 2**31 - 1"),
    (["eval", "nowhere", "--seed", "1e20"], "invalid int value"),
    (["bench", "devices", "--repeats", "0", "train.device=cpu"], "--repeats must be at least 1"),
])
def test_command_arguments_are_one_error_line(capsys, args, needle):
    code, err = run_main(capsys, *args)
    assert code == 2
    one_error_line(err, needle)


def test_a_refused_eval_creates_no_output_folder(tmp_path, capsys):
    code, err = run_main(capsys, "eval", tmp_path / "nowhere", "--json", tmp_path / "a" / "b" / "r.json",
                         "--video", tmp_path / "v" / "e.mp4")
    assert code == 2
    one_error_line(err, "not found")
    assert sorted(tmp_path.iterdir()) == []


def test_a_full_disk_once_eval_is_done_is_one_line(two_runs, tmp_path, capsys, monkeypatch):
    import visppo.evaluate as evaluate_module

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(evaluate_module, "atomic_write_text", full)
    code, err = run_main(capsys, "eval", two_runs[0], "--episodes", 1, "--json", tmp_path / "r.json")
    assert code == 1
    one_error_line(err, f"cannot write {tmp_path / 'r.json'}", "No space left")


def test_a_run_dir_name_too_long_for_the_file_system_is_one_line(tmp_path, capsys):
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path, **{"run.dir": tmp_path / ("x" * 300)}))
    assert code == 2
    one_error_line(err, "is 300 bytes long", "at most 255")
    assert sorted(tmp_path.iterdir()) == []


def test_the_probe_s_profiler_prints_nothing(capfd):
    from visppo.memory import cpu_allocator_peak

    peak, out = cpu_allocator_peak(lambda: torch.ones(4096) * 2)
    assert peak >= 4096 * 4 and out.shape == (4096,)
    assert "USDT" not in capfd.readouterr().err

"""Phase timers, the one-iteration profiler trace, metrics.csv and TensorBoard on resume, and the
Weights & Biases tracker."""

from __future__ import annotations

import csv
import gzip
import json
import os
import struct
import sys
import time

import pytest
import torch
from conftest import one_error_line, run_main, tiny_overrides

from visppo.metrics import Logger, PhaseTimer, _drop_rows_after, iteration_profiler


def test_phase_timer_adds_up_each_phase_per_lap():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("collect"):
            time.sleep(0.01)
    with timer("update"):
        time.sleep(0.02)
    seconds, wall = timer.lap()
    assert set(seconds) == {"collect", "update"}
    assert 0.02 <= seconds["collect"] < 0.2 and 0.02 <= seconds["update"] < 0.2
    assert seconds["collect"] + seconds["update"] <= wall
    time.sleep(0.01)  # between phases: in the next lap's wall time, in none of its phases
    empty, wall = timer.lap()
    assert empty == {} and wall >= 0.01


def test_a_lap_holds_its_phases_and_refuses_to_end_inside_one():
    """A phase that a lap cut in two would count in both laps, so the phases of a metrics row
    could sum past the span its steps/s was measured over (a CI failure under load did this)."""
    timer = PhaseTimer()
    with timer("log"):
        time.sleep(0.01)
        with pytest.raises(RuntimeError, match="inside a phase"):
            timer.lap()
    timer.lap()
    with timer("log"):  # the previous row's logging, timed in this lap
        time.sleep(0.02)
    with timer("collect"):
        time.sleep(0.01)
    seconds, wall = timer.lap()
    assert seconds["log"] >= 0.02 and sum(seconds.values()) <= wall < sum(seconds.values()) + 0.05


def test_profiler_records_the_third_iteration_with_its_phases(tmp_path):
    timer = PhaseTimer()
    profiler = iteration_profiler(tmp_path)
    profiler.start()
    for iteration in range(1, 5):
        with timer("collect"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        with timer(f"update_{iteration}"):  # tells the iterations apart in the trace
            torch.ones(64, 64).sum()
        profiler.step()
    profiler.stop()
    traces = list((tmp_path / "profile").glob("*.pt.trace.json*"))
    assert len(traces) == 1, traces  # one recorded iteration, one file
    raw = traces[0].read_bytes()
    trace = json.loads(gzip.decompress(raw) if traces[0].suffix == ".gz" else raw)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "collect" in names and "update_3" in names
    assert not names & {"update_1", "update_2", "update_4"}  # skipped, warm-up, after


def wandb_records(run_file):
    """The records of a W&B run file (``run-ID.wandb``, the log ``wandb sync`` uploads): a header,
    then 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = run_file.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_every_csv_metric_the_config_and_the_videos(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason='the wandb extra (pip install -e ".[wandb]")')
    from visppo.config import load_config, to_dict
    from visppo.loop import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.wandb": True, "run.wandb_project": "tests",
                                                         "run.eval_every": 2, "run.eval_episodes": 1,
                                                         "ppo.num_epochs": 1}))
    run_dir = train(cfg)
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, kinds = [], {}, []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    assert kinds[-1] == "exit", kinds[-5:]  # complete once train() returns: the run's exit is written
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    logged = {int(h["global_step"]): h for h in history if "iteration" in h}  # the metrics rows
    assert [int(r["global_step"]) for r in rows] == sorted(logged) == [64, 128]
    for row in rows:
        for key, value in row.items():
            got = logged[int(row["global_step"])][key]
            assert got == pytest.approx(float(value), rel=1e-6, nan_ok=True) or value == "", key
    assert config["ppo"]["total_steps"] == 128 and config["run"]["wandb"] is True
    config.pop("_wandb", None)  # W&B's own entry
    assert config == json.loads(json.dumps(to_dict(cfg)))  # the resolved config, every key
    videos = [h for h in history if h.get("eval/video/_type") == "video-file"]  # nested keys joined by /
    assert len(videos) == 1 and int(videos[0]["global_step"]) == 128
    assert list(run_file.parent.glob("files/media/videos/eval/*.mp4")) and (run_dir / "wandb_id").is_file()


def test_without_wandb_one_error_line_names_the_extra_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path, **{"run.wandb": True}))
    assert code == 2
    one_error_line(err, "run.wandb=true", 'pip install -e ".[wandb]"')
    assert not (tmp_path / "run").exists()


def _csv(path, lines: list[str], end: str = "\r\n") -> None:
    path.write_bytes((end.join(lines) + end).encode())


def test_resume_keeps_rows_up_to_its_step_and_drops_a_line_cut_short(tmp_path):
    path = tmp_path / "metrics.csv"
    _csv(path, ["global_step,loss", "128,1.5", "256,2.5", "384,3.5"])
    with path.open("ab") as f:
        f.write(b"512,4.")  # a kill cut this row short
    assert _drop_rows_after(path, 256) == ["global_step", "loss"]
    assert path.read_bytes() == b"global_step,loss\r\n128,1.5\r\n256,2.5\r\n"
    _drop_rows_after(path, 256)  # nothing left to drop: the file is kept as it is
    assert path.read_bytes() == b"global_step,loss\r\n128,1.5\r\n256,2.5\r\n"


def test_a_header_cut_short_leaves_no_file_for_the_next_row_to_glue_onto(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"global_step,lo")
    assert _drop_rows_after(path, 256) is None
    assert not path.exists()


def test_a_crash_while_rewriting_keeps_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    _csv(path, ["global_step,loss", "128,1.5", "256,2.5"])
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)  # the rewrite dies before its rename
    with pytest.raises(OSError):
        _drop_rows_after(path, 128)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]  # no temporary file left either


def test_tensorboard_of_a_resumed_run_drops_the_events_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Logger(tmp_path, total_steps=512, progress=False)
    for step in (128, 256, 384):
        first.log(step, {"loss": float(step)})
    first.close()
    resumed = Logger(tmp_path, total_steps=512, initial_step=256, progress=False)
    resumed.log(384, {"loss": -1.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(128, 128.0), (256, 256.0), (384, -1.0)]
    assert [int(r["global_step"]) for r in csv.DictReader((tmp_path / "metrics.csv").open())] == [128, 256, 384]


class _Tracker:
    """A stand-in for WandbTracker: what it was sent."""

    def __init__(self):
        self.videos = []

    def log(self, step, scalars):
        pass

    def video(self, path, step):
        self.videos.append((path.name, path.read_bytes(), step))

    def close(self):
        pass


def test_a_resumed_run_drops_the_videos_it_redoes_and_sends_their_new_ones(tmp_path):
    """Videos of iterations after the checkpoint belong to the discarded timeline, as its CSV rows:
    they go, and the redone iterations' videos are sent (not taken for the ones sent before)."""
    videos = tmp_path / "videos"
    videos.mkdir()
    for n in (2, 4):
        (videos / f"iter_{n:06d}.mp4").write_bytes(b"old")
    (videos / "mine.mp4").write_bytes(b"the user's")
    tracker = _Tracker()
    logger = Logger(tmp_path, total_steps=512, initial_step=192, tensorboard=False, progress=False,
                    tracker=tracker, first_iteration=4)  # the checkpoint of iteration 3
    assert sorted(p.name for p in videos.iterdir()) == ["iter_000002.mp4", "mine.mp4"]
    (videos / "iter_000004.mp4").write_bytes(b"new")
    logger.log(256, {"loss": 1.0})
    logger.close()
    assert tracker.videos == [("iter_000004.mp4", b"new", 256)]


def test_a_resume_refused_for_its_csv_starts_no_tracker(tmp_path, capsys, monkeypatch):
    """The CSV is checked before W&B starts: a refused resume leaves no W&B run and no files."""
    import visppo.loop

    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path, **{"run.checkpoint_every": 1}))
    assert code == 0, err
    run_dir = tmp_path / "run"
    (run_dir / "metrics.csv").write_text("step,x\n1,2\n")
    opened = []
    monkeypatch.setattr(visppo.loop, "open_tracker", lambda *args: opened.append(args))
    code, err = run_main(capsys, "train", "--resume", run_dir / "checkpoints" / "iter_000001.pt")
    assert code == 2 and opened == []
    one_error_line(err, "not a CSV file visppo wrote")


def test_a_resume_that_wb_refuses_drops_no_row(tmp_path, capsys, monkeypatch):
    """W&B starts before the Logger drops the rows after the checkpoint: a resume it refuses (not
    logged in, no network) leaves the run's logs as they were."""
    import visppo.loop
    from visppo.errors import RunError

    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path, **{"run.checkpoint_every": 1}))
    assert code == 0, err
    run_dir = tmp_path / "run"
    before = (run_dir / "metrics.csv").read_text()

    def refuse(*args):
        raise RunError("W&B could not start a run: log in")

    monkeypatch.setattr(visppo.loop, "open_tracker", refuse)
    code, err = run_main(capsys, "train", "--resume", run_dir / "checkpoints" / "iter_000001.pt")
    assert code != 0 and "W&B could not start" in err
    assert (run_dir / "metrics.csv").read_text() == before


def test_a_new_run_that_fails_early_leaves_the_folders_own_log_files(tmp_path):
    """Only what the failed run made goes: an events file or wandb/ the folder held stays."""
    from visppo.loop import forget_if_unstarted

    run_dir = tmp_path / "run"
    (run_dir / "wandb" / "run-old").mkdir(parents=True)
    (run_dir / "events.out.tfevents.1.old.1").write_bytes(b"old")
    with pytest.raises(RuntimeError), forget_if_unstarted(run_dir, created=False):
        (run_dir / "config.yaml").write_text("x")
        (run_dir / "events.out.tfevents.2.new.2").write_bytes(b"new")
        (run_dir / "wandb_id").write_text("abc")
        raise RuntimeError("before the first row")
    assert sorted(p.name for p in run_dir.iterdir()) == ["events.out.tfevents.1.old.1", "wandb"]
    assert (run_dir / "wandb" / "run-old").is_dir()

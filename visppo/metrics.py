"""Where a run's numbers go: a progress bar, ``metrics.csv``, TensorBoard, Weights & Biases, phase timers."""

from __future__ import annotations

import csv
import io
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from visppo import extras
from visppo.atomic import atomic_write, atomic_write_text
from visppo.config import Config, to_dict
from visppo.errors import ConfigError, RunError


class PhaseTimer:
    """Wall time per named phase (collect, score, update, ...) and the wall time they lie in,
    lap by lap.

    ``lap()`` reads one clock for both, outside any phase, so a lap's phases always sum to at
    most its wall time: steps/s and the phase times of one metrics row measure the same span.
    Each phase is also a ``torch.profiler.record_function`` range, so a profiler
    trace shows the same phases (the range costs nothing when nobody profiles).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.since = time.perf_counter()  # the first lap starts here
        self.open = 0  # phases entered and not yet left

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        self.open += 1
        try:
            with torch.profiler.record_function(phase):
                yield
        finally:
            self.open -= 1
            self.seconds[phase] += time.perf_counter() - start

    def lap(self) -> tuple[dict[str, float], float]:
        """The seconds per phase since the last lap, and the wall seconds since then; starts the next."""
        if self.open:  # the open phase would count in two laps, and its sum could pass the lap's span
            raise RuntimeError("PhaseTimer.lap() inside a phase: end the lap between phases")
        now = time.perf_counter()
        out, wall = dict(self.seconds), now - self.since
        self.seconds, self.since = defaultdict(float), now
        return out, wall


@dataclass(frozen=True)
class Span:
    """Phase seconds, and the wall seconds and env steps they lie in, of one or more laps.

    A metrics row stands for every iteration since the previous row (``run.log_every`` > 1), so its
    steps/s and ``time/*`` must sum the laps of all of them, not show its own iteration's alone:
    ``steps / wall`` then measures the same span as the row's phase times and its steps.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0
    steps: int = 0

    def plus(self, later: Span) -> Span:
        """This span followed by ``later``: phase by phase, wall and steps, summed."""
        seconds = dict(self.seconds)
        for phase, s in later.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + s
        return Span(seconds, self.wall + later.wall, self.steps + later.steps)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.wall


def iteration_profiler(run_dir: Path) -> torch.profiler.profile:
    """A profiler that records the third iteration it is stepped through (one skipped, one warm-up)
    and writes its trace to ``run_dir/profile/``. Call ``start()``, ``step()`` after every
    iteration, ``stop()`` at the end."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities, schedule=schedule(skip_first=1, wait=0, warmup=1, active=1, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(run_dir / "profile")),
                   record_shapes=True, profile_memory=True)


class Logger:
    """Appends one row per logged iteration to ``metrics.csv``, TensorBoard and a ``tracker``.

    The CSV's columns are fixed by the first row written in the run (a resumed
    run appends under the existing header); keys that appear later go to
    TensorBoard and the tracker only. The tracker (:class:`WandbTracker`) also gets each
    evaluation video that appeared in ``run_dir/videos`` since the last row.
    """

    def __init__(self, run_dir: Path, total_steps: int, initial_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, tracker: WandbTracker | None = None,
                 first_iteration: int = 1):
        self.csv_path = run_dir / "metrics.csv"
        self.tracker = tracker
        self.videos_dir = run_dir / "videos"
        self.columns: list[str] | None = None
        if self.csv_path.exists() and self.csv_path.stat().st_size:
            self.columns = _drop_rows_after(self.csv_path, initial_step)
        for video in self._videos():  # a resumed run redoes these iterations: their videos go, as their rows
            if _video_iteration(video) >= first_iteration:
                video.unlink()
        self.videos_seen = set(self._videos())  # a resumed run's earlier videos were sent before
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run drops the events logged after its checkpoint, as the CSV rows
            self.writer = SummaryWriter(str(run_dir), purge_step=initial_step + 1 if initial_step else None)
        self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                        disable=not progress, smoothing=0.1)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        row = {"global_step": step, **scalars}
        if self.columns is None:
            self.columns = list(row)
            with self.csv_path.open("w", newline="") as f:
                csv.writer(f).writerow(self.columns)
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(row)
        if self.writer is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        if self.tracker is not None:
            self.tracker.log(step, scalars)
            for video in sorted(set(self._videos()) - self.videos_seen):
                self.tracker.video(video, step)
                self.videos_seen.add(video)

    def _videos(self) -> list[Path]:
        return [p for p in self.videos_dir.glob("iter_*") if p.suffix in (".mp4", ".gif")] \
            if self.videos_dir.is_dir() else []

    def progress(self, steps: int, postfix: str) -> None:
        self.bar.update(steps)
        self.bar.set_postfix_str(postfix, refresh=False)

    def message(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.tracker is not None:
            self.tracker.close()


# --------------------------------------------------------------------------- Weights & Biases


def check_tracking(cfg: Config) -> None:
    """``run.wandb=true`` without the wandb extra: a ConfigError, before the run writes anything."""
    if cfg.run.wandb:
        extras.require("wandb", extras.EXTRAS["wandb"], "run.wandb=true")


def open_tracker(cfg: Config, run_dir: Path, resuming: bool) -> WandbTracker | None:
    """The run's W&B tracker with ``run.wandb``, else None."""
    return WandbTracker(cfg, run_dir, resuming) if cfg.run.wandb else None


class WandbTracker:
    """A W&B run in ``run_dir/wandb``: the config, every metrics row (``global_step`` its x axis)
    and the evaluation videos. ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it).

    A resumed run continues the same W&B run (its id is kept in ``run_dir/wandb_id``); rows the
    resumed run logs again show twice there, the CSV keeps one.
    """

    ID_FILE = "wandb_id"

    def __init__(self, cfg: Config, run_dir: Path, resuming: bool):
        import wandb

        self.wandb = wandb
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        run_id = run_id or uuid.uuid4().hex[:8]  # W&B's own ids: 8 lowercase letters and digits
        r = cfg.run
        try:
            self.run = wandb.init(project=r.wandb_project or None, entity=r.wandb_entity or None,
                                  name=r.wandb_name or run_dir.name, dir=str(run_dir), config=to_dict(cfg),
                                  id=run_id, resume="allow", settings=wandb.Settings(console="off"))
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise RunError(f"W&B could not start a run in {run_dir} ({type(exc).__name__}: {first}): log in with "
                           "`wandb login` or set WANDB_MODE=offline (or WANDB_MODE=disabled)") from None
        atomic_write_text(id_file, run_id + "\n")
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({"global_step": step, **scalars})

    def video(self, path: Path, step: int) -> None:
        self.run.log({"global_step": step, "eval/video": self.wandb.Video(str(path), format=path.suffix[1:])})

    def close(self) -> None:
        """Finish the W&B run, its files complete on disk when this returns.

        ``run.finish()`` returns once wandb's service process has the run's last records; the
        service writes the rest of the run's ``.wandb`` file and closes it only after that, on its
        own time (on a loaded machine a reader found the last rows missing). Ending the service
        (``wandb.teardown``) waits for it. Not while another W&B run of this process is active:
        ending the service would finish that run too (its file is then complete when the service
        ends, at the latest when the process exits)."""
        self.run.finish()
        if not _other_wandb_runs():
            self.wandb.teardown()


def _other_wandb_runs() -> bool:
    """Whether this process has an active W&B run (True when wandb cannot say)."""
    try:
        from wandb.sdk import wandb_setup

        return wandb_setup.singleton().most_recent_active_run is not None
    except Exception:  # noqa: BLE001 - a wandb without it: leave the service alone
        return True


def _video_iteration(path: Path) -> float:
    """The iteration of ``videos/iter_N.mp4``; a name visppo did not write counts as before every one."""
    try:
        return int(path.stem.removeprefix("iter_"))
    except ValueError:
        return -math.inf


def _step(cell: str) -> float:
    """A row's global_step; a row a kill cut short (unreadable) counts as after every step."""
    try:
        return float(cell)
    except ValueError:
        return math.inf


def complete_text(path: Path) -> str:
    """A CSV file's text up to its last newline: a last line a kill cut short is not data (a number
    cut from 123.5 would read as 12)."""
    return _complete(path.read_text(encoding="utf-8"))


def _complete(text: str) -> str:
    return text if text.endswith("\n") else text[: text.rfind("\n") + 1]


def check_metrics(path: Path) -> tuple[str, list[list[str]]]:
    """``(text, rows)`` of a run's ``metrics.csv`` (up to its last complete line), or a ConfigError
    saying to move it away when it is not one visppo wrote; reads only (a resume checks it before
    anything of the run changes or starts). A missing or empty file: ``("", [])``."""
    move_away = "move it away (the resumed run then starts a new one) and resume again"
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not the run's metrics file: {move_away}")
    if not path.exists():
        return "", []
    try:
        text = path.read_text(encoding="utf-8")
        rows = list(csv.reader(io.StringIO(_complete(text))))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path} is not a CSV file visppo wrote ({type(exc).__name__}): {move_away}") from None
    if rows and (not rows[0] or rows[0][0] != "global_step"):
        raise ConfigError(f"{path} is not a CSV file visppo wrote (its header does not start with global_step): "
                          f"{move_away}")
    return text, rows


def _drop_rows_after(path: Path, step: int) -> list[str] | None:
    """Keep the CSV rows up to ``step`` (a resumed run redoes the rest); returns the header, or None
    when there is none to keep (the file is then removed, and the next row writes a new header).

    A last line that a kill cut short (:func:`complete_text`; the header too) is dropped, so that the
    next row never glues onto it. The rewrite is atomic: a crash during it keeps the old file."""
    text, rows = check_metrics(path)
    if not rows:
        path.unlink()
        return None
    header, body = rows[0], rows[1:]
    kept_text = _complete(text)
    kept = [r for r in body if len(r) == len(header) and _step(r[0]) <= step]  # and not cut short by a kill
    if kept_text != text or len(kept) != len(body):
        atomic_write(path, lambda f: csv.writer(f).writerows([header, *kept]), binary=False)
    return header

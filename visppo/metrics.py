"""Where a run's numbers go: a progress bar, ``metrics.csv``, TensorBoard, phase timers."""

from __future__ import annotations

import csv
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from visppo.config import ConfigError


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
    """Appends one row per logged iteration to ``metrics.csv`` and TensorBoard.

    The CSV's columns are fixed by the first row written in the run (a resumed
    run appends under the existing header); keys that appear later go to
    TensorBoard only.
    """

    def __init__(self, run_dir: Path, total_steps: int, initial_step: int = 0,
                 tensorboard: bool = True, progress: bool = True):
        self.csv_path = run_dir / "metrics.csv"
        self.columns: list[str] | None = None
        if self.csv_path.exists() and self.csv_path.stat().st_size:
            self.columns = _drop_rows_after(self.csv_path, initial_step)
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

    def progress(self, steps: int, postfix: str) -> None:
        self.bar.update(steps)
        self.bar.set_postfix_str(postfix, refresh=False)

    def message(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _step(cell: str) -> float:
    """A row's global_step; a row a kill cut short (unreadable) counts as after every step."""
    try:
        return float(cell)
    except ValueError:
        return math.inf


def _drop_rows_after(path: Path, step: int) -> list[str] | None:
    """Keep the CSV rows up to ``step`` (a resumed run redoes the rest); returns the header, or None
    when there is none to keep (the file is then removed, and the next row writes a new header).

    A last line without its newline was cut short by a kill (the header too): it is dropped, so that
    the next row never glues onto it."""
    move_away = "move it away (the resumed run then starts a new one) and resume again"
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not the run's metrics file: {move_away}")
    try:
        cut = not path.read_bytes().endswith(b"\n")
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path} is not a CSV file visppo wrote ({type(exc).__name__}): {move_away}") from None
    if cut:
        rows = rows[:-1]
    if not rows:
        path.unlink()
        return None
    header, body = rows[0], rows[1:]
    if not header or header[0] != "global_step":
        raise ConfigError(f"{path} is not a CSV file visppo wrote (its header does not start with global_step): "
                          f"{move_away}")
    kept = [r for r in body if len(r) == len(header) and _step(r[0]) <= step]  # and not cut short by a kill
    if cut or len(kept) != len(body):
        tmp = path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            csv.writer(f).writerows([header, *kept])
        tmp.replace(path)
    return header

"""Phase timers and the one-iteration profiler trace."""

from __future__ import annotations

import gzip
import json
import time

import pytest
import torch

from visppo.metrics import PhaseTimer, iteration_profiler


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

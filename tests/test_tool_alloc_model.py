"""tools/alloc_model.py: the caching allocator's policy on cases worked out by hand from its rules
(rounding, pools, segment sizes, best fit, splitting, merging, release under a limit); the replay
of a trace in validate_probe's layout, phase by phase; bad input is one ``error:`` line, exit 2."""

from __future__ import annotations

import gzip
import importlib
import json
import sys
from pathlib import Path

import pytest
from conftest import one_error_line

TOOLS = Path(__file__).resolve().parents[1] / "tools"
MIB = 2**20


def tool():
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module("alloc_model")


am = tool()


def test_small_requests_share_a_2_mib_segment_in_512_byte_blocks():
    a = am.CachingAllocator()
    x, y = a.malloc(100), a.malloc(1000)
    assert (x.size, y.size) == (512, 1024) and y.addr == x.addr + 512
    assert (a.reserved, a.allocated, a.segments) == (2 * MIB, 1536, 1)


def test_a_request_under_10_mib_gets_a_20_mib_segment_and_the_next_one_its_rest():
    a = am.CachingAllocator()
    a.malloc(5 * MIB)
    a.malloc(5 * MIB)
    assert (a.reserved, a.segments) == (20 * MIB, 1)


def test_a_large_block_is_split_only_when_more_than_1_mib_would_remain():
    a = am.CachingAllocator()
    a.free(a.malloc(14 * MIB))  # its own segment: 14 MiB
    b = a.malloc(13 * MIB)  # 1 MiB would remain: not split, allocated counts the whole block
    assert (b.size, a.allocated, a.reserved) == (14 * MIB, 14 * MIB, 14 * MIB)
    a.free(b)
    c = a.malloc(12 * MIB + 1)  # rounded to 12 MiB + 512: 2 MiB - 512 would remain: split
    assert c.size == 12 * MIB + 512 and a.allocated == c.size


def test_growing_requests_leave_the_smaller_cached_segments_unused():
    """The pattern that makes the reserve outgrow what is allocated: each request is a little
    larger than the free block the one before left."""
    a = am.CachingAllocator()
    for mib in (12, 14, 16):
        a.free(a.malloc(mib * MIB))
    assert (a.reserved, a.peak_allocated, a.segments) == (42 * MIB, 16 * MIB, 3)


def test_the_smallest_free_block_that_fits_serves_a_request():
    a = am.CachingAllocator()
    big, small = a.malloc(30 * MIB), a.malloc(24 * MIB)
    a.free(big)
    a.free(small)
    assert a.malloc(22 * MIB).addr == small.addr


def test_freed_neighbours_merge_and_serve_a_request_of_their_sum():
    a = am.CachingAllocator()
    x, y, z = a.malloc(4 * MIB), a.malloc(4 * MIB), a.malloc(4 * MIB)  # one 20 MiB segment
    a.free(x)
    a.free(z)
    a.free(y)  # merges with both sides: the whole segment is one free block again
    assert a.malloc(20 * MIB).addr == x.addr and a.segments == 1


def test_under_a_limit_wholly_free_segments_are_released_before_running_out_of_memory():
    a = am.CachingAllocator(limit=40 * MIB)
    a.free(a.malloc(24 * MIB))
    a.malloc(30 * MIB)  # 24 + 30 > 40: the wholly free 24 MiB segment goes, then it fits
    assert (a.reserved, a.peak_reserved, a.segments) == (30 * MIB, 30 * MIB, 2)
    with pytest.raises(am.OutOfMemory):
        a.malloc(12 * MIB)
    b = am.CachingAllocator(limit=40 * MIB)
    b.free(b.malloc(24 * MIB))
    b.malloc(2 * MIB)  # served by the cached 24 MiB block, which is split: it cannot be released
    with pytest.raises(am.OutOfMemory):
        b.malloc(30 * MIB)
    assert b.reserved == 24 * MIB


def _trace(events, phases=()):
    return {"format": "[action, address, bytes, stream]", "phases": list(phases), "events": events, "segments": []}


def test_a_replay_follows_the_trace_phase_by_phase():
    """Recorded: a 14 MiB then a 16 MiB segment (the first cached, unused), then empty_cache before
    the scoring phase releases it. The model asks for the same segments and releases the same one."""
    events = [["snapshot", 0, 0, 0],
              ["segment_alloc", 1000, 14 * MIB, 0], ["alloc", 1000, 14 * MIB, 0],
              ["free_requested", 1000, 14 * MIB, 0], ["free_completed", 1000, 14 * MIB, 0],
              ["segment_alloc", 9000, 16 * MIB, 0], ["alloc", 9000, 16 * MIB, 0],
              ["snapshot", 0, 0, 0],
              ["segment_free", 1000, 14 * MIB, 0], ["alloc", 500, 100, 0], ["segment_alloc", 500, 2 * MIB, 0]]
    phases = am.replay(_trace(events, ["update", "score"]))
    assert [p["phase"] for p in phases] == ["before", "update", "score"]
    update, score = phases[1], phases[2]
    assert update["recorded_reserved_peak"] == update["model_reserved_peak"] == 30 * MIB
    assert (update["recorded_segments"], update["model_segments"]) == (2, 2)
    assert score["recorded_reserved_peak"] == score["model_reserved_peak"] == 30 * MIB  # held at its start
    assert score["error"] == 0.0 and score["model_segments"] == 1


def test_a_model_that_misses_the_reserve_shows_it_as_an_error():
    """The real allocator kept two segments where the model reuses one: the error says by how much."""
    events = [["segment_alloc", 0, 14 * MIB, 0], ["alloc", 0, 14 * MIB, 0], ["free_completed", 0, 0, 0],
              ["segment_alloc", 99, 14 * MIB, 0], ["alloc", 99, 13 * MIB, 0]]
    [whole] = am.replay(_trace(events))
    assert whole["phase"] == "all" and whole["error"] == pytest.approx(-0.5)


def test_the_command_line_replays_validate_probes_files(tmp_path, capsys):
    vp = importlib.import_module("validate_probe")
    snapshot = {"device_traces": [[{"action": "segment_alloc", "addr": 0, "size": 2 * MIB, "stream": 0},
                                   {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": []}]],
                "segments": []}
    path = tmp_path / "row.json.gz"
    vp.write_trace(snapshot, [], str(path))
    assert am.main([str(path), "--json", str(tmp_path / "r.json")]) == 0
    assert "row.json.gz" in capsys.readouterr().out
    [row] = json.loads((tmp_path / "r.json").read_text())
    assert row["recorded_reserved_peak"] == row["model_reserved_peak"] == 2 * MIB


@pytest.mark.parametrize("content, args, needle", [
    (b"not gzip", [], "is not a trace"),
    (gzip.compress(b'{"rows": []}', mtime=0), [], "is not a trace"),
    (gzip.compress(b'{"events": []}', mtime=0), ["--json", "nowhere/r.json"], "does not exist"),
    (gzip.compress(b'{"events": []}', mtime=0), ["--json", "."], "is a folder"),
    (gzip.compress(b'{"events": [1, 2]}', mtime=0), [], "is not [action, address, size, stream]"),
    (gzip.compress(b'{"events": [{"action": "alloc"}]}', mtime=0), [], "is not [action, address, size, stream]"),
    (gzip.compress(b'{"events": [], "phases": [3]}', mtime=0), [], "phases"),
    (gzip.compress(b'{"events": []}', mtime=0), ["--nosuch"], "unrecognized arguments"),
], ids=["not-gzip", "no-events", "json-folder-missing", "json-is-folder", "events-not-lists", "event-dict",
        "phases-not-names", "unknown-option"])  # ids: xdist's workers must collect the same names
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch, content, args, needle):
    path = tmp_path / "t.json.gz"
    path.write_bytes(content)
    monkeypatch.chdir(tmp_path)
    try:
        code = am.main([str(path), *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    one_error_line(captured.err, needle)

"""A model of PyTorch's CUDA caching allocator, replayed over allocator traces recorded on a GPU.

    python tools/alloc_model.py traces/*.json.gz            # recorded vs modelled reserve, per phase
    python tools/alloc_model.py traces/*.json.gz --json out.json
    exit code 0: every trace replayed; exit code 2: bad input (a file that is not such a trace)

Why: the probe counts the bytes a pass allocates; a GPU holds what the caching allocator
*reserved*, which on the 2026-11-24 H100 run was 1.2-1.5x that for fp32 passes. A model of the
allocator's policy, fed the same sequence of requests, says what it reserves; this tool checks
the model against what the real allocator did (``tools/validate_probe.py --traces`` records every
action: each ``alloc`` with the bytes asked for, each ``free_completed``, each cudaMalloc'd
``segment_alloc`` and cudaFree'd ``segment_free``), so the model is trusted only as far as the
traces bear it out.

The policy modelled (``c10/cuda/CUDACachingAllocator.cpp``, default settings: no expandable
segments, no ``max_split_size_mb``, no ``roundup_power2_divisions``, no garbage-collection
threshold, one stream):

- a request is rounded up to a multiple of 512 B (at least 512);
- requests up to 1 MiB come from the small pool, larger ones from the large pool;
- the smallest free block of the pool that is large enough serves it (the lowest address among
  equal sizes); if none, a new segment is cudaMalloc'd: 2 MiB for a small request, 20 MiB for
  one under 10 MiB, else the request rounded up to 2 MiB;
- the block is split when what would remain is at least 512 B (small pool) or more than 1 MiB
  (large pool); otherwise the request gets the whole block (``allocated`` counts it whole);
- a freed block merges with free neighbours of its segment and goes back to its pool;
- under a limit (``set_per_process_memory_fraction``), a segment that would pass it is not
  cudaMalloc'd: every cached segment that is wholly free is released first and the request
  retried; then out of memory. ``torch.cuda.empty_cache()`` releases the same segments.

A recorded ``segment_free`` (``empty_cache`` in the traced workload, or a release under a limit)
makes the model release its own wholly free segments at the same point.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path

MIN_BLOCK = 512
SMALL_REQUEST = 2**20
SMALL_SEGMENT = 2 * 2**20
LARGE_SEGMENT = 20 * 2**20
OWN_SEGMENT_FROM = 10 * 2**20
OWN_SEGMENT_ROUND = 2 * 2**20


def round_request(nbytes: int) -> int:
    """The block size a request of ``nbytes`` asks its pool for."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_bytes(size: int) -> int:
    """What cudaMalloc is asked for when no cached block serves a (rounded) request of ``size``."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < OWN_SEGMENT_FROM:
        return LARGE_SEGMENT
    return -(-size // OWN_SEGMENT_ROUND) * OWN_SEGMENT_ROUND


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    small: bool
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


class OutOfMemory(RuntimeError):
    """The model's allocator could not serve a request under its limit."""


class CachingAllocator:
    """The policy of the module doc over made-up addresses; ``reserved`` and ``allocated`` (and
    their peaks) are what ``torch.cuda.memory_reserved`` and ``memory_allocated`` would read."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, addr) of free blocks
        self.free_blocks: dict[int, Block] = {}
        self.next_addr = 0
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.segments = 0
        """cudaMalloc calls so far."""

    def malloc(self, nbytes: int) -> Block:
        size = round_request(nbytes)
        small = size <= SMALL_REQUEST
        block = self._best_fit(size, small) or self._new_segment(size, small)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_REQUEST):
            rest = Block(block.addr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        block.free = True
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block)

    def release_cached(self) -> None:
        """``empty_cache``: cudaFree every segment that is wholly free (one free block, unsplit)."""
        for block in [b for b in self.free_blocks.values() if b.prev is None and b.next is None]:
            self._remove(block)
            self.reserved -= block.size

    def _best_fit(self, size: int, small: bool) -> Block | None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = self.free_blocks[pool[i][1]]
        self._remove(block)
        return block

    def _new_segment(self, size: int, small: bool) -> Block:
        nbytes = segment_bytes(size)
        if self.limit is not None and self.reserved + nbytes > self.limit:
            self.release_cached()
            if self.reserved + nbytes > self.limit:
                raise OutOfMemory(f"{size} B asked, {self.reserved} B reserved, limit {self.limit} B")
        block = Block(self.next_addr, nbytes, small)
        self.next_addr += nbytes
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segments += 1
        return block

    def _insert(self, block: Block) -> None:
        bisect.insort(self.pools[block.small], (block.size, block.addr))
        self.free_blocks[block.addr] = block

    def _remove(self, block: Block) -> None:
        pool = self.pools[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.addr))]
        del self.free_blocks[block.addr]


def replay(trace: dict) -> list[dict]:
    """Per phase of a trace (:func:`validate_probe.compact_trace`'s layout; the whole trace when it
    marks none): the recorded and the modelled peak reserve and cudaMalloc count, and the peak the
    allocator's ``allocated`` reached. Peaks are taken within the phase, from what was held at its
    start (as ``reset_peak_memory_stats`` would)."""
    events = trace["events"]
    freeing = "free_completed" if any(e[0] == "free_completed" for e in events) else "free_requested"
    model, live = CachingAllocator(), {}
    recorded = 0
    names = list(trace.get("phases", []))
    phases: list[dict] = []

    def open_phase(name: str) -> None:
        phases.append({"phase": name, "recorded_reserved_peak": recorded, "model_reserved_peak": model.reserved,
                       "recorded_segments": 0, "model_segments_before": model.segments,
                       "allocated_peak": model.allocated})

    open_phase("before" if names else "all")
    releasing = False
    for action, addr, size, _stream in events:
        if action == "snapshot" and names:
            open_phase(names.pop(0))
        elif action == "alloc":
            live[addr] = model.malloc(size)
        elif action == freeing and addr in live:
            model.free(live.pop(addr))
        elif action == "segment_alloc":
            recorded += size
            phases[-1]["recorded_segments"] += 1
        elif action == "segment_free":
            recorded -= size
            if not releasing:  # the first of a run of releases: the model releases what it can
                model.release_cached()
        releasing = action == "segment_free"
        now = phases[-1]
        now["recorded_reserved_peak"] = max(now["recorded_reserved_peak"], recorded)
        now["model_reserved_peak"] = max(now["model_reserved_peak"], model.reserved)
        now["allocated_peak"] = max(now["allocated_peak"], model.allocated)
    ends = [p["model_segments_before"] for p in phases[1:]] + [model.segments]  # each phase ends where the next starts
    for p, end in zip(phases, ends, strict=True):
        p["model_segments"] = end - p.pop("model_segments_before")
        peak = p["recorded_reserved_peak"]
        p["error"] = (p["model_reserved_peak"] - peak) / peak if peak else 0.0
    return phases


def is_event(e) -> bool:
    """``[action, address, size, stream]``, as :func:`validate_probe.compact_trace` writes them."""
    return (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in e[1:]))


def read_trace(path: Path) -> dict:
    try:
        trace = json.loads(gzip.decompress(path.read_bytes()))
        if not isinstance(trace.get("events"), list):
            raise ValueError("no events list")
        bad = next((e for e in trace["events"] if not is_event(e)), None)
        if bad is not None:
            raise ValueError(f"event {str(bad)[:60]} is not [action, address, size, stream]")
        phases = trace.get("phases", [])
        if not (isinstance(phases, list) and all(isinstance(p, str) for p in phases)):
            raise ValueError("phases is not a list of names")
    except (OSError, ValueError, EOFError, gzip.BadGzipFile, AttributeError) as exc:
        raise UsageError(f"{path} is not a trace of validate_probe.py --traces ({exc})") from None
    return trace


class UsageError(Exception):
    """Bad input: one ``error:`` line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="*.json.gz from validate_probe.py --traces")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    try:
        if args.json is not None and not args.json.parent.is_dir():
            raise UsageError(f"--json {args.json}: folder {args.json.parent} does not exist")
        if args.json is not None and args.json.is_dir():
            raise UsageError(f"--json {args.json} is a folder: give a file name")
        rows = [{"trace": path.name, **phase} for path in args.traces for phase in replay(read_trace(path))]
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mib = 2**20
    print(f"{'trace':>44s} {'phase':>7s} {'recorded MiB':>12s} {'model MiB':>10s} {'error':>8s} {'segments':>12s}")
    for r in rows:
        print(f"{r['trace']:>44s} {r['phase']:>7s} {r['recorded_reserved_peak'] / mib:12.1f} "
              f"{r['model_reserved_peak'] / mib:10.1f} {100 * r['error']:+7.2f}% "
              f"{r['recorded_segments']:5d} {r['model_segments']:5d}")
    if args.json is not None:
        from visppo.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

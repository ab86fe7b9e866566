"""Check the memory probe's estimates against a measurement that shares no code with it.

    python tools/validate_probe.py --device cpu --json probe_cpu.json     # oracle: torch.profiler
    python tools/validate_probe.py --device cuda --json probe_gpu.json    # real GPU: allocator + driver
    python tools/validate_probe.py --device cpu --quick                   # a small grid: seconds
    python tools/validate_probe.py --device cuda --cap --traces traces/   # + capped rows, allocator traces
    python tools/validate_probe.py --device cuda --cap --resume part.json --json all.json  # what part.json lacks
    exit code 0: every row and headline passed; exit code 1: one failed (outside LIMITS, or out
    of memory under its cap); exit code 2: bad input

Every row is one config (encoder, image size, AMP) and one size: a micro-batch
(``kind=micro_batch``) or an inference chunk (``kind=infer_chunk``). The
estimate is what ``visppo probe`` reports for that size in fake mode (nothing
allocated; the mode used for a GPU the machine lacks), and in real mode.

The measurement runs what training runs, for real, in a fresh state:

- ``micro_batch``: build the policy and Adam, then ``ppo.update`` over a rollout
  of two minibatches of ``2 x size`` samples each (so every minibatch accumulates two
  micro-batches), one epoch: the first minibatch's step creates Adam's state, so the
  second minibatch runs as every later one does (a second epoch measured the same
  bytes: 38,116,464 B either way for the Nature CNN 84x84 bf16 micro-batch 32); the
  row's figure is the peak over all of it.
- ``infer_chunk``: the same first, then ``ppo.infer`` over the rollout in chunks of
  ``size`` (as after collection: gradients and Adam state live); the figure is
  the peak during the score pass.

On the CPU the meter is ``torch.profiler`` with ``profile_memory=True``: every
allocation and free of the CPU allocator while profiling, summed in time order
(frees of blocks allocated before profiling are not reported, so the rollout
buffer, made before, stays out, as it does in the probe's device budget). The
probe's own meters (``FakeTensorMode`` + a dispatch-mode counter) see tensors,
not allocator calls; nothing here calls them.

On CUDA the figures are the caching allocator's ``max_memory_allocated`` and
``max_memory_reserved`` and the device's whole use from ``torch.cuda.mem_get_info``
(CUDA context included), against the probe's CUDA estimate (fake mode, the
same as on a machine without a GPU). ``--device cuda`` also runs the headline
check (first, so that a run cut short by a time limit keeps it): under an 8 GiB cap
(``set_per_process_memory_fraction``) the sizes the
probe recommends for ResNet-18 @224 x 3 frames, minibatch 256 (fp32, bf16, and
fp16 with a GradScaler) run a full update without running out of memory, and the
micro-batched gradient equals the unsplit minibatch's.

``--cap`` (CUDA) runs every row a second time, right after its uncapped run (a run cut
short keeps whole pairs), on a card just the size the probe names: the allocator capped (``set_per_process_memory_fraction``) at the row's
estimate plus :data:`CAP_SLACK`, less the CUDA context. With memory to spare the
caching allocator keeps what it reserved; near a cap it frees cached blocks and
retries, and cuDNN picks smaller workspaces, so the capped row is what an 8 GiB
card sees. It passes when it runs without running out of memory (no back-off
warning either; cuDNN's and cuBLAS's allocation failures, plain ``RuntimeError``s, count as
out of memory there) and its device use is within :data:`LIMITS` of the estimate.

``--traces DIR`` (CUDA) also writes every uncapped row's allocator actions, in order, to
``DIR/<row>.json.gz`` (``torch.cuda.memory._record_memory_history``, without stack frames: every
alloc, free and cudaMalloc'd or freed segment with its bytes and stream, where each phase starts,
and the segments held at the end): what a model of the caching allocator can be built and checked
against on a machine without a GPU.

Each row runs in a child process (``--one``) so that no allocator cache,
autocast cache or profiler state carries from one row to the next. A child that fails
(a crash, an error that is not out of memory) is recorded as a failed row or headline, with
its stderr's last lines, and the run goes on to the next; the summary counts it as failing.
The JSON carries the date, the device's name, the CUDA version, ``PYTORCH_CUDA_ALLOC_CONF``
and the command line, so a file read later says what made it.

``--resume FILE`` (CUDA) carries on a run that a time limit cut short, in a later call or session:
FILE's headlines and rows go into this run's JSON as they are, and only what FILE lacks runs (the
missing headline precisions, the rows it has not measured, and the capped runs of its measured rows
that lack one). FILE must have been made on a GPU of the same name, with the same torch, CUDA and
``PYTORCH_CUDA_ALLOC_CONF``, and its rows must be rows of this run's grid; otherwise it is refused
(exit code 2), as rows of two machines are not one grid. The JSON lists the earlier runs' dates and
command lines under ``resumed_from``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

# (encoder, image size, micro-batch sizes, chunk sizes): 3 stacked RGB frames, DotReach
FULL_GRID = [
    ("nature", 84, (32, 128), (256,)),
    ("resnet18", 64, (16, 48), (64,)),
    ("resnet18", 96, (24,), (48,)),
    ("mobilenet_v3_small", 64, (32,), (128,)),
    ("mobilenet_v3_small", 96, (16,), (64,)),
]
QUICK_GRID = [  # --quick: seconds, not minutes (the tests pick their own rows)
    ("nature", 64, (16,), (64,)),
    ("mobilenet_v3_small", 48, (8,), ()),
    ("resnet18", 32, (4,), ()),
]
CUDA_GRID = [
    ("nature", 84, (64, 256), (1024,)),
    ("resnet18", 128, (64, 128), (256,)),
    ("resnet18", 224, (32, 64), (128,)),
    ("mobilenet_v3_small", 224, (64, 128), (256,)),
]
AMPS = ("off", "bf16")
LIMITS = (-0.02, 0.05)
"""A row passes when ``(estimate - measured) / measured`` lies in this range: within 5% of the
device's use at the peak and never more than 2% under it (issue 58)."""
CAP_SLACK = 0.02
"""A capped row's allocator may hold the estimate plus this fraction (the most a row may be
under): running out of memory there means the estimate is more than that under."""
ALLOC_FAILURES = ("CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED", "GET was unable to find an engine")
"""cuDNN's and cuBLAS's words for an allocation that failed: near a cap they raise a plain
``RuntimeError`` with these, not ``torch.cuda.OutOfMemoryError``, for what is running out of memory."""
FAILED_LINES = 3
"""How many of a failed child's last stderr lines its row keeps (the exception and its cause)."""


def overrides(encoder: str, image: int, amp: str, minibatch: int, rollout: int, device: str,
              epochs: int = 1) -> list[str]:
    return [f"model.encoder={encoder}", f"env.image_size={image}", "env.frame_stack=3", "env.id=visppo/DotReach-v0",
            f"train.amp={amp}", f"train.device={device}", "model.encoder_weights=none",
            f"ppo.minibatch_size={minibatch}", "ppo.num_envs=1", f"ppo.num_steps={rollout}", f"ppo.num_epochs={epochs}",
            "ppo.target_kl=0", "ppo.recompute_advantages=false", "ppo.recompute_logp_old=false"]


def plan(grid, amps) -> list[dict]:
    """The grid's rows breadth first: one size of every (encoder, image, precision, kind) before a
    second size of any, so that a run cut short by a time limit (a GPU session's) has measured
    every kind of row rather than all sizes of the first few."""
    rows = []
    for encoder, image, micros, chunks in grid:
        for amp in amps:
            for kind, sizes in (("micro_batch", micros), ("infer_chunk", chunks)):
                rows += [(i, dict(encoder=encoder, image=image, amp=amp, kind=kind, size=size))
                         for i, size in enumerate(sizes)]
    return [row for _, row in sorted(rows, key=lambda r: r[0])]  # stable: the grid's order within a round


def sizes_of(row: dict) -> tuple[int, int]:
    """(minibatch, rollout) of a row: two micro-batches per minibatch, two minibatches per rollout;
    a chunk row scores a rollout of four chunks."""
    if row["kind"] == "micro_batch":
        return 2 * row["size"], 4 * row["size"]
    return 2 * row["size"], 4 * row["size"]


# --------------------------------------------------------------------------- the workload (real training code)


def make_buffer(cfg, device: torch.device):
    """``(buffer, obs_space, action_space)``: a host rollout buffer of the config, random-filled
    (pinned when the device is a GPU, as training makes it)."""
    from visppo.buffer import RolloutBuffer
    from visppo.envs import make_env

    env = make_env(cfg)
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    gen = torch.Generator().manual_seed(0)
    buf = RolloutBuffer(cfg.ppo.num_steps, cfg.ppo.num_envs, obs_space, action_space,
                        pin_memory=device.type == "cuda", channels_last=cfg.train.channels_last)
    for v in buf.obs.values():
        v.copy_(torch.randint(0, 256, v.shape, generator=gen, dtype=torch.uint8) if v.dtype == torch.uint8
                else torch.randn(v.shape, generator=gen).to(v.dtype))
    for name in ("advantages", "returns", "values"):
        getattr(buf, name).copy_(torch.randn(buf.T, buf.N, generator=gen))
    buf.logp.copy_(-torch.rand(buf.T, buf.N, generator=gen))
    return buf, obs_space, action_space


def _workload(cfg, device: torch.device, kind: str, size: int, phase):
    """Build what training builds and run it; ``phase(name)`` is a context manager around each part."""
    from visppo.builders import build_optimizer, build_policy
    from visppo.ppo import MemorySizes, UpdateSetup, infer, update
    from visppo.precision import resolve_precision

    buf, obs_space, action_space = make_buffer(cfg, device)
    yield "ready"  # the buffer is made: measuring starts here
    with phase("build"):
        policy = build_policy(cfg, obs_space, action_space, device, load_weights=False)
        optimizer = build_optimizer(cfg, policy)
        precision = resolve_precision(cfg.train.amp, device)
    micro = size if kind == "micro_batch" else cfg.ppo.minibatch_size
    setup = UpdateSetup(cfg.ppo, MemorySizes(micro, 1024), device, precision, torch.Generator().manual_seed(1))
    with phase("update"):
        update(policy, optimizer, buf, setup)
    if kind == "infer_chunk":
        with phase("score"):
            infer(policy, buf.flat_obs(), buf.flat(buf.actions), MemorySizes(micro, size), device, precision)
    yield "done"


def _phases():
    from contextlib import contextmanager

    @contextmanager
    def phase(name):
        with torch.profiler.record_function(f"validate_probe.{name}"):
            yield
    return phase


def measure_cpu(cfg, kind: str, size: int) -> int:
    """Peak bytes held through the CPU allocator by the row's workload (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    work = _workload(cfg, torch.device("cpu"), kind, size, _phases())
    next(work)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        next(work)
    return peak_from_events(prof.profiler.kineto_results.events(),
                            "validate_probe.score" if kind == "infer_chunk" else None)


def peak_from_events(events, window: str | None = None) -> int:
    """Running sum of the profiler's ``[memory]`` events in time order; its maximum (within the
    span of the user annotation ``window`` when given)."""
    mem = sorted(((e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                 key=lambda t: t[0])
    lo, hi = -1, float("inf")
    if window is not None:
        spans = [(e.start_ns(), e.end_ns()) for e in events if e.name() == window]
        lo, hi = min(s for s, _ in spans), max(t for _, t in spans)
    live = peak = 0
    for t, n in mem:
        live += n
        if lo <= t <= hi:
            peak = max(peak, live)
    return peak


def device_use(device: torch.device) -> dict:
    """What the device holds for this process now: its whole use (``mem_get_info``: context,
    kernels, cuBLAS/cuDNN and every segment the allocator reserved) and the allocator's own figures."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"device_used": total - free, "device_total": total,
            "memory_reserved": torch.cuda.memory_reserved(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device),
            "max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "device_name": torch.cuda.get_device_name(device),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def cap_allocator(device: torch.device, cap_bytes: int) -> int:
    """Hold this process's allocator to ``cap_bytes`` of device use, the measured CUDA context
    included (as on a card of that size); returns that context's bytes."""
    from visppo.probe import cap_fraction, cuda_context_bytes

    context, _ = cuda_context_bytes(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_fraction(cap_bytes, context, total), device)
    return context


def capped_rows(results: list[dict], slack: float = CAP_SLACK) -> list[dict]:
    """The capped pass of a measured grid: each row again, its allocator capped at the estimate
    (which counts the context) plus ``slack``. The estimate goes with it: the same config and size
    give the same one, so the capped child does not compute it again (a GPU session's minutes)."""
    keys = ("encoder", "image", "amp", "kind", "size", "real_mode", "estimated_bytes", "breakdown")
    return [{**{k: r[k] for k in keys if k in r}, "cap_bytes": int(r["estimated_bytes"] * (1 + slack))}
            for r in results]


def row_key(row: dict) -> tuple:
    """What makes a row the same row of a grid, capped or not."""
    return row["encoder"], row["image"], row["amp"], row["kind"], row["size"]


RESUME_SAME = ("device", "device_name", "torch", "cuda", "alloc_conf")
"""What an earlier run's JSON must share with this run for ``--resume`` to carry its rows on."""


def resume_problem(earlier: dict, info: dict, planned: list[dict]) -> str | None:
    """Why this run cannot carry on ``earlier`` (a JSON this script wrote), or None when it can:
    another GPU, torch, CUDA or allocator setting measures other bytes, and a row outside this
    run's grid would make a grid no command line made."""
    for key in RESUME_SAME:
        if earlier.get(key) != info[key]:
            return (f"was made with {key} {earlier.get(key)!r}, this run has {info[key]!r}: resume it where it "
                    f"was made (the device tool's kind), or leave --resume out")
    stray = sorted({row_key(r) for r in earlier["rows"]} - {row_key(r) for r in planned})
    if stray:
        return (f"has rows this run's grid lacks ({' '.join(map(str, stray[0]))} and {len(stray) - 1} more): give "
                f"the --quick and --amp it was made with")
    return None


def still_to_run(planned: list[dict], earlier_rows: list[dict], cap: bool) -> tuple[list[dict], list[dict]]:
    """What a resumed run measures: the planned rows the earlier run has not measured, and (with
    ``cap``) the earlier run's measured rows that lack their capped run. A row that failed stays
    failed: it is a result, and running rows again until they pass is not measuring them."""
    measured = {row_key(r): r for r in earlier_rows if "cap_bytes" not in r}
    capped = {row_key(r) for r in earlier_rows if "cap_bytes" in r}
    todo = [r for r in planned if row_key(r) not in measured]
    to_cap = [measured[row_key(r)] for r in planned if cap and row_key(r) in measured
              and row_key(r) not in capped and not measured[row_key(r)].get("failed")]
    return todo, to_cap


def limits_summary(results: list[dict]) -> str:
    """How many rows fail :func:`within_limits`, as the summary line says it."""
    outside = sum(1 for r in results if within_limits(r))
    return f"{outside} of {len(results)} rows outside {100 * LIMITS[0]:+.0f}%..{100 * LIMITS[1]:+.0f}%, out of memory or failed"


def within_limits(row: dict, limits: tuple[float, float] = LIMITS) -> list[str]:
    """What keeps a measured row from passing (empty: it passes)."""
    if row.get("failed"):
        return [f"failed: {row['failed']}"]
    problems = [f"ran out of memory under its cap: {m}" for m in row.get("oom", [])]
    if row.get("error") is not None and not limits[0] <= row["error"] <= limits[1]:
        problems.append(f"error {100 * row['error']:+.1f}% outside {100 * limits[0]:+.0f}%..{100 * limits[1]:+.0f}%")
    return problems


def grid_problems(data: dict) -> list[str]:
    """What keeps a CUDA run's JSON from meeting issue 58's bar (empty: it meets it): it says what
    made it; every row passes :func:`within_limits`, uncapped and capped, and each has its capped
    run; every precision of :data:`AMPS` is in the grid; every headline precision ran and passed."""
    problems = [f"no {key}" for key in ("date", "device_name", "torch", "cuda") if key not in data]
    problems += [format_row(r) for r in data["rows"] if within_limits(r)]
    capped = {row_key(r) for r in data["rows"] if "cap_bytes" in r}
    problems += [f"{' '.join(map(str, k))}: without its capped run" for k in
                 sorted({row_key(r) for r in data["rows"] if "cap_bytes" not in r} - capped)]
    problems += [f"no {amp} row" for amp in AMPS if amp not in {r["amp"] for r in data["rows"]}]
    headlines = {h["amp"]: h for h in data.get("headline", [])}
    problems += [f"headline {amp}: " + ("did not run" if amp not in headlines else format_headline(headlines[amp]))
                 for amp in HEADLINE_AMPS if not headlines.get(amp, {}).get("passed")]
    return problems


def _cuda_phases(device: torch.device, cap_bytes: int | None = None, capped_phase: str = "build",
                 marks: list[str] | None = None):
    """Before the score pass, hand the update's cached segments back and reset the peaks, so an
    ``infer_chunk`` row measures the chunked pass alone (as the CPU oracle's window does): the
    update before it runs the unsplit minibatch, whose peak is not the chunk's. With ``cap_bytes``,
    the allocator is capped from ``capped_phase`` on (the measured part only: an infer row's
    unsplit update is not what its estimate covers)."""
    from contextlib import contextmanager

    @contextmanager
    def phase(name):
        if marks is not None:  # a traced run: a "snapshot" entry marks where the phase starts
            marks.append(name)
            torch.cuda.memory._snapshot(device)
        if name == "score":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if cap_bytes is not None and name == capped_phase:
            cap_allocator(device, cap_bytes)
        yield
    return phase


def measure_cuda(cfg, kind: str, size: int, cap_bytes: int | None = None, trace: str | None = None) -> dict:
    """The row's workload on the GPU, in a process that has not touched CUDA before. The measured
    figure is the device's whole use at the allocator's peak: what ``mem_get_info`` shows at the end
    (context included), less what the allocator holds then, plus its peak reservation. Run on a
    GPU no other process uses (``device_used`` counts every process). With ``cap_bytes``, the
    allocator is capped (see ``--cap``) and ``oom`` lists every out-of-memory the run met, whether
    training backed off from it (a warning) or not (the error). With ``trace`` (a ``.json.gz``
    path), every allocator action of the run is written there (:func:`write_trace`)."""
    import warnings

    marks = [] if trace else None  # the phases in order: phase i starts at the trace's i-th "snapshot" entry
    if trace:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python")
    device = torch.device("cuda", torch.cuda.current_device())
    capped_phase = "score" if kind == "infer_chunk" else "build"
    work = _workload(cfg, device, kind, size, _cuda_phases(device, cap_bytes, capped_phase, marks))
    next(work)  # the host buffer (CUDA is initialised by the workload, or by the recording when traced)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            next(work)
            failed = []
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
            if cap_bytes is None or not is_cap_oom(exc):
                raise
            failed = [str(exc).splitlines()[0]]
    m = device_use(device)
    m["measured_bytes"] = m["device_used"] - m["memory_reserved"] + m["max_memory_reserved"]
    if trace:
        m["trace"], m["trace_entries"] = Path(trace).name, write_trace(torch.cuda.memory._snapshot(device), marks, trace)
        torch.cuda.memory._record_memory_history(None)
    if cap_bytes is not None:
        m["cap_bytes"] = cap_bytes
        m["oom"] = [str(w.message) for w in caught if "out of memory" in str(w.message)] + failed
    return m


def compact_trace(snapshot: dict, phases: list[str]) -> dict:
    """What a model of the caching allocator needs from ``torch.cuda.memory._snapshot()``: every
    action in order as ``[action, address, bytes, stream]`` (no stack frames), the phase each
    "snapshot" entry opens, and the segments held at the end as ``[address, total, allocated,
    small or large]``."""
    events = [[e["action"], e.get("addr", 0), e.get("size", 0), e.get("stream", 0)]
              for trace in snapshot["device_traces"] for e in trace]
    segments = [[s["address"], s["total_size"], s["allocated_size"], s["segment_type"]] for s in snapshot["segments"]]
    return {"format": "[action, address, bytes, stream]", "phases": list(phases), "events": events,
            "segments": segments}


def trace_name(row: dict) -> str:
    return f"{row['encoder']}_{row['image']}_{row['amp']}_{row['kind']}_{row['size']}.json.gz"


def write_trace(snapshot: dict, phases: list[str], path: str) -> int:
    """:func:`compact_trace` of ``snapshot`` as gzipped JSON at ``path``, atomically; its number of events."""
    import gzip

    from visppo.atomic import atomic_write_bytes

    compact = compact_trace(snapshot, phases)
    atomic_write_bytes(Path(path), gzip.compress(json.dumps(compact, separators=(",", ":")).encode(), mtime=0))
    return len(compact["events"])


def is_cap_oom(exc: BaseException) -> bool:
    """Whether an error under a cap is the cap's doing: out of memory as training counts it, or
    cuDNN/cuBLAS failing to allocate (a plain ``RuntimeError``), which a card of that size meets too."""
    from visppo.memory import is_oom

    return is_oom(exc) or (isinstance(exc, RuntimeError) and any(m in str(exc) for m in ALLOC_FAILURES))


# --------------------------------------------------------------------------- the headline (CUDA)

HEADLINE_BUDGET = 8 * 2**30
HEADLINE_AMPS = ("off", "bf16", "fp16")


def headline(amp: str) -> dict:
    """Under an 8 GiB card emulated on a bigger GPU, the probe's sizes for ResNet-18 @224 x 3
    frames, minibatch 256 run a full update (two minibatches, two epochs, then the chunked
    no-grad pass) without running out of memory, and the micro-batched minibatch gradient
    equals the unsplit one (computed afterwards with the cap lifted)."""
    import warnings

    from visppo.config import load_config
    from visppo.probe import probe

    device = torch.device("cuda", torch.cuda.current_device())  # set_per_process_memory_fraction needs an index
    cfg = load_config(None, overrides("resnet18", 224, amp, 256, 512, "cuda", epochs=2))
    rec = probe(cfg, HEADLINE_BUDGET, "cuda", mode="fake")
    context = cap_allocator(device, HEADLINE_BUDGET)  # a real 8 GiB card holds the context too
    torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sizes, policy, buf, precision = _headline_update(cfg, device, rec.micro_batch_size, rec.infer_chunk_size)
    use = device_use(device)
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    oom = [str(w.message) for w in caught if "out of memory" in str(w.message)]
    rel = split_vs_unsplit(cfg, policy, buf, precision, device, rec.micro_batch_size)
    return {"amp": amp, "budget_bytes": HEADLINE_BUDGET, "cuda_context": context,
            "micro_batch_size": rec.micro_batch_size, "infer_chunk_size": rec.infer_chunk_size,
            "estimated_bytes": rec.peak_bytes, "sizes_after": [sizes.micro, sizes.chunk], "oom_warnings": oom,
            "gradient_relative_difference": rel, **use,
            "passed": not oom and [sizes.micro, sizes.chunk] == [rec.micro_batch_size, rec.infer_chunk_size]
            and rel < 1e-2}


def _headline_update(cfg, device: torch.device, micro: int, chunk: int):
    """A full update and chunked no-grad pass at the given sizes; returns what it used."""
    from visppo.builders import build_optimizer, build_policy
    from visppo.ppo import MemorySizes, UpdateSetup, infer, update
    from visppo.precision import resolve_precision

    buf, obs_space, action_space = make_buffer(cfg, device)
    policy = build_policy(cfg, obs_space, action_space, device, load_weights=False)
    optimizer = build_optimizer(cfg, policy)
    precision = resolve_precision(cfg.train.amp, device)
    sizes = MemorySizes(micro, chunk)
    update(policy, optimizer, buf, UpdateSetup(cfg.ppo, sizes, device, precision, torch.Generator().manual_seed(1)))
    infer(policy, buf.flat_obs(), buf.flat(buf.actions), sizes, device, precision)
    return sizes, policy, buf, precision


def split_vs_unsplit(cfg, policy, buf, precision, device: torch.device, micro: int) -> float:
    """``|g_split - g_whole| / |g_whole|`` over every trainable parameter, for the first minibatch
    (fp16: both scaled by the same GradScaler scale, which divides out of the ratio). A scale
    whose scaled gradient overflows is one the scaler would skip the step for and halve, so the
    comparison halves it too until both gradients are finite."""
    from visppo.ppo import MemorySizes, UpdateSetup, minibatch_gradient

    mb = torch.arange(cfg.ppo.minibatch_size)
    adv = buf.flat(buf.advantages)[mb]
    for _ in range(24):
        grads = []
        for size in (micro, cfg.ppo.minibatch_size):
            policy.zero_grad(set_to_none=True)
            minibatch_gradient(policy, buf, mb, adv, UpdateSetup(cfg.ppo, MemorySizes(size, size), device, precision))
            grads.append(torch.cat([p.grad.float().flatten() for p in policy.parameters() if p.grad is not None]))
        policy.zero_grad(set_to_none=True)
        if precision.scaler is None or all(bool(g.isfinite().all()) for g in grads):
            break
        precision.scaler.update(new_scale=precision.scaler.get_scale() / 2)
    return float((grads[0].double() - grads[1].double()).norm() / grads[1].double().norm())


# --------------------------------------------------------------------------- the estimate


def estimate(cfg, kind: str, size: int, target: str, mode: str) -> dict:
    from visppo.probe import Prober

    prober = Prober(cfg, torch.device(target), mode)
    cand = prober.measure(kind, size, 2**62)
    return {"estimated_bytes": cand.peak_bytes, "breakdown": cand.breakdown}


def run_row(row: dict, device: str) -> dict:
    from visppo.config import load_config

    minibatch, rollout = sizes_of(row)
    cfg = load_config(None, overrides(row["encoder"], row["image"], row["amp"], minibatch, rollout, device))
    out = {"config": f"{row['encoder']} {row['image']}x{row['image']}x9 amp={row['amp']}", **row,
           "minibatch": minibatch, "rollout": rollout}
    if device == "cuda":  # first, in a process that has not touched CUDA: the estimate measures the context
        out.update(measure_cuda(cfg, row["kind"], row["size"], row.get("cap_bytes"), row.get("trace")))
    if "estimated_bytes" not in row:  # a capped row carries its uncapped row's
        out.update(estimate(cfg, row["kind"], row["size"], device, "fake"))
    if device == "cpu":
        if row.get("real_mode", True):  # the probe's real mode too (same meters on real tensors)
            out["estimated_real_mode_bytes"] = estimate(cfg, row["kind"], row["size"], "cpu", "real")["estimated_bytes"]
        out["measured_bytes"] = measure_cpu(cfg, row["kind"], row["size"])
        out["meter"] = "torch.profiler profile_memory (CPU allocator events)"
    else:
        out["meter"] = ("device use at the allocator's peak: mem_get_info used - memory_reserved + "
                        "max_memory_reserved (context included); allocator peaks alongside")
    out["error"] = (out["estimated_bytes"] - out["measured_bytes"]) / out["measured_bytes"]
    return out


class ChildFailed(RuntimeError):
    """A child process exited non-zero (or printed no result); ``last`` is its stderr's last lines."""

    def __init__(self, what: str, stderr: str):
        self.last = " | ".join(line.strip() for line in stderr.strip().splitlines()[-FAILED_LINES:]) or "(no stderr)"
        super().__init__(f"{what} failed:\n{stderr[-3000:]}")


def child(device: str, flag: str, value: str, threads: int) -> dict:
    """This script with ``flag value`` in a fresh process (no allocator cache, autocast cache or
    profiler state carries over); its last stdout line, as JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device, flag, value]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ChildFailed(f"{flag} {value}", proc.stderr or f"exit code {proc.returncode}, no output")
    return json.loads(lines[-1])


def child_or_failed(device: str, flag: str, value: str, threads: int, record: dict) -> dict:
    """:func:`child`, or ``record`` with ``failed`` (the stderr's last lines) when it failed: one
    row's crash (cuDNN near a cap, say) must not lose the rows after it."""
    try:
        return child(device, flag, value, threads)
    except ChildFailed as exc:
        return {**record, "failed": exc.last}


def run_grid(rows: list[dict], device: str, threads: int = 0, cap: bool = False, to_cap: list[dict] = ()):
    """Each row in a fresh child process (this script with ``--one``); with ``cap``, its capped
    run right after it, so a run cut short keeps whole pairs (a failed row has no estimate to
    cap at, and no capped run). First, the capped runs of ``to_cap``'s rows, measured before (a
    resumed run's)."""
    for capped in capped_rows(list(to_cap)):
        yield child_or_failed(device, "--one", json.dumps(capped), threads, capped)
    for row in rows:
        measured = child_or_failed(device, "--one", json.dumps(row), threads, row)
        yield measured
        if cap and not measured.get("failed"):
            [capped] = capped_rows([measured])
            yield child_or_failed(device, "--one", json.dumps(capped), threads, capped)


def run_headlines(amps, threads: int = 0):
    """The 8 GiB headline per precision, each in a fresh child; a failed one is recorded, not raised."""
    for amp in amps:
        yield child_or_failed("cuda", "--headline-one", amp, threads, {"amp": amp, "passed": False})


def format_row(r: dict) -> str:
    mib = 2**20
    if r.get("failed"):
        capped = f" capped at {r['cap_bytes'] / mib:.1f}" if "cap_bytes" in r else ""
        return (f"{r['encoder']:>18s} {r['image']:4d} {r['amp']:>4s} {r['kind']:>11s} {r['size']:5d}"
                f"{capped}  FAIL: {'; '.join(within_limits(r))}")
    real = (f" {r['estimated_real_mode_bytes'] / mib:9.1f}" if "estimated_real_mode_bytes" in r else "")
    capped = f"  capped at {r['cap_bytes'] / mib:.1f}" if "cap_bytes" in r else ""
    verdict = "; ".join(within_limits(r))
    return (f"{r['encoder']:>18s} {r['image']:4d} {r['amp']:>4s} {r['kind']:>11s} {r['size']:5d} "
            f"{r['estimated_bytes'] / mib:9.1f}{real} {r['measured_bytes'] / mib:9.1f} {100 * r['error']:+7.2f}%"
            f"{capped}{'  FAIL: ' + verdict if verdict else ''}")


def format_headline(h: dict) -> str:
    gib = 2**30
    if h.get("failed"):
        return f"headline {h['amp']}: FAIL: failed: {h['failed']}"
    return (f"headline {h['amp']}: ResNet-18 @224 x3, minibatch 256, {h['budget_bytes'] / gib:.0f} GiB: "
            f"micro {h['micro_batch_size']} chunk {h['infer_chunk_size']}, estimated "
            f"{h['estimated_bytes'] / gib:.2f} GiB, device use {h['device_used'] / gib:.2f} GiB "
            f"(reserved peak {h['max_memory_reserved'] / gib:.2f}), OOM warnings {len(h['oom_warnings'])}, "
            f"gradient rel. diff {h['gradient_relative_difference']:.1e}: {'PASS' if h['passed'] else 'FAIL'}")


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def _exit_codes() -> str:
    """The usage's exit-code lines as one line (``--help`` ends with it)."""
    usage = __doc__.split("\n\n")[1]
    return " ".join(usage[usage.index("exit code 0"):].split())


def _parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], epilog=_exit_codes())
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="the small grid of the default test run")
    parser.add_argument("--amp", default=",".join(AMPS), help="comma list of off,bf16 (and fp16 on cuda)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-headline", action="store_true", help="cuda: skip the 8 GiB headline check")
    parser.add_argument("--cap", action="store_true",
                        help=f"cuda: run every row again with the allocator capped at its estimate + {100 * CAP_SLACK:.0f}%%")
    parser.add_argument("--traces", type=Path, metavar="DIR",
                        help="cuda: write every uncapped row's allocator actions to DIR/<row>.json.gz (made if missing)")
    parser.add_argument("--resume", type=Path, metavar="FILE",
                        help="cuda: carry on FILE, an earlier run's --json cut short, running only what it lacks")
    parser.add_argument("--fake-only", action="store_true", help="cpu: skip the real-mode estimate (faster)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--headline-one", help=argparse.SUPPRESS)
    return parser


def run_info(device: str, argv: list[str] | None) -> dict:
    """What made the JSON, so a file read later says it: when (UTC), on what, under which
    allocator setting, with which command line."""
    from visppo.bench import cpu_name

    on_cuda = device == "cuda" and torch.cuda.is_available()
    return {"device": device, "torch": torch.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device_name": torch.cuda.get_device_name() if on_cuda else cpu_name(),
            "cuda": torch.version.cuda, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "argv": list(sys.argv) if argv is None else [sys.argv[0], *argv]}


def _save(path: Path | None, info: dict, rows: list[dict], headlines: list[dict]) -> None:
    """After every row, whole or not at all: a long grid cut short leaves what it measured."""
    from visppo.atomic import atomic_write_text

    if path:
        atomic_write_text(path, json.dumps({**info, "rows": rows, "headline": headlines}, indent=1))


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (None: nothing)."""
    allowed = (*AMPS, "fp16") if args.device == "cuda" else AMPS
    wrong = [a for a in args.amp.split(",") if a not in allowed]
    if wrong:
        return f"--amp {args.amp}: {', '.join(wrong)} is not one of {', '.join(allowed)} on {args.device}"
    if args.cap and args.device != "cuda":
        return "--cap caps the CUDA allocator: give --device cuda with it, or leave --cap out"
    if args.traces is not None and args.device != "cuda":
        return "--traces records the CUDA allocator: give --device cuda with it, or leave --traces out"
    if args.traces is not None and args.traces.exists() and not args.traces.is_dir():
        return f"--traces {args.traces} is a file: give a folder"
    if args.threads < 0:
        return f"--threads must be at least 0, got {args.threads}"
    if args.resume is not None:
        if args.device != "cuda":
            return "--resume carries on a CUDA run: give --device cuda with it, or leave --resume out"
        try:
            earlier = json.loads(args.resume.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return f"--resume {args.resume}: not a JSON file this script wrote ({exc})"
        if not isinstance(earlier, dict) or not isinstance(earlier.get("rows"), list) \
                or not isinstance(earlier.get("headline"), list):
            return f"--resume {args.resume}: not a JSON file this script wrote (no rows and headline lists)"
    if args.json is not None and not args.json.parent.is_dir():
        return f"--json {args.json}: folder {args.json.parent} does not exist"
    if args.json is not None and args.json.is_dir():
        return f"--json {args.json} is a folder: give a file name, e.g. {args.json / 'probe_validation.json'}"
    if args.one is not None:
        try:
            row = json.loads(args.one)
        except json.JSONDecodeError as exc:
            return f"--one is not JSON ({exc})"
        if not isinstance(row, dict) or not {"encoder", "image", "amp", "kind", "size"} <= row.keys():
            return "--one takes a row: {\"encoder\", \"image\", \"amp\", \"kind\", \"size\"}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here, nothing measured: run it on a GPU machine, or give "
              "--device cpu", file=sys.stderr)
        return 2
    if args.one or args.headline_one:
        print(json.dumps(run_row(json.loads(args.one), args.device) if args.one else headline(args.headline_one)))
        return 0
    grid = QUICK_GRID if args.quick else CUDA_GRID if args.device == "cuda" else FULL_GRID
    info = run_info(args.device, argv)
    planned = [{**row, "real_mode": not args.fake_only} for row in plan(grid, args.amp.split(","))]
    earlier = json.loads(args.resume.read_text()) if args.resume else {"rows": [], "headline": []}
    if args.resume:
        problem = resume_problem(earlier, info, planned)
        if problem:
            print(f"error: --resume {args.resume}: {problem}", file=sys.stderr)
            return 2
        info["resumed_from"] = [*earlier.get("resumed_from", []),
                                {k: earlier[k] for k in ("date", "argv") if k in earlier}]
    results, headlines = list(earlier["rows"]), list(earlier["headline"])
    for h in headlines:
        print(format_headline(h), "(carried)", flush=True)
    if args.device == "cuda" and not args.no_headline:  # first: a run cut short keeps it
        done = {h["amp"] for h in headlines}
        for h in run_headlines([amp for amp in HEADLINE_AMPS if amp not in done], args.threads):
            headlines.append(h)
            print(format_headline(h), flush=True)
            _save(args.json, info, results, headlines)
    print(f"{'encoder':>18s} {'img':>4s} {'amp':>4s} {'kind':>11s} {'size':>5s} {'est MiB':>9s}"
          f"{' real MiB' if args.device == 'cpu' else ''} {'meas MiB':>9s} {'error':>8s}", flush=True)
    if args.cap:
        print(f"each row, then capped: the allocator held to its estimate + {100 * CAP_SLACK:.0f}%", flush=True)
    for r in results:
        print(format_row(r), "(carried)", flush=True)
    if args.resume:  # even when nothing is left to run, the JSON says so
        _save(args.json, info, results, headlines)
    rows, to_cap = still_to_run(planned, results, args.cap)
    if args.traces is not None:
        args.traces.mkdir(parents=True, exist_ok=True)
        rows = [{**row, "trace": str(args.traces / trace_name(row))} for row in rows]
    for r in run_grid(rows, args.device, args.threads, cap=args.cap, to_cap=to_cap):
        results.append(r)  # a capped row is the one with cap_bytes
        print(format_row(r), flush=True)
        _save(args.json, info, results, headlines)
    print(summary(results, headlines, args.cap))
    return exit_code(results, headlines)


def summary(results: list[dict], headlines: list[dict], capped: bool) -> str:
    """The run's last line: the worst error of the rows that ran, then how many rows (and headlines) fail."""
    ran = [r for r in results if not r.get("failed")]
    parts = []
    if ran:
        worst = max(ran, key=lambda r: abs(r["error"]))
        parts.append(f"worst error {100 * worst['error']:+.2f}% ({worst['config']} {worst['kind']} {worst['size']}"
                     f"{' capped' if 'cap_bytes' in worst else ''}); most under {100 * min(r['error'] for r in ran):+.2f}%")
    parts.append(f"{'capped and uncapped: ' if capped else ''}{limits_summary(results)}")
    if headlines:
        parts.append(f"{sum(1 for h in headlines if not h['passed'])} of {len(headlines)} headlines failed")
    return "; ".join(parts)


def exit_code(rows: list[dict], headlines: list[dict]) -> int:
    """0 when every row (uncapped and capped) and every headline passed, else 1."""
    failed = any(within_limits(r) for r in rows) or not all(h["passed"] for h in headlines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

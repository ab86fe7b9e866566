"""Check the memory probe's estimates against a measurement that shares no code with it.

    python tools/validate_probe.py --device cpu --json probe_cpu.json     # oracle: torch.profiler
    python tools/validate_probe.py --device cuda --json probe_gpu.json    # real GPU: allocator + driver
    python tools/validate_probe.py --device cpu --quick                   # the small grid of the tests

Every row is one config (encoder, image size, AMP) and one size: a micro-batch
(``kind=micro_batch``) or an inference chunk (``kind=infer_chunk``). The
estimate is what ``visppo probe`` reports for that size in fake mode (nothing
allocated; the mode used for a GPU the machine lacks), and in real mode.

The measurement runs what training runs, for real, in a fresh state:

- ``micro_batch``: build the policy and Adam, then ``ppo.update`` over a rollout
  of two minibatches of ``2 x size`` samples each (so every minibatch accumulates two
  micro-batches), two epochs (the first creates Adam's state); the row's figure
  is the peak over all of it.
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
check: under an 8 GiB cap (``set_per_process_memory_fraction``) the sizes the
probe recommends for ResNet-18 @224 x 3 frames, minibatch 256 (bf16, and fp16
with a GradScaler) run a full update without running out of memory, and the
micro-batched gradient equals the unsplit minibatch's.

Each row runs in a child process (``--one``) so that no allocator cache,
autocast cache or profiler state carries from one row to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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
QUICK_GRID = [  # the default test run's share: seconds, not minutes
    ("nature", 64, (16,), (64,)),
    ("mobilenet_v3_small", 48, (8,), ()),
]
CUDA_GRID = [
    ("nature", 84, (64, 256), (1024,)),
    ("resnet18", 128, (64, 128), (256,)),
    ("resnet18", 224, (32, 64), (128,)),
    ("mobilenet_v3_small", 224, (64, 128), (256,)),
]
AMPS = ("off", "bf16")


def overrides(encoder: str, image: int, amp: str, minibatch: int, rollout: int, device: str) -> list[str]:
    return [f"model.encoder={encoder}", f"env.image_size={image}", "env.frame_stack=3", "env.id=visppo/DotReach-v0",
            f"train.amp={amp}", f"train.device={device}", "model.encoder_weights=none",
            f"ppo.minibatch_size={minibatch}", "ppo.num_envs=1", f"ppo.num_steps={rollout}", "ppo.num_epochs=2",
            "ppo.target_kl=0", "ppo.recompute_advantages=false", "ppo.recompute_logp_old=false"]


def plan(grid, amps) -> list[dict]:
    rows = []
    for encoder, image, micros, chunks in grid:
        for amp in amps:
            for size in micros:
                rows.append(dict(encoder=encoder, image=image, amp=amp, kind="micro_batch", size=size))
            for size in chunks:
                rows.append(dict(encoder=encoder, image=image, amp=amp, kind="infer_chunk", size=size))
    return rows


def sizes_of(row: dict) -> tuple[int, int]:
    """(minibatch, rollout) of a row: two micro-batches per minibatch, two minibatches per rollout;
    a chunk row scores a rollout of four chunks."""
    if row["kind"] == "micro_batch":
        return 2 * row["size"], 4 * row["size"]
    return 2 * row["size"], 4 * row["size"]


# --------------------------------------------------------------------------- the workload (real training code)


def _workload(cfg, device: torch.device, kind: str, size: int, phase):
    """Build what training builds and run it; ``phase(name)`` is a context manager around each part."""
    from visppo.buffer import RolloutBuffer
    from visppo.builders import build_optimizer, build_policy
    from visppo.envs import make_env
    from visppo.ppo import MemorySizes, UpdateSetup, infer, update
    from visppo.precision import resolve_precision

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
    flat = {k: buf.flat(v) for k, v in buf.obs.items()}
    actions = buf.flat(buf.actions)
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
            infer(policy, flat, actions, MemorySizes(micro, size), device, precision)
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


def measure_cuda(cfg, kind: str, size: int) -> dict:
    from contextlib import nullcontext

    device = torch.device("cuda")
    work = _workload(cfg, device, kind, size, lambda name: nullcontext())
    free0, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    next(work)
    torch.cuda.synchronize(device)
    free1, _ = torch.cuda.mem_get_info(device)
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device),
            "device_used_delta": free0 - free1, "device_total": total,
            "device_name": torch.cuda.get_device_name(device)}


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
    est = estimate(cfg, row["kind"], row["size"], device, "fake")
    out.update(est)
    if device == "cpu":
        out["estimated_real_mode_bytes"] = estimate(cfg, row["kind"], row["size"], "cpu", "real")["estimated_bytes"]
        out["measured_bytes"] = measure_cpu(cfg, row["kind"], row["size"])
        out["meter"] = "torch.profiler profile_memory (CPU allocator events)"
    else:
        m = measure_cuda(cfg, row["kind"], row["size"])
        out.update(m)
        out["measured_bytes"] = m["device_used_delta"]
        out["meter"] = "torch.cuda.mem_get_info delta (context included); allocator peaks alongside"
    out["error"] = (out["estimated_bytes"] - out["measured_bytes"]) / out["measured_bytes"]
    return out


def run_grid(rows: list[dict], device: str, threads: int = 0) -> list[dict]:
    """Each row in a fresh child process (this script with ``--one``)."""
    results = []
    env = {**os.environ}
    for row in rows:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device, "--one", json.dumps(row)]
        if threads:
            cmd += ["--threads", str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"row {row} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        yield results[-1]


def format_row(r: dict) -> str:
    mib = 2**20
    real = (f" {r['estimated_real_mode_bytes'] / mib:9.1f}" if "estimated_real_mode_bytes" in r else "")
    return (f"{r['encoder']:>18s} {r['image']:4d} {r['amp']:>4s} {r['kind']:>11s} {r['size']:5d} "
            f"{r['estimated_bytes'] / mib:9.1f}{real} {r['measured_bytes'] / mib:9.1f} {100 * r['error']:+7.2f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="the small grid of the default test run")
    parser.add_argument("--amp", default=",".join(AMPS), help="comma list of off,bf16")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("validate_probe: no CUDA device here; nothing measured (run it on a GPU machine)", file=sys.stderr)
        return 0
    if args.one:
        print(json.dumps(run_row(json.loads(args.one), args.device)))
        return 0
    grid = QUICK_GRID if args.quick else CUDA_GRID if args.device == "cuda" else FULL_GRID
    rows = plan(grid, args.amp.split(","))
    print(f"{'encoder':>18s} {'img':>4s} {'amp':>4s} {'kind':>11s} {'size':>5s} {'est MiB':>9s}"
          f"{' real MiB' if args.device == 'cpu' else ''} {'meas MiB':>9s} {'error':>8s}", flush=True)
    results = []
    for r in run_grid(rows, args.device, args.threads):
        results.append(r)
        print(format_row(r), flush=True)
        if args.json:  # after every row: a long grid leaves what it measured
            args.json.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "rows": results},
                                            indent=1))
    worst = max(results, key=lambda r: abs(r["error"]))
    print(f"worst error {100 * worst['error']:+.2f}% ({worst['config']} {worst['kind']} {worst['size']}); "
          f"most under {100 * min(r['error'] for r in results):+.2f}%")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "rows": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

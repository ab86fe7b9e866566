"""Training steps/s with 1 and 2 processes under ``torchrun`` (gloo on a CPU, NCCL on GPUs).

    python tools/bench_ddp.py                                        # configs/dot_reach.yaml
    python tools/bench_ddp.py configs/dot_reach.yaml --iterations 8 --repeats 2
    python tools/bench_ddp.py env.id=visppo/Reach-v0 --split         # same global sizes for every count

For each process count P (``--nproc``, default 1,2) it runs
``torchrun --standalone --nproc_per_node=P -m visppo train CONFIG ...`` for ``--iterations``
iterations and reads rank 0's ``metrics.csv``: the median over iterations (the first, warm-up,
left out) of steps/s (env steps of all processes per second of wall time) and of the time per
phase. Runs of the different counts alternate (1, 2, 1, 2, ...) so that a background load
drifting over time weighs on all of them alike.

By default every process runs the config as given (the global rollout and minibatch grow with
P: the way ``torchrun`` scales a config). ``--split`` divides ``ppo.num_envs`` and
``ppo.minibatch_size`` by P instead, so every count trains with the same global sizes.
Each process gets ``cores / P`` intra-op threads (``train.threads``), unless the arguments set it.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from visppo.config import load_config

DEFAULT_CONFIG = "configs/dot_reach.yaml"


def run_once(args: list[str], nproc: int, iterations: int, split: bool, workdir: Path) -> list[dict]:
    """One ``torchrun`` of the config with ``nproc`` processes; rank 0's metrics rows."""
    path = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if path else list(args)
    cfg = load_config(path, overrides)
    num_envs, minibatch = cfg.ppo.num_envs, cfg.ppo.minibatch_size
    if split:
        if num_envs % nproc or minibatch % nproc:
            sys.exit(f"error: --split needs ppo.num_envs ({num_envs}) and ppo.minibatch_size ({minibatch}) "
                     f"divisible by {nproc}")
        num_envs, minibatch = num_envs // nproc, minibatch // nproc
    run_dir = workdir / f"p{nproc}-{time.monotonic_ns()}"
    extra = [f"ppo.num_envs={num_envs}", f"ppo.minibatch_size={minibatch}",
             f"ppo.total_steps={iterations * nproc * num_envs * cfg.ppo.num_steps}",
             f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false",
             "run.checkpoint_every=1000000", "run.eval_every=0"]
    if not any(a.startswith("train.threads=") for a in overrides):
        extra.append(f"train.threads={max(1, (os.cpu_count() or 1) // nproc)}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "visppo", "train", *([path] if path else []), *overrides, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: {nproc} process(es) failed:\n{res.stderr[-3000:]}")
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]",
                        help=f"a YAML config and/or overrides (default: {DEFAULT_CONFIG})")
    parser.add_argument("--nproc", default="1,2", help="comma-separated process counts (1,2)")
    parser.add_argument("--iterations", type=int, default=6, help="training iterations per run (6)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per process count (1)")
    parser.add_argument("--split", action="store_true",
                        help="divide ppo.num_envs and ppo.minibatch_size by the process count")
    ns = parser.parse_args()
    args = ns.args if ns.args and "=" not in ns.args[0] else [DEFAULT_CONFIG, *ns.args]
    counts = [int(c) for c in ns.nproc.split(",")]
    rows: dict[int, list[dict]] = {c: [] for c in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(ns.repeats):
            for c in counts:
                rows[c] += run_once(args, c, ns.iterations, ns.split, Path(tmp))[1:]  # first: warm-up
    print(f"{' '.join(args)}  ({os.cpu_count()} cores, {ns.iterations} iterations x {ns.repeats} run(s) per "
          f"count, {'same global sizes' if ns.split else 'the config per process'}; medians, warm-up left out)")
    print(f"{'processes':>9} {'global rollout':>14} {'steps/s':>8} {'speed-up':>8} {'collect s':>9} "
          f"{'values s':>8} {'update s':>8}")
    base = None
    for c in counts:
        sps = statistics.median(float(r["steps_per_second"]) for r in rows[c])
        base = base or sps
        phase = {k: statistics.median(float(r[f"time/{k}"]) for r in rows[c]) for k in ("collect", "values", "update")}
        rollout = int(rows[c][0]["global_step"]) // int(rows[c][0]["iteration"])
        print(f"{c:>9} {rollout:>14} {sps:>8.0f} {sps / base:>7.2f}x {phase['collect']:>9.2f} "
              f"{phase['values']:>8.2f} {phase['update']:>8.2f}")


if __name__ == "__main__":
    main()

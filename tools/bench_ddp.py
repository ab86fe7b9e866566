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
from visppo.errors import UserError

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "dot_reach.yaml")


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the config file (None: the defaults) and the overrides."""
    path = args[0] if args and "=" not in args[0] else None
    return path, list(args[1:] if path else args)


def sizes(cfg, nproc: int, split: bool) -> tuple[int, int]:
    """(ppo.num_envs, ppo.minibatch_size) per process: the config's, or with ``split`` divided by
    ``nproc`` (a UserError when they do not divide)."""
    num_envs, minibatch = cfg.ppo.num_envs, cfg.ppo.minibatch_size
    if not split:
        return num_envs, minibatch
    if num_envs % nproc or minibatch % nproc:
        raise UserError(f"--split needs ppo.num_envs ({num_envs}) and ppo.minibatch_size ({minibatch}) "
                        f"divisible by {nproc}")
    return num_envs // nproc, minibatch // nproc


def run_overrides(args: list[str], nproc: int, iterations: int, split: bool, run_dir: Path) -> list[str]:
    """The overrides every process of one run gets after the user's: its sizes, ``iterations``
    iterations, a row per iteration (the warm-up row is left out) and nothing else written."""
    path, overrides = split_args(args)
    cfg = load_config(path, overrides)
    num_envs, minibatch = sizes(cfg, nproc, split)
    extra = [f"ppo.num_envs={num_envs}", f"ppo.minibatch_size={minibatch}",
             f"ppo.total_steps={iterations * nproc * num_envs * cfg.ppo.num_steps}",
             f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false", "run.log_every=1",
             "run.checkpoint_every=1000000", "run.eval_every=0"]
    if not any(a.startswith("train.threads=") for a in overrides):
        extra.append(f"train.threads={max(1, (os.cpu_count() or 1) // nproc)}")
    return extra


def torchrun_command(args: list[str], nproc: int, iterations: int, split: bool, run_dir: Path) -> list[str]:
    """The ``torchrun`` command of one run: ``iterations`` iterations with ``nproc`` processes."""
    path, overrides = split_args(args)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "visppo", "train", *([path] if path else []), *overrides,
            *run_overrides(args, nproc, iterations, split, run_dir)]


def run_once(args: list[str], nproc: int, iterations: int, split: bool, workdir: Path) -> list[dict]:
    """One ``torchrun`` of the config with ``nproc`` processes; rank 0's metrics rows (a
    RuntimeError with the end of its stderr when it fails)."""
    run_dir = workdir / f"p{nproc}-{time.monotonic_ns()}"
    res = subprocess.run(torchrun_command(args, nproc, iterations, split, run_dir), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{nproc} process(es) failed:\n{res.stderr[-3000:]}")
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def report(args: list[str], counts: list[int], rows: dict[int, list[dict]], iterations: int, repeats: int,
           split: bool) -> str:
    """The table: per process count, the global rollout, steps/s, speed-up and time per phase."""
    lines = [f"{' '.join(args)}  ({os.cpu_count()} cores, {iterations} iterations x {repeats} run(s) per "
             f"count, {'same global sizes' if split else 'the config per process'}; medians, warm-up left out)",
             f"{'processes':>9} {'global rollout':>14} {'steps/s':>8} {'speed-up':>8} {'collect s':>9} "
             f"{'values s':>8} {'update s':>8}"]
    base = None
    for c in counts:
        sps = statistics.median(float(r["steps_per_second"]) for r in rows[c])
        base = base or sps
        phase = {k: statistics.median(float(r[f"time/{k}"]) for r in rows[c]) for k in ("collect", "values", "update")}
        rollout = int(rows[c][0]["global_step"]) // int(rows[c][0]["iteration"])
        lines.append(f"{c:>9} {rollout:>14} {sps:>8.0f} {sps / base:>7.2f}x {phase['collect']:>9.2f} "
                     f"{phase['values']:>8.2f} {phase['update']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]",
                        help=f"a YAML config and/or overrides (default: {DEFAULT_CONFIG})")
    parser.add_argument("--nproc", default="1,2", help="comma-separated process counts (1,2)")
    parser.add_argument("--iterations", type=int, default=6, help="training iterations per run (6)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per process count (1)")
    parser.add_argument("--split", action="store_true",
                        help="divide ppo.num_envs and ppo.minibatch_size by the process count")
    ns = parser.parse_args(argv)
    args = ns.args if ns.args and "=" not in ns.args[0] else [DEFAULT_CONFIG, *ns.args]
    try:
        try:
            counts = [int(c) for c in ns.nproc.split(",")]
        except ValueError:
            raise UserError(f"--nproc {ns.nproc!r}: give comma-separated process counts, e.g. 1,2") from None
        if min(counts) < 1 or ns.iterations < 2 or ns.repeats < 1:
            raise UserError("--nproc counts and --repeats must be at least 1, --iterations at least 2 "
                            "(the first is warm-up)")
        path, overrides = split_args(args)
        for c in counts:  # each process's config, as torchrun's processes will load it: refused here, not there
            load_config(path, overrides + run_overrides(args, c, ns.iterations, ns.split, Path("run")))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows: dict[int, list[dict]] = {c: [] for c in counts}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for _ in range(ns.repeats):
                for c in counts:
                    rows[c] += run_once(args, c, ns.iterations, ns.split, Path(tmp))[1:]  # first: warm-up
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(report(args, counts, rows, ns.iterations, ns.repeats, ns.split))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where does a config's time go, and how close does training run to the environment's speed?

    python tools/bench.py [CONFIG] [key=value ...] [--repeats 3] [--iterations 5] [--steps 2000]
        [--no-raw] [--json F]

Prints, for one config, measured side by side in one invocation:

- raw env steps/s with random actions through visppo's own env stack (frames,
  stacking, action repeat): one process, and async workers (2 and 4, and the
  config's ``ppo.num_envs``, forkserver) - the ceiling for collection;
- from real ``visppo train`` runs of ``--iterations`` iterations (the first,
  warm-up, left out): collection steps/s (acting and env stepping),
  update samples/s (minibatch samples through forward+backward per second of
  the update phase), end-to-end steps/s, the time per phase (collect / values /
  update / log), and the training process's peak memory (host RSS; on CUDA
  also ``max_memory_allocated``).

Every figure is the median over ``--repeats`` runs (each run's figure being the
median over its iterations). Each measurement runs in its own spawned process,
so GL contexts and peak memory are its own.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from visppo.atomic import atomic_write_text
from visppo.config import Config, load_config
from visppo.envs import check_env_id, make_vector_env
from visppo.errors import UserError


def isolated(fn, *args):
    """``fn(*args)`` in a fresh spawned process (its own GL contexts, its own peak RSS)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def raw_env_rate(cfg: Config, num_envs: int, vector: str, steps: int) -> float:
    """Env steps/s with random actions: no policy, no learning."""
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, vector=vector),
                              ppo=dataclasses.replace(cfg.ppo, num_envs=num_envs))
    envs = make_vector_env(cfg)
    try:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        actions = [envs.action_space.sample() for _ in range(64)]
        for i in range(20):  # warm-up
            envs.step(actions[i % 64])
        n = max(1, steps // num_envs)
        start = time.perf_counter()
        for i in range(n):
            envs.step(actions[i % 64])
        return n * num_envs / (time.perf_counter() - start)
    finally:
        envs.close()


def update_samples(rollout: int, minibatch: int, minibatches_done: int) -> int:
    """Samples one update pushed through forward and backward, given how many minibatches it
    computed: every epoch cuts the rollout into minibatches whose last is the short one, so whole
    epochs count the rollout and the epoch an early stop cut short counts full minibatches."""
    per_epoch = math.ceil(rollout / minibatch)
    epochs, rest = divmod(minibatches_done, per_epoch)
    return epochs * rollout + rest * minibatch


def minibatches_done(row: dict[str, str]) -> int:
    """Minibatches an iteration's update computed: those stepped, those skipped (a non-finite
    gradient) and the one whose approx-KL stopped the update (``loss/stop_kl`` set)."""
    stopped = not math.isnan(float(row["loss/stop_kl"] or "nan"))
    return int(float(row["optimizer_steps"])) + int(float(row["skipped_steps"])) + stopped


def training_figures(cfg: Config, iterations: int) -> dict[str, float]:
    """One short ``visppo train`` run; medians over its iterations after the first."""
    import torch

    from visppo.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        run = dataclasses.replace(cfg.run, dir=str(Path(tmp) / "run"), progress=False, tensorboard=False,
                                  checkpoint_every=10**6, eval_every=0, log_every=1)
        ppo = dataclasses.replace(cfg.ppo, total_steps=iterations * cfg.rollout_size)
        run_dir = train(dataclasses.replace(cfg, run=run, ppo=ppo))
        rows = list(csv.DictReader((run_dir / "metrics.csv").open()))[1:]

    def median(fn) -> float:
        return statistics.median(fn(r) for r in rows)

    mb = min(cfg.ppo.minibatch_size, cfg.rollout_size)
    out = {
        "end_to_end_sps": median(lambda r: float(r["steps_per_second"])),
        "collect_sps": median(lambda r: cfg.rollout_size / float(r["time/collect"])),
        "update_samples_per_s": median(lambda r: update_samples(cfg.rollout_size, mb, minibatches_done(r))
                                       / float(r["time/update"])),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    for key in rows[0]:
        if key.startswith("time/"):
            out[key] = median(lambda r, k=key: float(r[k]))
    if torch.cuda.is_available():
        out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    return out


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    """The options and the config; a UserError (or argparse's exit) on bad input."""
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; medians are printed (3)")
    parser.add_argument("--iterations", type=int, default=5, help="training iterations per run (5)")
    parser.add_argument("--steps", type=int, default=2000, help="env steps per raw measurement (2000)")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw env measurements")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    ns = parser.parse_args(argv)
    if ns.repeats < 1 or ns.steps < 1:
        raise UserError(f"--repeats and --steps must be at least 1, got {ns.repeats} and {ns.steps}")
    if ns.iterations < 2:
        raise UserError(f"--iterations must be at least 2 (the first is warm-up), got {ns.iterations}")
    if ns.json is not None and not ns.json.parent.is_dir():
        raise UserError(f"--json {ns.json}: folder {ns.json.parent} does not exist")
    if ns.json is not None and ns.json.is_dir():
        raise UserError(f"--json {ns.json} is a folder: give a file name")
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    cfg = load_config(path, ns.args[1:] if path else ns.args)
    check_env_id(cfg.env.id)  # an unknown id now, not in the first spawned measurement
    return ns, cfg


def measure(cfg: Config, repeats: int, iterations: int, steps: int, raw_env: bool = True
            ) -> tuple[dict[str, float], dict[str, float]]:
    """(raw env steps/s per setting, training figures): medians over ``repeats`` runs, each in its
    own spawned process."""
    raw: dict[str, float] = {}
    if raw_env:
        settings = [("1 process", 1, "sync")] + [(f"{w} async workers", w, "async")
                                                 for w in sorted({2, 4, cfg.ppo.num_envs})]
        samples: dict[str, list[float]] = {name: [] for name, _, _ in settings}
        for _ in range(repeats):  # interleaved: drift on a shared machine hits every setting alike
            for name, workers, vector in settings:
                samples[name].append(isolated(raw_env_rate, cfg, workers, vector, steps))
        raw = {name: statistics.median(v) for name, v in samples.items()}
    runs = [isolated(training_figures, cfg, iterations) for _ in range(repeats)]
    return raw, {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def report(cfg: Config, repeats: int, raw: dict[str, float], train_figs: dict[str, float]) -> str:
    """The figures as printed: raw env rates, collection, update, end to end, phases, memory."""
    best = max(raw.values()) if raw else float("nan")
    lines = [f"{cfg.env.id} {cfg.env.image_size}x{cfg.env.image_size} frame_stack {cfg.env.frame_stack}, "
             f"encoder {cfg.model.encoder}, {cfg.ppo.num_envs} envs x {cfg.ppo.num_steps} steps, minibatch "
             f"{cfg.ppo.minibatch_size}, {cfg.ppo.num_epochs} epochs (medians of {repeats} runs)"]
    lines += [f"  raw env, {name:28s} {rate:8.0f} steps/s" for name, rate in raw.items()]
    ratio = (lambda v: f"  ({v / best:4.0%} of the fastest raw env)") if raw else (lambda v: "")
    lines.append(f"  collection (act + step)            {train_figs['collect_sps']:8.0f} steps/s"
                 + ratio(train_figs["collect_sps"]))
    lines.append(f"  update (forward + backward)        {train_figs['update_samples_per_s']:8.0f} samples/s")
    lines.append(f"  end to end                         {train_figs['end_to_end_sps']:8.0f} steps/s"
                 + ratio(train_figs["end_to_end_sps"]))
    lines.append("  per iteration: " + ", ".join(f"{k[5:]} {v:.2f} s" for k, v in train_figs.items()
                                                 if k.startswith("time/")) + f" ({cfg.rollout_size} steps)")
    peak = f"  peak memory: host RSS {train_figs['peak_rss_bytes'] / 2**20:.0f} MiB"
    if "peak_cuda_bytes" in train_figs:
        peak += f", CUDA allocated {train_figs['peak_cuda_bytes'] / 2**20:.0f} MiB"
    lines.append(peak)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        ns, cfg = parse(argv)
        # what only making the env finds (env.kwargs it refuses) comes back from the measurement's process
        raw, train_figs = measure(cfg, ns.repeats, ns.iterations, ns.steps, raw_env=not ns.no_raw)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(cfg, ns.repeats, raw, train_figs))
    if ns.json:  # null, not NaN (which strict JSON readers refuse), without the raw env figures
        ratio = train_figs["end_to_end_sps"] / max(raw.values()) if raw else None
        atomic_write_text(ns.json, json.dumps({"raw_env_sps": raw, **train_figs, "ratio_to_raw": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

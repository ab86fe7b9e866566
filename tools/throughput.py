"""How close does training run to the environment's own speed?

    python tools/throughput.py [CONFIG] [key=value ...] [--iterations 6] [--steps 2000]

Prints, for the config's task and observation settings, side by side in one run:
  - raw env steps/s with random actions through visppo's own env stack
    (frames, stacking): one process, and async workers (2 and the config's
    ppo.num_envs, forkserver) - the ceiling for collection;
  - end-to-end training steps/s of ``visppo train`` with the config: the
    median over iterations (the first, warm-up, left out), with the median
    time per phase (collect / score / update).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from visppo.config import load_config
from visppo.envs import make_vector_env
from visppo.train import train


def raw_env_rate_isolated(cfg, num_envs: int, vector: str, steps: int) -> float:
    """:func:`raw_env_rate` in a fresh spawned process: each measurement gets its own
    GL contexts (creating and dropping many EGL contexts in one process crashed here)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(raw_env_rate, cfg, num_envs, vector, steps).result()


def raw_env_rate(cfg, num_envs: int, vector: str, steps: int) -> float:
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


def training_rate(cfg, iterations: int) -> tuple[float, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        run = dataclasses.replace(cfg.run, dir=str(Path(tmp) / "run"), progress=False, tensorboard=False,
                                  checkpoint_every=10**6, eval_every=0)
        ppo = dataclasses.replace(cfg.ppo, total_steps=iterations * cfg.rollout_size)
        run_dir = train(dataclasses.replace(cfg, run=run, ppo=ppo))
        rows = list(csv.DictReader((run_dir / "metrics.csv").open()))[1:]
    phases = {k[5:]: statistics.median(float(r[k]) for r in rows) for k in rows[0] if k.startswith("time/")}
    return statistics.median(float(r["steps_per_second"]) for r in rows), phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    parser.add_argument("--iterations", type=int, default=6, help="training iterations to time (6)")
    parser.add_argument("--steps", type=int, default=2000, help="env steps per raw measurement (2000)")
    ns = parser.parse_args()
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    cfg = load_config(path, ns.args[1:] if path else ns.args)
    rows = [("env, 1 process", raw_env_rate_isolated(cfg, 1, "sync", ns.steps))]
    for workers in sorted({2, cfg.ppo.num_envs}):
        rows.append((f"env, {workers} async workers", raw_env_rate_isolated(cfg, workers, "async", ns.steps)))
    best_raw = max(rate for _, rate in rows)
    sps, phases = training_rate(cfg, ns.iterations)
    rows.append((f"training ({cfg.env.vector} vector, {cfg.ppo.num_envs} envs)", sps))
    print(f"{cfg.env.id} {cfg.env.image_size}x{cfg.env.image_size} frame_stack {cfg.env.frame_stack}")
    for name, rate in rows:
        print(f"  {name:40s} {rate:8.0f} steps/s  ({rate / best_raw:5.0%} of the fastest raw env)")
    print("  training phases per iteration (median): "
          + ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()))
    print(f"  (rollout of {cfg.rollout_size} steps per iteration)")


if __name__ == "__main__":
    main()

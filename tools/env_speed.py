"""Raw env steps/s of visppo's MuJoCo tasks: one process, then async workers.

    python tools/env_speed.py                      # all tasks, 84x84, 1/2/4 workers
    python tools/env_speed.py --tasks Reach --image-size 64 --steps 2000

Random actions, no policy: this is the ceiling the env puts on collection
speed. Each figure is the median of ``--repeats`` timed runs of ``--steps``
env steps (summed over workers), after a short warm-up. Workers are started
with forkserver: forking a process that already holds an EGL context hangs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

import gymnasium as gym

TASKS = ("Reach", "Push", "Balance")


def maker(env_id: str, image_size: int):
    """A function that makes the env (in this process or in an async worker)."""
    def make() -> gym.Env:
        import visppo_envs  # noqa: F401  registers the ids in the worker

        return gym.make(env_id, image_size=image_size)

    return make


def time_single(env_id: str, image_size: int, steps: int, repeats: int) -> float:
    """Steps/s of one env in this process: the median of ``repeats`` runs after a warm-up run."""
    env = maker(env_id, image_size)()
    env.action_space.seed(0)
    env.reset(seed=0)
    rates = []
    for _ in range(repeats + 1):  # the first run is warm-up
        start = time.perf_counter()
        for _ in range(steps):
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
        rates.append(steps / (time.perf_counter() - start))
    env.close()
    return statistics.median(rates[1:])


def time_async(env_id: str, image_size: int, workers: int, steps: int, repeats: int) -> float:
    """Steps/s, summed over ``workers`` async workers: the median of ``repeats`` runs after a warm-up."""
    context = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    envs = gym.vector.AsyncVectorEnv(
        [maker(env_id, image_size) for _ in range(workers)],
        shared_memory=True,
        context=context,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs.action_space.seed(0)
    envs.reset(seed=0)
    vector_steps = max(1, steps // workers)
    rates = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for _ in range(vector_steps):
            envs.step(envs.action_space.sample())
        rates.append(vector_steps * workers / (time.perf_counter() - start))
    envs.close()
    return statistics.median(rates[1:])


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--image-size", type=int, default=84)
    parser.add_argument("--steps", type=int, default=1000, help="env steps per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    if min(args.image_size, args.steps, args.repeats, *args.workers) < 1:
        print("error: --image-size, --steps, --repeats and --workers must be at least 1", file=sys.stderr)
        return 2

    import visppo_envs  # noqa: F401  registers the ids and chooses the GL backend before mujoco loads

    print(f"raw env steps/s, {args.image_size}x{args.image_size}, random actions, "
          f"median of {args.repeats} x {args.steps} steps")
    print(f"{'task':10s} {'1 proc':>10s}" + "".join(f" {f'{w} async':>10s}" for w in args.workers))
    for task in args.tasks:
        env_id = f"visppo/{task}-v0"
        row = [time_single(env_id, args.image_size, args.steps, args.repeats)]
        row += [time_async(env_id, args.image_size, w, args.steps, args.repeats) for w in args.workers]
        print(f"{task:10s}" + "".join(f" {r:10.0f}" for r in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

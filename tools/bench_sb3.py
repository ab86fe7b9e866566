"""The reference point of issue 7: Stable-Baselines3's PPO on pixel Reacher-v5, timed here.

    pip install stable-baselines3   # for this script only; visppo does not need it
    python tools/bench_sb3.py [--iterations 6] [--repeats 3] [--threads 0] [--render-samples -1]

SB3's ``PPO("CnnPolicy")`` (Nature CNN, 512 features, shared by actor and
critic) on Reacher-v5 rendered to 84x84 RGB (the same env stack visppo builds
for ``env.id=Reacher-v5 env.pixels=true``: gymnasium's AddRenderObservation),
2 envs in SubprocVecEnv workers (forkserver), 256 steps per env, minibatch 64,
4 epochs. Prints end-to-end env steps/s: the median over iterations (the first
left out) of each run, then the median over runs; and the median time per
iteration spent collecting (rollout start to end) and the rest (the update).
Compare ``--render-samples 0`` with

    python tools/bench.py configs/reacher_pixels.yaml

which trains visppo with the same sizes and network and the same renderer setting (no
anti-aliasing; the default -1 keeps Reacher-v5's 4 samples, which render slower).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time

os.environ.setdefault("MUJOCO_GL", "egl")


def make_env(render_samples: int = -1):
    import gymnasium as gym

    env = gym.make("Reacher-v5", render_mode="rgb_array", width=84, height=84)
    if render_samples >= 0:  # as visppo's env.render_samples: before the first frame builds the context
        env.unwrapped.model.vis.quality.offsamples = render_samples
    return gym.wrappers.AddRenderObservation(env, render_only=True)


def run(iterations: int, threads: int, render_samples: int, *, num_envs: int = 2, n_steps: int = 256,
        batch_size: int = 64, n_epochs: int = 4, frame_stack: int = 1, device: str = "cpu",
        seed: int = 0, deterministic: bool = False) -> tuple[float, float, float]:
    """One run of ``iterations`` timed iterations after a warm-up one: (end-to-end steps/s, collect
    seconds, update seconds), medians over the timed iterations. The defaults are this script's
    sizes; tools/speed_vs_sb3.py passes its own (more envs, 3 stacked frames, a GPU).

    SB3's seeding switches cuDNN to its deterministic algorithms (and benchmark off) on a GPU;
    ``deterministic`` sets them back as visppo runs with ``train.deterministic``: off, torch's
    defaults, unless asked."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import SubprocVecEnv, VecFrameStack

    if threads:
        torch.set_num_threads(threads)

    class IterationClock(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.starts: list[float] = []
            self.ends: list[float] = []

        def _on_rollout_start(self) -> None:
            self.starts.append(time.perf_counter())

        def _on_rollout_end(self) -> None:
            self.ends.append(time.perf_counter())

        def _on_training_end(self) -> None:  # closes the last iteration's span (its update)
            self.starts.append(time.perf_counter())

        def _on_step(self) -> bool:
            return True

    make = functools.partial(make_env, render_samples)
    envs = SubprocVecEnv([make] * num_envs, start_method="forkserver")
    if frame_stack > 1:
        envs = VecFrameStack(envs, n_stack=frame_stack)  # on the channel axis, as visppo's env.frame_stack
    rollout = num_envs * n_steps
    try:
        model = PPO("CnnPolicy", envs, n_steps=n_steps, batch_size=batch_size, n_epochs=n_epochs, seed=seed,
                    device=device, verbose=0)
        torch.backends.cudnn.deterministic = deterministic  # SB3's set_random_seed turned it on
        torch.backends.cudnn.benchmark = False
        clock = IterationClock()
        model.learn(total_timesteps=(iterations + 1) * rollout, callback=clock)
    finally:
        envs.close()
    durations = [b - a for a, b in zip(clock.starts, clock.starts[1:])][1:]  # drop the warm-up
    collects = [b - a for a, b in zip(clock.starts, clock.ends)][1:len(durations) + 1]
    collect = statistics.median(collects)
    return statistics.median(rollout / d for d in durations), collect, statistics.median(durations) - collect


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def report(runs: list[tuple[float, float, float]], render_samples: int) -> str:
    """One line: the median end-to-end rate over runs (each run's listed), and the time per phase."""
    rates = [r[0] for r in runs]
    return (f"SB3 PPO CnnPolicy, pixel Reacher-v5 84x84 (render samples {render_samples}), 2 envs x 256 "
            f"steps, minibatch 64, 4 epochs: "
            f"{statistics.median(rates):.0f} steps/s end to end (runs: {', '.join(f'{r:.0f}' for r in rates)}); "
            f"per iteration: collect {statistics.median(r[1] for r in runs):.2f} s, "
            f"update {statistics.median(r[2] for r in runs):.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6, help="timed iterations of 512 steps per run (6)")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the median is printed (3)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    parser.add_argument("--render-samples", type=int, default=-1,
                        help="anti-aliasing samples of the renderer, as visppo's env.render_samples; -1: the env's own")
    ns = parser.parse_args(argv)
    if ns.iterations < 1 or ns.repeats < 1 or ns.threads < 0 or ns.render_samples < -1:
        print("error: --iterations and --repeats must be at least 1, --threads at least 0, --render-samples "
              "at least -1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("stable_baselines3") is None:
        print("error: bench_sb3.py needs Stable-Baselines3: pip install stable-baselines3", file=sys.stderr)
        return 2
    runs = [run(ns.iterations, ns.threads, ns.render_samples) for _ in range(ns.repeats)]
    print(report(runs, ns.render_samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())

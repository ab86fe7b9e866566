"""The peer on the same env: Stable-Baselines3's PPO CnnPolicy with its defaults on a visppo env.

    pip install stable-baselines3   # for this script only; visppo does not need it
    python tools/sb3_dmc.py configs/dmc_walker_walk.yaml env.kwargs.look=fast --seed 1 \\
        --steps 100000 --out runs/sb3/dmc_walker_walk/seed1

The published PPO rows (MR.Q, Table 6) ran Stable-Baselines3's ``PPO("CnnPolicy")`` with its
defaults on another machine and another look. This script runs it on the env visppo trains on
(the config's task, look, frame stack, action repeat and image size: the stacked uint8 frames,
channels first), with SB3's defaults (one env, 2048 steps per rollout, minibatch 64, 10 epochs,
learning rate 3e-4). The env's episodes take visppo's training seeds of (seed, rank 0, env i)
and the final policy is evaluated as ``visppo eval RUN --episodes 10 --deterministic --seed 0``
would: the evaluation stream, which no training episode uses.

The run folder looks like a visppo run to ``tools/learning_table.py``: ``config.yaml`` (the
visppo config, for its env, ``ppo.total_steps`` the budget, ``ppo.num_envs`` and ``train.seed``;
its other ``ppo.*`` keys are not what SB3 ran), ``metrics.csv`` (``global_step``,
``episode_return`` per rollout) and ``final_eval.json``; ``sb3.json`` holds the hyperparameters
SB3 did run with.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from visppo import seeding  # noqa: E402
from visppo.atomic import atomic_write, atomic_write_text, check_writable  # noqa: E402
from visppo.config import Config, load_config, to_yaml  # noqa: E402
from visppo.envs import make_env  # noqa: E402
from visppo.errors import UserError  # noqa: E402


class Frames(gym.ObservationWrapper):
    """visppo's ``{"pixels": C x H x W uint8}`` as the plain image SB3's CnnPolicy reads; the first
    reset seeds the episode stream with ``base`` whatever seed SB3 passes."""

    def __init__(self, env: gym.Env, base: int):
        super().__init__(env)
        self.observation_space = env.observation_space["pixels"]
        self.base: int | None = base

    def reset(self, *, seed=None, options=None):
        base, self.base = self.base, None
        return super().reset(seed=base, options=options)

    def observation(self, observation):
        return observation["pixels"]


def evaluate(model, cfg: Config, episodes: int, seed: int = 0) -> dict:
    """``episodes`` deterministic episodes of the evaluation stream ``seed`` (as ``visppo eval``)."""
    env = make_env(cfg, seeding.EVAL)
    returns, lengths = [], []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed if i == 0 else None)
            total, length, done = 0.0, 0, False
            while not done:
                action, _ = model.predict(obs["pixels"], deterministic=True)
                action = np.clip(action, env.action_space.low, env.action_space.high)
                obs, reward, terminated, truncated, _ = env.step(action)
                total, length, done = total + float(reward), length + 1, terminated or truncated
            returns.append(total)
            lengths.append(length)
    finally:
        env.close()
    return {"episodes": episodes, "mean_return": statistics.fmean(returns),
            "std_return": statistics.pstdev(returns), "returns": returns, "lengths": lengths,
            "deterministic": True, "seed": seed, "learner": "stable-baselines3 PPO CnnPolicy (defaults)"}


def train(cfg: Config, seed: int, steps: int, num_envs: int, out: Path, eval_episodes: int,
          **ppo_kwargs) -> dict:
    """Train SB3's PPO (its defaults, unless ``ppo_kwargs`` says otherwise), write the run folder
    and return the final evaluation."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    rows: list[dict] = []

    class Log(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            recent = [e["r"] for e in self.model.ep_info_buffer]
            rows.append({"global_step": self.num_timesteps,
                         "episode_return": statistics.fmean(recent) if recent else math.nan})

    fns = [lambda i=i: Monitor(Frames(make_env(cfg), seeding.env_seed(seed, 0, i))) for i in range(num_envs)]
    envs = DummyVecEnv(fns)
    try:
        model = PPO("CnnPolicy", envs, seed=seed, device="cpu", verbose=0, **ppo_kwargs)
        model.learn(total_timesteps=steps, callback=Log())
    finally:
        envs.close()
    out.mkdir(parents=True, exist_ok=True)
    # every file whole or absent, final_eval.json last: a folder the learning table reads half of
    # (a kill mid-write) would enter its tables
    atomic_write_text(out / "sb3.json", json.dumps(hyperparameters(model), indent=2))
    cfg.ppo.total_steps, cfg.ppo.num_envs, cfg.train.seed = steps, num_envs, seed
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    write_metrics(out / "metrics.csv", rows)
    result = evaluate(model, cfg, eval_episodes)
    atomic_write_text(out / "final_eval.json", json.dumps(result, indent=2))
    return result


def write_metrics(path: Path, rows: list[dict]) -> None:
    """``metrics.csv`` as visppo writes it (``global_step``, ``episode_return``), whole or absent."""
    def write(f) -> None:
        writer = csv.DictWriter(f, fieldnames=["global_step", "episode_return"])
        writer.writeheader()
        writer.writerows(rows)

    atomic_write(path, write, binary=False)


def hyperparameters(model) -> dict:
    """What SB3's PPO trained with (its defaults unless overridden), read from the model."""
    import stable_baselines3

    def value(v):
        return v(1.0) if callable(v) else v  # a schedule: its value at the start

    names = ("n_steps", "batch_size", "n_epochs", "learning_rate", "gamma", "gae_lambda", "clip_range",
             "clip_range_vf", "normalize_advantage", "ent_coef", "vf_coef", "max_grad_norm", "target_kl")
    return {"learner": "stable-baselines3 PPO CnnPolicy", "stable_baselines3": stable_baselines3.__version__,
            "n_envs": model.n_envs, **{name: value(getattr(model, name)) for name in names}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a visppo config (the env is taken from it)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--seed", type=int, default=1, help="run seed (1)")
    parser.add_argument("--steps", type=int, default=100_000, help="agent steps to train for (100000)")
    parser.add_argument("--num-envs", type=int, default=1, help="envs; SB3's default is 1 (1)")
    parser.add_argument("--eval-episodes", type=int, default=10, help="final evaluation episodes (10)")
    parser.add_argument("--out", required=True, help="run folder to write (must not exist)")
    ns = parser.parse_args(argv)
    try:
        if ns.seed < 0 or ns.steps < 1 or ns.num_envs < 1 or ns.eval_episodes < 1:
            raise UserError("--seed must be >= 0 and --steps, --num-envs, --eval-episodes >= 1")
        out = Path(ns.out)
        if out.exists():
            raise UserError(f"--out {out} exists: give a new folder")
        check_writable(out / "metrics.csv", "--out")  # before training: a folder under a file fails here
        try:
            import stable_baselines3  # noqa: F401
        except ImportError:
            raise UserError("stable-baselines3 is not installed: pip install stable-baselines3") from None
        cfg = load_config(ns.config, ns.overrides)
        make_env(cfg).close()  # an env that cannot be built: before SB3 starts
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = train(cfg, ns.seed, ns.steps, ns.num_envs, out, ns.eval_episodes)
    print(f"{cfg.env.id} SB3 PPO seed {ns.seed}, {ns.steps} steps: final policy "
          f"{result['mean_return']:.1f} +- {result['std_return']:.1f} over {ns.eval_episodes} episodes -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

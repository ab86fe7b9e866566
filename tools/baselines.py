"""What a task pays for doing nothing and for acting at random: the floor a learning curve must clear.

    python tools/baselines.py CONFIG [KEY=VALUE ...] [--episodes 10] [--seed 100]
    python tools/baselines.py configs/dmc_cartpole_balance.yaml env.kwargs.look=fast

Runs two policies in the config's own env (``make_env``: its frame stack, action repeat, episode
length and look) and prints their episode returns, mean +- std, and success where the task
defines it:

- random: actions drawn uniformly from the action space (seeded);
- zero: the all-zeros action (for a box centred on 0, the mean of a freshly initialised
  Gaussian policy, whose last layer is near 0: so this is also roughly what the deterministic
  evaluation of an untrained policy earns).

Episode ``i`` is reset with seed ``--seed + i`` for both policies, so they face the same
initial states. A trained policy's figure means something beside these: on cartpole-balance a
zero action earns about three quarters of the maximum (the unpushed pole swings all the way round
and lingers near the top), more than twice a random policy's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import numpy as np


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def episode_returns(env, act: Callable[[], np.ndarray], episodes: int, seed: int) -> list[tuple[float, bool | None]]:
    """(return, success or None) of ``episodes`` episodes, episode ``i`` reset with ``seed + i``."""
    results = []
    for i in range(episodes):
        env.reset(seed=seed + i)
        total, success, done = 0.0, None, False
        while not done:
            _, reward, terminated, truncated, info = env.step(act())
            total += float(reward)
            done = terminated or truncated
            if "is_success" in info:
                success = bool(info["is_success"])
        results.append((total, success))
    return results


def baselines(cfg, episodes: int, seed: int) -> dict[str, list[tuple[float, bool | None]]]:
    """The random and the zero-action policy's episodes in ``cfg``'s env."""
    from visppo.envs import make_env

    env = make_env(cfg)
    try:
        space = env.action_space
        space.seed(seed)
        zero = np.zeros(space.shape, dtype=space.dtype)
        return {"random": episode_returns(env, space.sample, episodes, seed),
                "zero": episode_returns(env, lambda: zero, episodes, seed)}
    finally:
        env.close()


def report(results: dict[str, list[tuple[float, bool | None]]]) -> str:
    """A markdown table: policy, episodes, return mean +- std, min, max, success."""
    lines = ["| policy | episodes | return | min | max | success |", "| --- | --- | --- | --- | --- | --- |"]
    for name, episodes in results.items():
        returns = [r for r, _ in episodes]
        successes = [s for _, s in episodes if s is not None]
        std = statistics.pstdev(returns) if len(returns) > 1 else 0.0
        success = f"{100 * sum(successes) / len(successes):.0f}%" if successes else ""
        lines.append(f"| {name} | {len(returns)} | {statistics.fmean(returns):.2f} ± {std:.2f} | "
                     f"{min(returns):.2f} | {max(returns):.2f} | {success} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="a config file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, as visppo train takes them")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per policy")
    parser.add_argument("--seed", type=int, default=100, help="reset seed of the first episode (and the action sampler)")
    ns = parser.parse_args(argv)
    from visppo.config import load_config
    from visppo.envs import check_env_id
    from visppo.errors import UserError

    if ns.episodes < 1:
        print("error: --episodes must be at least 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(ns.config, ns.overrides)
        check_env_id(cfg.env.id)
        results = baselines(cfg, ns.episodes, ns.seed)  # an env that cannot be built is bad input too
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{cfg.env.id}: {ns.episodes} episodes per policy, reset seeds {ns.seed}-{ns.seed + ns.episodes - 1}\n")
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Episode trace: what a trained policy does in each episode, read from the simulator.

    python tools/episode_trace.py RUN_DIR_OR_CKPT --geoms finger target [--episodes 10]
        [--seed 5000] [--stochastic] [env.KEY=VALUE ...]

A return says how well a policy did, not what it did. This tool plays ``--episodes``
episodes (reset seeds ``--seed``, ``--seed + 1``, ...; deterministic actions unless
``--stochastic``, the same episodes as ``visppo eval --seed 5000 --deterministic``) and prints
for each: the return, where the second geom is (its distance from the world origin and its
angle), the distance between the two geoms at the start, its minimum, and its mean over the
last quarter, and the actions (mean |a| and the mean action over the last quarter). Geom
positions are read from the env's MuJoCo ``model``/``data``, which visppo's tasks and its
DeepMind Control wrapper expose.

On DMC reacher-easy (README) it showed why the shipped config's policy scores 199: it folds the
arm onto targets near the centre (return 863-966) and for the others spins the first joint
(mean action 0.5-0.7; the fingertip passes the target, minimum distance 0.007-0.028 m, and does
not stop) or holds still (|a| 0.01).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np


def trace(source: str, geoms: list[str], episodes: int, seed: int, stochastic: bool,
          env_overrides: list[str]) -> list[dict]:
    """One dict per episode: return, steps, the second geom's radius and angle, distances, actions."""
    import torch
    from feature_probe import geom_ids  # tools/ is on sys.path when a tool runs as a script

    from visppo.envs import make_env
    from visppo.evaluate import load_policy, resolve_checkpoint

    torch.set_num_threads(1)
    policy, cfg, _ = load_policy(resolve_checkpoint(source), env_overrides=env_overrides)
    env = make_env(cfg)
    base = env.unwrapped
    ids = geom_ids(base, geoms, cfg.env.id)
    low, high = env.action_space.low, env.action_space.high
    rows = []
    try:
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            goal = base.data.geom_xpos[ids[1], :2].copy()
            dist, actions, total, done = [], [], 0.0, False
            while not done:
                batch = {k: torch.as_tensor(np.asarray(v))[None] for k, v in obs.items()}
                with torch.inference_mode():
                    action, _, _ = policy.act(batch, deterministic=not stochastic)
                action = np.clip(action[0].float().numpy(), low, high)
                obs, reward, terminated, truncated, _ = env.step(action)
                total, done = total + float(reward), bool(terminated or truncated)
                actions.append(action)
                dist.append(float(np.linalg.norm(base.data.geom_xpos[ids[0]] - base.data.geom_xpos[ids[1]])))
            tail = max(1, len(dist) // 4)
            acts = np.array(actions)
            rows.append(dict(episode=ep, ret=total, steps=len(dist), radius=float(np.linalg.norm(goal)),
                             angle=math.degrees(math.atan2(goal[1], goal[0])), start=dist[0], min=min(dist),
                             last=float(np.mean(dist[-tail:])), abs_action=float(np.abs(acts).mean()),
                             last_action=acts[-tail:].mean(0)))
    finally:
        env.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="RUN_DIR_OR_CKPT", help="a run directory or checkpoint file")
    parser.add_argument("--geoms", nargs=2, required=True, metavar=("MOVER", "GOAL"),
                        help="two MuJoCo geom names: what moves (e.g. finger) and what it should reach")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to play")
    parser.add_argument("--seed", type=int, default=5000, help="reset seed of the first episode")
    parser.add_argument("--stochastic", action="store_true", help="sample actions (default: the mean action)")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("env.") or "=" not in o]
    if bad or args.episodes < 1:
        why = f"unknown arguments {' '.join(bad)} (only env.KEY=VALUE)" if bad else "--episodes must be >= 1"
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        rows = trace(args.source, args.geoms, args.episodes, args.seed, args.stochastic, overrides)
    except (ValueError, OSError) as exc:  # visppo's UserError (bad checkpoint, config) is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mover, goal = args.geoms
    print(f"{'stochastic' if args.stochastic else 'deterministic'} actions; distance {mover}-{goal} in metres")
    for r in rows:
        print(f"ep {r['episode']:>3} return {r['ret']:7.1f} | {goal} at r {r['radius']:.3f} angle "
              f"{r['angle']:5.0f} | distance start {r['start']:.3f} min {r['min']:.3f} last quarter "
              f"{r['last']:.3f} | |a| {r['abs_action']:.2f} last-quarter a {np.round(r['last_action'], 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

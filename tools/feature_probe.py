"""Linear probe: which positions in the scene can be read off a trained encoder's features?

    python tools/feature_probe.py RUN_DIR_OR_CKPT --geoms target finger [--episodes 240]
        [--steps 30] [--random-init] [env.KEY=VALUE ...]

A pixel policy can act on a thing only if its encoder keeps where the thing is. This tool
runs ``--episodes`` short episodes (reset seeds 6000, 6001, ...) with uniformly random
actions, so the arm visits poses the policy itself never takes, and every third step records
the actor encoder's features and the world x, y of each named MuJoCo geom (read from the
env's ``model``/``data``, which visppo's MuJoCo tasks and its DeepMind Control wrapper
expose). It then fits a ridge regression from the standardised features to those positions
on the first 75% of the episodes and reports R^2 and the error in metres on the rest (split
by episode: a target fixed within an episode must not leak across the split). With two
geoms it also probes their difference, the vector a reaching policy needs.

R^2 near 1: the features hold that position linearly; near 0 or below: no better than the
mean. ``--random-init`` re-initialises every layer first (PyTorch's default init, seed 0),
the baseline a trained encoder should beat: a coordinate a trained encoder holds worse than a
random one is one training discarded. On DMC reacher-easy (README) the shipped config's
encoder holds the target (R^2 0.96, 0.97) but not its own fingertip (0.16, -0.35; 0.44, 0.23
at random init).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

RECORD_EVERY = 3
"""Steps between recorded frames: consecutive frames are nearly the same sample."""


def ridge_probe(features: np.ndarray, targets: np.ndarray, groups: np.ndarray, lam: float = 30.0,
                test_fraction: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """Fit ridge regression on the groups before the last ``test_fraction``; return (R^2, RMSE)
    per target column on the held-out groups. Features are standardised with the training
    part's mean and std, so ``lam`` means the same for any encoder; units that barely vary there
    (dead ReLUs) are left out."""
    cut = np.quantile(np.unique(groups), 1.0 - test_fraction)
    test = groups > cut
    if test.all() or not test.any():
        raise ValueError("need at least two groups (episodes) to hold some out")
    mean, std = features[~test].mean(0), features[~test].std(0)
    live = std > 1e-2 * np.median(std[std > 0]) if (std > 0).any() else std > 0
    # units (almost) constant on the training part would blow up when standardised: dropped
    x = np.c_[(features[:, live] - mean[live]) / std[live], np.ones(len(features))]
    reg = lam * np.eye(x.shape[1])
    reg[-1, -1] = 0.0  # the intercept is not shrunk
    w = np.linalg.solve(x[~test].T @ x[~test] + reg, x[~test].T @ targets[~test])
    err = x[test] @ w - targets[test]
    var = ((targets[test] - targets[test].mean(0)) ** 2).sum(0)
    r2 = 1.0 - (err ** 2).sum(0) / np.maximum(var, 1e-12)
    return r2, np.sqrt((err ** 2).mean(0))


def geom_ids(base, geoms: list[str], env_id: str) -> list[int]:
    """MuJoCo ids of the named geoms of an env (its unwrapped ``model``/``data``); ValueError
    naming the env's geoms when one is missing."""
    import mujoco

    if not hasattr(base, "model") or not hasattr(base, "data"):
        raise ValueError(f"{env_id} exposes no MuJoCo model/data: geom positions are read from them")
    ids = [mujoco.mj_name2id(base.model, mujoco.mjtObj.mjOBJ_GEOM, g) for g in geoms]
    missing = [g for g, i in zip(geoms, ids) if i < 0]
    if missing:
        names = [mujoco.mj_id2name(base.model, mujoco.mjtObj.mjOBJ_GEOM, i) for i in range(base.model.ngeom)]
        raise ValueError(f"no geom {', '.join(missing)} in {env_id}; its geoms: {', '.join(n for n in names if n)}")
    return ids


def with_difference(pos: np.ndarray, geoms: list[str]) -> tuple[np.ndarray, list[str]]:
    """Column names ``geom.x``, ``geom.y`` per geom; with two geoms also their difference (first
    minus second: the vector a reaching policy needs) as two more columns."""
    names = [f"{g}.{c}" for g in geoms for c in "xy"]
    if len(geoms) == 2:
        pos = np.c_[pos, pos[:, :2] - pos[:, 2:]]
        names += [f"{geoms[0]}-{geoms[1]}.{c}" for c in "xy"]
    return pos, names


def random_action_states(env, ids: list[int], episodes: int, steps: int, first_seed: int):
    """Random-action episodes (actions uniform in the bounds, one numpy stream from seed 0), reset
    with seeds ``first_seed``, ``first_seed + 1``, ...: yields ``(episode, t, obs, xy, ended)``
    for the state after ``t`` steps, t = 0 (the reset) up to ``steps`` or the step that ends the
    episode (``ended``), ``xy`` each geom's world x, y there. What this tool and
    tools/position_fit.py record from, each its own states of it."""
    base = env.unwrapped
    rng = np.random.default_rng(0)
    for ep in range(episodes):
        obs, _ = env.reset(seed=first_seed + ep)
        for t in range(steps + 1):
            ended = False
            if t:
                action = rng.uniform(env.action_space.low, env.action_space.high).astype(np.float32)
                obs, _, terminated, truncated, _ = env.step(action)
                ended = terminated or truncated
            yield ep, t, obs, np.concatenate([base.data.geom_xpos[i, :2] for i in ids]), ended
            if ended:
                break


def collect(source: str, geoms: list[str], episodes: int, steps: int, random_init: bool,
            env_overrides: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, geom x-y positions (one column pair per geom) and episode index per record."""
    import torch

    from visppo.envs import make_env
    from visppo.evaluate import load_policy, resolve_checkpoint

    torch.set_num_threads(1)
    policy, cfg, _ = load_policy(resolve_checkpoint(source), env_overrides=env_overrides)
    if random_init:
        torch.manual_seed(0)
        for module in policy.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    policy.eval()
    env = make_env(cfg)
    ids = geom_ids(env.unwrapped, geoms, cfg.env.id)
    feats, pos, group = [], [], []
    try:  # every third state before the last step; an episode's final state is not one
        for ep, t, obs, xy, ended in random_action_states(env, ids, episodes, steps, first_seed=6000):
            if t < steps and t % RECORD_EVERY == RECORD_EVERY - 1 and not ended:
                batch = {k: torch.as_tensor(np.asarray(v))[None] for k, v in obs.items()}
                with torch.inference_mode():
                    feats.append(policy.encoder(batch).float()[0].numpy())
                pos.append(xy)
                group.append(ep)
    finally:
        env.close()
    return np.array(feats), np.array(pos), np.array(group)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="RUN_DIR_OR_CKPT", help="a run directory or checkpoint file")
    parser.add_argument("--geoms", nargs="+", required=True, help="MuJoCo geom names whose x-y to probe")
    parser.add_argument("--episodes", type=int, default=240, help="episodes (distinct resets) to record")
    parser.add_argument("--steps", type=int, default=30, help="random-action steps per episode")
    parser.add_argument("--lam", type=float, default=30.0, help="ridge penalty on standardised features")
    parser.add_argument("--random-init", action="store_true", help="probe the network re-initialised (PyTorch default init): the baseline")
    args, overrides = parser.parse_known_args(argv)
    overrides += [g for g in args.geoms if "=" in g]  # --geoms a b env.k=v: nargs="+" took the override too
    args.geoms = [g for g in args.geoms if "=" not in g]
    bad = [o for o in overrides if not o.startswith("env.") or "=" not in o]
    if bad or args.episodes < 4 or args.steps < RECORD_EVERY:
        why = (f"unknown arguments {' '.join(bad)} (only env.KEY=VALUE)" if bad
               else f"--episodes must be >= 4 and --steps >= {RECORD_EVERY}")
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        feats, pos, group = collect(args.source, args.geoms, args.episodes, args.steps, args.random_init, overrides)
    except (ValueError, OSError) as exc:  # visppo's UserError (bad checkpoint, config) is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pos, names = with_difference(pos, args.geoms)
    r2, rmse = ridge_probe(feats, pos, group, args.lam)
    print(f"{len(feats)} records from {args.episodes} episodes, {feats.shape[1]} features, "
          f"{'random init' if args.random_init else 'trained'}; held out: the last 25% of episodes")
    for name, a, b, s in zip(names, r2, rmse, pos.std(0)):
        print(f"  {name:<24} R^2 {a:6.2f}   error {b:.3f} m (spread {s:.3f} m)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

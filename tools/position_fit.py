"""Supervised fit: can an encoder learn the scene's positions from a config's frames, and from how much data?

    python tools/position_fit.py CONFIG --geoms finger target [--episodes 100] [--steps 100]
        [--updates 3000] [--augment none|shift|rotate] [--save ENCODER.pt]
        [--recon-size N [--recon-updates 3000] [--recon-motion M]] [KEY=VALUE ...]

``tools/feature_probe.py`` asks what a trained policy's encoder holds; this asks what the
config's encoder *can* hold when told. It records ``--episodes`` random-action episodes of
the config's env (reset seeds 0, 1, ...; ``--steps`` agent steps each, the config's frame
stack and action repeat), then trains a fresh ``model.encoder`` with a small MLP head to
regress the world x, y of each named MuJoCo geom (and, for two geoms, their difference: the
vector a reaching policy needs), mean squared error on standardised targets, Adam 3e-4,
minibatch 64, one CPU thread. Every 1000 updates it prints R^2 on the first 2048 training
records and on the held-out last 20% of episodes (split by episode: a target fixed within an
episode must not leak). Minutes, where an RL run takes an hour: a screen for encoders and
augmentations before a learning run.

``--augment rotate`` turns each training sample by a random angle (``model.augment=rotate``'s
RandomRotate) and its target positions with it, about the world origin: only for a scene
that camera 0 sees straight down its vertical axis, as DMC reacher (``tests/test_dmc.py``
checks the frames).

``--recon-size N`` asks what a label-free loss gives instead: the encoder first trains
``--recon-updates`` steps on the trainer's reconstruction loss alone (``model.recon_size``'s
decoder and loss: the frames average-pooled to NxN), is then frozen, and the head is fitted on
its features; the held-out R^2 says how much of each position the reconstruction kept, against
what labels give the same encoder. ``--save`` writes the trained encoder's state dict, which
``model.encoder_weights`` loads (a diagnostic: an encoder that holds the positions, for an RL
run to start from).

On DMC reacher-easy (fast look, README): the Nature CNN from 100 episodes memorises (training
R^2 1.00) and generalises partly to new episodes (fingertip 0.69, 0.80); from 400 episodes
0.95, 0.93; from 100 episodes turned by ``rotate``, 0.99, 0.99.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling feature_probe, imported or run

HELD_OUT = 0.2
"""Fraction of episodes (the last ones) held out."""


def record(cfg, geoms: list[str], episodes: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stacked frames (uint8 ``[N, C, H, W]``), geom x-y per record and episode index, random actions."""
    from feature_probe import geom_ids, random_action_states

    from visppo.envs import make_env

    env = make_env(cfg)
    ids = geom_ids(env.unwrapped, geoms, cfg.env.id)
    frames, pos, group = [], [], []
    try:  # every state after a step, the final one included
        for ep, t, obs, xy, _ in random_action_states(env, ids, episodes, steps, first_seed=0):
            if t:
                frames.append(np.asarray(obs["pixels"]))
                pos.append(xy)
                group.append(ep)
    finally:
        env.close()
    return np.stack(frames), np.array(pos, np.float32), np.array(group)


def turn_xy(targets, angles):
    """Turn each row's (x, y) column pairs by its angle (radians, counter-clockwise) about the origin."""
    import torch

    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    x, y = targets[:, 0::2], targets[:, 1::2]
    out = torch.empty_like(targets)
    out[:, 0::2], out[:, 1::2] = cos * x - sin * y, sin * x + cos * y
    return out


def fit(cfg, frames: np.ndarray, pos: np.ndarray, group: np.ndarray, updates: int, augment: str,
        report=print, recon_size: int = 0, recon_updates: int = 3000, progress=print, recon_motion: float = 0.0):
    """Train a fresh ``cfg.model.encoder`` and head on the training episodes; report R^2 every 1000
    updates; return the encoder and the last (train, held-out) R^2 per target column.

    With ``recon_size`` the encoder first learns without labels, ``recon_updates`` steps of the
    trainer's reconstruction loss alone at that size (``reconstruct``), and is then frozen: the
    ``updates`` steps train the head only, on its features, to read what it kept."""
    import torch
    from torch import nn

    from visppo.augment import make_augmentation
    from visppo.encoders import build_pixel_encoder

    torch.manual_seed(0)
    x, y = torch.from_numpy(frames), torch.from_numpy(pos)
    train = torch.from_numpy(group <= np.quantile(np.unique(group), 1.0 - HELD_OUT))
    if train.all() or not train.any():
        raise ValueError("need at least two episodes to hold some out")
    train_idx, test_idx = train.nonzero()[:, 0], (~train).nonzero()[:, 0]
    mean, std = y[train].mean(0), y[train].std(0).clamp_min(1e-6)
    encoder = build_pixel_encoder(cfg.model.encoder, tuple(x.shape[1:]), cfg.model.feature_dim)
    encoder, x = encoder.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    head = nn.Sequential(nn.Linear(encoder.out_dim, 256), nn.ReLU(), nn.Linear(256, y.shape[1]))
    aug = make_augmentation(augment, cfg.model.shift_pad, cfg.model.rotate_degrees)
    gen = torch.Generator().manual_seed(0)
    trained = encoder  # what --save writes: with recon_size, the frozen pixel encoder, not the Identity below
    if recon_size:
        reconstruct(encoder, x, train_idx, recon_size, recon_updates, aug, gen, progress, motion=recon_motion)
        encoder.requires_grad_(False)
        with torch.no_grad():  # frozen: its features once, and the head reads them (no augmentation left)
            x = torch.cat([encoder(x[i:i + 512]) for i in range(0, len(x), 512)])
        # standardised on the training part, as the ridge read's: an untrained spatial-softmax encoder's
        # features vary across frames by about 1e-4, which Adam's head does not resolve in thousands of steps
        x = (x - x[train_idx].mean(0)) / x[train_idx].std(0).clamp_min(1e-6)
        encoder, aug = nn.Identity(), None
        from feature_probe import ridge_probe

        r2, rmse = ridge_probe(x.numpy(), pos, group, test_fraction=HELD_OUT)
        progress("linear read (feature_probe's ridge) held-out R^2 " + " ".join(f"{v:5.2f}" for v in r2)
                 + ", error " + " ".join(f"{v:.3f}" for v in rmse))
    opt = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=3e-4)

    def r2(index: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            pred = torch.cat([head(encoder(x[index[i:i + 512]])) for i in range(0, len(index), 512)])
            want = (y[index] - mean) / std
            return (1 - ((pred - want) ** 2).mean(0) / want.var(0).clamp_min(1e-12)).numpy()

    scores = None  # set at the last update (updates >= 1)
    for step in range(1, updates + 1):
        i = train_idx[torch.randint(0, len(train_idx), (64,), generator=gen)]
        xb, yb = x[i], y[i]
        if aug is not None:
            draws = aug.draw(len(i))
            xb = aug.apply(xb, draws)
            if augment == "rotate":
                yb = turn_xy(yb, draws)
        loss = ((head(encoder(xb)) - (yb - mean) / std) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 1000 == 0 or step == updates:
            scores = (r2(train_idx[:2048]), r2(test_idx))
            report(step, *scores)
    return trained, scores


def reconstruct(encoder, x, train_idx, size: int, updates: int, aug, gen, progress=print,
                every: int = 1000, motion: float = 0.0) -> float:
    """Train ``encoder`` with a decoder on the trainer's reconstruction loss alone (the policy's
    auxiliary head, ``recon_target`` at ``size`` with ``motion``, and ``recon_error``),
    minibatch 64, Adam 3e-4; ``progress`` gets the mean loss of every ``every`` updates, and the
    last such mean is returned."""
    import torch

    from visppo.policy import _aux_head, recon_error, recon_target

    shape = recon_target(x[:1], size, motion).shape[1:]
    decoder = _aux_head(encoder.out_dim, 256, int(np.prod(shape)))
    opt = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=3e-4)
    total, count, mean_loss = 0.0, 0, float("nan")
    for step in range(1, updates + 1):
        xb = x[train_idx[torch.randint(0, len(train_idx), (64,), generator=gen)]]
        if aug is not None:
            xb = aug.apply(xb, aug.draw(len(xb)))
        loss = recon_error(decoder(encoder(xb)).view(-1, *shape), recon_target(xb, size, motion)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total, count = total + loss.item(), count + 1
        if step % every == 0 or step == updates:
            mean_loss, total, count = total / count, 0.0, 0
            progress(f"reconstruction update {step:6d}: loss {mean_loss:.2f}")
    return mean_loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a config file (configs/*.yaml)")
    parser.add_argument("--geoms", nargs="+", required=True, help="MuJoCo geom names whose x-y to fit")
    parser.add_argument("--episodes", type=int, default=100, help="random-action episodes to record")
    parser.add_argument("--steps", type=int, default=100, help="agent steps recorded per episode")
    parser.add_argument("--updates", type=int, default=3000, help="Adam steps of minibatch 64")
    parser.add_argument("--augment", default="none", choices=("none", "shift", "rotate"))
    parser.add_argument("--save", default="", help="write the trained encoder's state dict here")
    parser.add_argument("--recon-size", type=int, default=0,
                        help="N > 0: the encoder learns by reconstructing the frames pooled to NxN, without labels, "
                             "then is frozen and the head reads its features")
    parser.add_argument("--recon-updates", type=int, default=3000, help="reconstruction steps (minibatch 64)")
    parser.add_argument("--recon-motion", type=float, default=0.0,
                        help="M > 0: reconstruct each frame's change too, times M (model.recon_motion's target)")
    args, overrides = parser.parse_known_args(argv)
    overrides += [g for g in args.geoms if "=" in g]  # --geoms a b env.k=v: nargs="+" took the override too
    args.geoms = [g for g in args.geoms if "=" not in g]
    bad = [o for o in overrides if "=" not in o]
    if (bad or args.episodes < 2 or min(args.steps, args.updates, args.recon_updates) < 1
            or min(args.recon_size, args.recon_motion) < 0):
        why = (f"unknown arguments {' '.join(bad)} (only KEY=VALUE overrides)" if bad
               else "--episodes must be >= 2, --steps, --updates and --recon-updates >= 1, "
                    "--recon-size and --recon-motion >= 0")
        print(f"error: {why}", file=sys.stderr)
        return 2
    import torch

    from visppo.config import load_config
    from visppo.envs import preload_before_gl

    torch.set_num_threads(1)
    preload_before_gl()  # torch's compiler stack before an EGL context (visppo.envs)
    start = time.perf_counter()
    try:
        cfg = load_config(args.config, overrides)
        if args.recon_size > cfg.env.image_size:
            raise ValueError(f"--recon-size must be at most env.image_size, {cfg.env.image_size}")
        if args.recon_motion and cfg.env.frame_stack < 2:
            raise ValueError("--recon-motion needs env.frame_stack >= 2 (a frame's change from the one before)")
        frames, pos, group = record(cfg, args.geoms, args.episodes, args.steps)
    except (ValueError, OSError) as exc:  # visppo's UserError (bad config) is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from feature_probe import with_difference

    pos, names = with_difference(pos, args.geoms)
    print(f"{len(frames)} records from {args.episodes} episodes ({time.perf_counter() - start:.0f} s); "
          f"encoder {cfg.model.encoder}, augment {args.augment}; R^2 per column: {', '.join(names)}", flush=True)

    def report(step: int, train_r2: np.ndarray, test_r2: np.ndarray) -> None:
        fmt = " ".join(f"{v:5.2f}" for v in train_r2), " ".join(f"{v:5.2f}" for v in test_r2)
        print(f"update {step:6d} ({time.perf_counter() - start:4.0f} s)  train {fmt[0]}  held-out {fmt[1]}",
              flush=True)

    encoder, _ = fit(cfg, frames, pos, group, args.updates, args.augment, report, args.recon_size,
                     args.recon_updates, progress=lambda msg: print(f"{msg} ({time.perf_counter() - start:.0f} s)",
                                                                    flush=True),
                     recon_motion=args.recon_motion)
    if args.save:
        torch.save(encoder.state_dict(), args.save)
        print(f"encoder state dict written to {args.save} (model.encoder_weights={args.save})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

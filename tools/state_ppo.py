"""PPO from the state vector on a DeepMind Control or gymnasium task: is a pixel task's gap the RL or the vision?

    python tools/state_ppo.py dmc:reacher-easy [--steps 500000] [--seed 1] [--lr 3e-4]
        [--epochs 10] [--num-envs 8] [--num-steps 128] [--minibatch 256] [--init-log-std -0.5] [--layers 2]
        [--eval-every 50000] [--drop KEY ...] [--add-geom NAME ...] [--noise-beta B] [--blur KEY=STD ...]
        [--json F]

visppo learns from pixels; when a task does not learn, the question is whether PPO with those
sizes cannot learn it at all, or cannot learn it *from the frames*. This tool answers the first
half: the same PPO maths the trainer uses (``visppo.buffer.compute_gae``, ``visppo.ppo.ppo_loss``,
per-minibatch advantage normalisation, one global gradient clip at 0.5, Adam with eps 1e-5 and a
learning rate annealed to 0, the time limit bootstrapped from the final state's value) and the
DMC configs' sizes, with the suite's state vector (flattened in the suite's order) through an
MLP (two tanh layers of 256, standing in for the CNN's 256 features) in place of the frames.
The env is the suite's own with the published protocol's action repeat and 1000-frame episodes,
actions in [-1, 1] scaled to the task's bounds, and nothing rendered (``MUJOCO_GL=disable``), so
500k agent steps take minutes. It prints one JSON line per evaluation (10 deterministic episodes, seeds 5000-5009, as
``visppo eval --seed 5000 --deterministic``) and writes them all with ``--json``.

A gymnasium id whose observation is a flat vector (``Reacher-v5``: ``--action-repeat 1``) runs the
same way through ``gymnasium.make``, its own time limit and terminations (a termination is not
bootstrapped, a time limit is), evaluation episodes reset with seeds 5000-5009; ``--drop``,
``--add-geom`` and ``--blur`` are the suite's only.

``--drop`` and ``--add-geom`` change what the state tells, to ask which part of it a camera's
frames make hard: ``--drop to_target --add-geom target`` gives reacher the target's position in
the world (what the frames show) instead of the fingertip-to-target vector, so the network must
work out the difference from the joint angles itself, as a pixel encoder must.

``--blur to_target=0.03`` adds Gaussian noise of that std (the entry's units: metres for
reacher's vector) to an observation entry at every step, in training and evaluation: a stand-in
for an encoder that reads the entry only so precisely, to ask how precise a camera's reading
must be. (Independent per step, where an encoder's error is a fixed function of the frame.)

``--noise-beta`` samples the Gaussian through temporally correlated noise, as the trainer's
``model.noise_beta`` (``visppo.noise.ColoredNoise``): each env's unit-variance noise is a
1/f^beta sequence drawn per episode, and the action is the mean plus the std times it.

What it leaves out from the pixel learner: frames, frame stacking and the CNN, mixed precision,
micro-batches, the optional knobs (value normalisation, augmentation, auxiliary losses).
And its network is one layer deeper than the trainer's heads on their features: on reacher-easy
(seed 1, std 1.0) its two tanh layers learn (875 at 500k) where one tanh layer before the same
heads does not (94), as the trainer given the state does not (README, "The trainer given the
exact state"): read its figures as what a deeper policy learns. ``--layers`` sets the shared
trunk's depth: on reacher-easy (std 1.0, 300k) three layers learned on 4 of 4 draws, the default
two on 4 of 6, one on 0 of 3 (README, "From the state, a deeper shared trunk").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["MUJOCO_GL"] = "disable"  # nothing is rendered; dm_control then loads no GL backend

from envs import dmc  # noqa: E402
from visppo.buffer import compute_gae  # noqa: E402
from visppo.encoders import tanh_layers  # noqa: E402
from visppo.noise import ColoredNoise  # noqa: E402
from visppo.ppo import ppo_loss  # noqa: E402

EVAL_SEED = 5000
"""The first evaluation episode's seed, as ``visppo eval --seed 5000``."""


class StateEnv:
    """A suite task with the pixel envs' protocol (action repeat, 1000 frames, actions in [-1, 1])
    that returns the flattened state and renders nothing."""

    def __init__(self, env_id: str, seed: int, action_repeat: int, drop: tuple[str, ...] = (),
                 geoms: tuple[str, ...] = (), blur: dict[str, float] | None = None) -> None:
        domain, _, task = dmc.gym_id(env_id)[len(dmc.NAMESPACE) + 1:-len("-v0")].partition("-")
        self.env = dmc._load(domain, task, {"random": seed})
        self.drop, self.geoms, self.blur = tuple(drop), tuple(geoms), dict(blur or {})
        self.rng = np.random.default_rng(seed)
        keys, names = self.env.observation_spec().keys(), self.env.physics.named.data.geom_xpos.axes.row.names
        for what, asked, have in (("--drop: observation", self.drop, keys), ("--add-geom: geom", self.geoms, names),
                                  ("--blur: observation", tuple(self.blur), keys)):
            unknown = [a for a in asked if a not in have]
            if unknown:
                raise ValueError(f"{what} {unknown[0]!r} not in {domain}-{task}: use one of {', '.join(have)}")
        spec = self.env.action_spec()
        self.low, self.high = spec.minimum, spec.maximum
        self.action_dim, self.action_repeat = int(spec.shape[0]), action_repeat
        self.horizon = dmc.EPISODE_FRAMES // action_repeat  # agent steps per episode
        self.terminated = False  # every suite episode ends by its time limit
        self.frames, self.episode_return = 0, 0.0

    def _flat(self, timestep) -> np.ndarray:
        """The suite's observation in its order, less ``drop``, then each of ``geoms``' world position."""
        parts = [np.asarray(v, np.float64).ravel() + (self.rng.normal(0.0, self.blur[k], np.size(v)) if k in self.blur else 0.0)
                 for k, v in timestep.observation.items() if k not in self.drop]
        parts += [np.array(self.env.physics.named.data.geom_xpos[name], np.float64) for name in self.geoms]
        return np.concatenate(parts).astype(np.float32)

    def reset(self) -> np.ndarray:
        self.frames, self.episode_return = 0, 0.0
        return self._flat(self.env.reset())

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool]:
        """``(state, reward summed over the repeat, episode over)``; every suite episode ends by its time limit."""
        action = self.low + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (self.high - self.low)
        reward = 0.0
        for _ in range(self.action_repeat):
            timestep = self.env.step(action)
            self.frames += 1
            reward += float(timestep.reward or 0.0)
        self.episode_return += reward
        return self._flat(timestep), reward, self.frames >= dmc.EPISODE_FRAMES


class GymStateEnv:
    """A gymnasium env whose observation is a flat vector, with ``StateEnv``'s interface: actions in
    [-1, 1] scaled to the env's bounds, rewards summed over the repeat, ``terminated`` set when the
    episode ended by the task rather than by its time limit."""

    def __init__(self, env_id: str, seed: int, action_repeat: int) -> None:
        self.env = gym.make(env_id)
        space = self.env.observation_space
        if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 1):
            raise ValueError(f"{env_id}'s observation is {space}, not a flat vector: give a state-based id")
        self.low, self.high = self.env.action_space.low, self.env.action_space.high
        self.action_dim, self.action_repeat = int(self.env.action_space.shape[0]), action_repeat
        self.horizon = self.env.spec.max_episode_steps or 1000  # agent steps per episode, at most
        self.seed, self.terminated, self.episode_return = seed, False, 0.0

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self.seed)
        self.seed, self.terminated, self.episode_return = None, False, 0.0  # seeded once, then the env's own stream
        return np.asarray(obs, np.float32)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool]:
        action = self.low + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (self.high - self.low)
        reward, over = 0.0, False
        for _ in range(self.action_repeat):
            obs, r, self.terminated, truncated, _ = self.env.step(action)
            reward += float(r)
            over = self.terminated or truncated
            if over:
                break
        self.episode_return += reward
        return np.asarray(obs, np.float32), reward, over


def make_env(args: argparse.Namespace, seed: int) -> StateEnv | GymStateEnv:
    """The suite's task for a dmc id, else the gymnasium env."""
    if dmc.is_dmc_id(args.env_id):
        return StateEnv(args.env_id, seed, args.action_repeat, args.drop, args.add_geom, args.blur)
    return GymStateEnv(args.env_id, seed, args.action_repeat)


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class StatePolicy(nn.Module):
    """visppo's ActorCritic with an MLP where the CNN was: shared features, one hidden layer per head,
    the actor's last layer at gain 0.01, a learned state-independent log-std."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: int = 256, init_log_std: float = -0.5,
                 layers: int = 2) -> None:
        super().__init__()
        root2 = 2 ** 0.5
        self.encoder = tanh_layers(obs_dim, hidden, layers)  # the shared trunk, model.shared_layers' shape
        self.actor = nn.Sequential(_layer(hidden, hidden, root2), nn.Tanh(), _layer(hidden, action_dim, 0.01))
        self.critic = nn.Sequential(_layer(hidden, hidden, root2), nn.Tanh(), _layer(hidden, 1, 1.0))
        self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Normal, torch.Tensor]:
        features = self.encoder(obs)
        return torch.distributions.Normal(self.actor(features), self.log_std.exp()), self.critic(features).squeeze(-1)


def evaluate(policy: StatePolicy, args: argparse.Namespace, episodes: int = 10) -> list[float]:
    """Deterministic returns (the Gaussian's mean) of ``episodes`` episodes, seeds 5000, 5001, ..."""
    returns = []
    for i in range(episodes):
        env = make_env(args, EVAL_SEED + i)
        obs, over = env.reset(), False
        while not over:
            with torch.no_grad():
                action = policy(torch.as_tensor(obs[None]))[0].mean[0].numpy()
            obs, _, over = env.step(action)
        returns.append(env.episode_return)
    return returns


def collect(policy: StatePolicy, envs: list[StateEnv], obs: np.ndarray, num_steps: int, gamma: float,
            lam: float, finished: list[float], noise: ColoredNoise | None = None
            ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """One rollout of ``num_steps`` per env; finished episodes' returns are appended to ``finished``."""
    T, N = num_steps, len(envs)
    roll = {k: torch.zeros(T, N) for k in ("logp", "values", "rewards", "terminated", "truncated", "final_values")}
    roll["obs"], roll["actions"] = torch.zeros(T, N, obs.shape[1]), torch.zeros(T, N, envs[0].action_dim)
    for t in range(T):
        with torch.no_grad():
            dist, value = policy(torch.as_tensor(obs))
            action = dist.sample() if noise is None else dist.mean + dist.stddev * noise.sample()
        roll["obs"][t], roll["actions"][t], roll["values"][t] = torch.as_tensor(obs), action, value
        roll["logp"][t] = dist.log_prob(action).sum(-1)
        for i, env in enumerate(envs):
            next_obs, roll["rewards"][t, i], over = env.step(action[i].numpy())
            if over and env.terminated:  # the task ended it: nothing to bootstrap
                roll["terminated"][t, i] = 1.0
            elif over:  # a time limit: bootstrap from the final state's value
                roll["truncated"][t, i] = 1.0
                with torch.no_grad():
                    roll["final_values"][t, i] = policy(torch.as_tensor(next_obs[None]))[1][0]
            if over:  # then start the next episode
                finished.append(env.episode_return)
                next_obs = env.reset()
                if noise is not None:
                    noise.restart(i)
            obs[i] = next_obs
    with torch.no_grad():
        last_value = policy(torch.as_tensor(obs))[1]
    roll["advantages"], roll["returns"] = compute_gae(
        roll["rewards"], roll["values"], last_value, roll["terminated"], roll["truncated"],
        roll["final_values"], gamma, lam)
    return roll, obs


def update(policy: StatePolicy, optimizer: torch.optim.Optimizer, roll: dict[str, torch.Tensor],
           args: argparse.Namespace) -> None:
    """``args.epochs`` passes over the rollout in minibatches, the trainer's loss and clip."""
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in roll.items()}
    n = flat["logp"].shape[0]
    for _ in range(args.epochs):
        for index in torch.randperm(n).split(args.minibatch):
            dist, values = policy(flat["obs"][index])
            adv = flat["advantages"][index]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            loss, _ = ppo_loss(dist.log_prob(flat["actions"][index]).sum(-1), flat["logp"][index], adv,
                               values, flat["values"][index], flat["returns"][index], dist.entropy().sum(-1),
                               clip_coef=0.2, clip_value=False, value_coef=0.5, entropy_coef=0.0)
            optimizer.zero_grad()
            loss.mean().backward()
            nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
            optimizer.step()


def train(args: argparse.Namespace) -> list[dict]:
    """Train and evaluate every ``args.eval_every`` agent steps; returns the evaluation rows."""
    torch.manual_seed(args.seed)
    envs = [make_env(args, args.seed * 1000 + i) for i in range(args.num_envs)]
    obs = np.stack([env.reset() for env in envs])
    policy = StatePolicy(obs.shape[1], envs[0].action_dim, init_log_std=args.init_log_std, layers=args.layers)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr, eps=1e-5)
    iterations = max(1, args.steps // (args.num_envs * args.num_steps))
    finished: list[float] = []
    noise = None
    if args.noise_beta:
        noise = ColoredNoise(args.noise_beta, args.num_envs, envs[0].action_dim, envs[0].horizon, args.seed)
    rows, next_eval, start = [], args.eval_every, time.perf_counter()
    for it in range(iterations):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * (1.0 - it / iterations)
        roll, obs = collect(policy, envs, obs, args.num_steps, args.gamma, args.gae_lambda, finished, noise)
        update(policy, optimizer, roll, args)
        step = (it + 1) * args.num_envs * args.num_steps
        if step >= next_eval or it == iterations - 1:
            next_eval += args.eval_every
            returns = evaluate(policy, args)
            rows.append({"step": step, "train_return": float(np.mean(finished[-2 * args.num_envs:])) if finished else None,
                         "eval_return": float(np.mean(returns)), "eval_std": float(np.std(returns)),
                         "log_std": [round(x, 3) for x in policy.log_std.tolist()],
                         "minutes": round((time.perf_counter() - start) / 60, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("env_id", help="a DeepMind Control id (dmc:reacher-easy) or a gymnasium id with a vector "
                                  "observation (Reacher-v5)")
    p.add_argument("--steps", type=int, default=500_000, help="agent steps")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4, help="Adam's rate at the start, annealed to 0")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--minibatch", type=int, default=256)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--init-log-std", type=float, default=-0.5)
    p.add_argument("--layers", type=int, default=2, help="shared tanh layers of 256 before the heads' own layer")
    p.add_argument("--action-repeat", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=50_000, help="agent steps between evaluations")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--drop", nargs="+", default=(), metavar="KEY", help="leave these observation entries out")
    p.add_argument("--add-geom", nargs="+", default=(), metavar="NAME",
                   help="add these geoms' world positions (x, y, z) to the state")
    p.add_argument("--blur", nargs="+", default=[], metavar="KEY=STD",
                   help="add Gaussian noise of this std to an observation entry at every step")
    p.add_argument("--noise-beta", type=float, default=0.0,
                   help="exploration noise's colour: 0 white (independent per step), 0.5-1 correlated in time")
    p.add_argument("--json", type=Path, help="write the evaluation rows and the arguments here")
    args = p.parse_args(argv)
    try:
        args.blur = {k: float(v) for k, v in (item.split("=", 1) for item in args.blur)}
    except ValueError:
        p.exit(2, f"error: --blur takes KEY=STD pairs such as to_target=0.03, got {' '.join(args.blur)}\n")
    if args.layers < 1:
        p.exit(2, f"error: --layers must be at least 1, got {args.layers}\n")
    if dmc.is_dmc_id(args.env_id):
        try:
            dmc._suite()
        except dmc.SuiteUnavailable as exc:
            p.exit(2, f"error: {exc}\n")
    elif args.drop or args.add_geom or args.blur:
        p.exit(2, "error: --drop, --add-geom and --blur read DeepMind Control's observation: give a dmc id\n")
    try:
        make_env(args, 0)
    except ValueError as exc:
        p.exit(2, f"error: {exc}\n")
    except Exception as exc:  # gymnasium's own: an unknown id, a missing dependency
        p.exit(2, f"error: {args.env_id!r}: {str(exc).splitlines()[0]}\n")
    torch.set_num_threads(args.threads)
    rows = train(args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "evaluations": rows},
                                        indent=1))


if __name__ == "__main__":
    main()

"""Temporally correlated exploration noise for the Gaussian policy (``model.noise_beta``).

PPO samples each step's action as ``mean + std * eps`` with ``eps`` independent across steps
(white noise). A reaching arm needs many steps pushed the same way to get anywhere new; white
noise mostly cancels itself out. ``ColoredNoise`` gives each env a unit-variance sequence whose
power falls as ``1 / f**beta`` (Eberhard et al. 2023 for off-policy methods; Hollenstein et al.
2023 for PPO, where beta 0.5 did best), drawn with ``colorednoise`` a sequence at a time
and restarted when that env's episode ends. Each step's marginal is still ``N(0, 1)``, so the
policy's log-prob of the action stays the Gaussian's, as in Hollenstein et al.; evaluation and
the deterministic policy are unchanged (the mean).
"""

from __future__ import annotations

import colorednoise
import numpy as np
import torch

NOISE_SEQUENCE_STEPS = 1000
"""Steps of one drawn sequence in training: a DMC episode's 500 agent steps and a gymnasium
MuJoCo task's 1000 fit in one, so their noise has no seam."""


class ColoredNoise:
    """Per-env ``1/f**beta`` Gaussian noise of shape ``[num_envs, action_dim]`` per step.

    ``length`` is how many steps one drawn sequence lasts: an episode longer than that goes on
    with a fresh sequence. Reproducible from ``seed``; ``state_dict`` saves the stream and each env's place in it.
    """

    def __init__(self, beta: float, num_envs: int, action_dim: int, length: int, seed: int) -> None:
        if length < 2:
            raise ValueError(f"ColoredNoise length must be >= 2, got {length}")
        self.beta, self.length, self.action_dim = float(beta), int(length), int(action_dim)
        self.rng = np.random.default_rng(seed)
        self.series = np.stack([self._draw() for _ in range(num_envs)])  # [N, length, action_dim]
        self.t = np.zeros(num_envs, dtype=np.int64)

    def _draw(self) -> np.ndarray:
        """One sequence, ``[length, action_dim]``: each action dimension independent."""
        return colorednoise.powerlaw_psd_gaussian(self.beta, (self.action_dim, self.length),
                                                  random_state=self.rng).T

    def sample(self) -> torch.Tensor:
        """This step's noise for every env, then advance; a finished sequence is replaced."""
        for i in np.flatnonzero(self.t >= self.length):
            self.restart(i)
        out = self.series[np.arange(len(self.t)), self.t]
        self.t += 1
        return torch.as_tensor(out, dtype=torch.float32)

    def restart(self, index) -> None:
        """A fresh sequence for each env in ``index`` (their episodes ended)."""
        for i in np.atleast_1d(index):
            self.series[i], self.t[i] = self._draw(), 0

    def state_dict(self) -> dict:
        """The stream and where every env is in its sequence (tensors and plain values: checkpoints
        are read with ``weights_only=True``)."""
        return {"rng": self.rng.bit_generator.state, "series": torch.from_numpy(self.series.copy()),
                "t": torch.from_numpy(self.t.copy())}

    def load_state_dict(self, state: dict) -> None:
        """Go on exactly where the saved noise was (a resumed run draws what it would have drawn)."""
        if tuple(state["series"].shape) != self.series.shape:
            raise ValueError(f"noise state of shape {tuple(state['series'].shape)} does not fit {self.series.shape}")
        self.rng.bit_generator.state = state["rng"]
        self.series, self.t = state["series"].numpy().copy(), state["t"].numpy().astype(np.int64)

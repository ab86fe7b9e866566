"""Env seeds that do not overlap by construction: training and evaluation never share one, and
runs and envs share one only by a hash's chance.

A gymnasium vector env reset with ``seed=s`` seeds env ``i`` with ``s + i``, so two runs whose
seeds differ by less than the number of envs would replay each other's episodes, and an
evaluation reset with a small seed would replay a training episode. Here every seed is drawn
from a ``numpy.random.SeedSequence`` of its coordinates, and the top bit of a 32-bit episode
seed names its stream: training episodes have it clear, evaluation episodes set, so the two
sets are disjoint by construction (not merely unlikely to meet). Within a stream the seeds are
31-bit hashes: two of n episodes (of any runs and envs) share one with probability about
n^2 / 2^32, a repeated start state now and then over tens of thousands of episodes.
"""

from __future__ import annotations

import numpy as np

TRAIN = 0
"""The stream of training episodes: episode seeds in ``[0, 2**31)``."""
EVAL = 1
"""The stream of evaluation episodes: episode seeds in ``[2**31, 2**32)``."""


def _draw(*entropy: int) -> int:
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1, np.uint32)[0])


def env_seed(run_seed: int, rank: int, env_index: int) -> int:
    """The base seed of training env ``env_index`` on process ``rank`` of a run seeded ``run_seed``."""
    if min(run_seed, rank, env_index) < 0:
        raise ValueError(f"seeds are non-negative, got run {run_seed}, rank {rank}, env {env_index}")
    return _draw(run_seed, rank, env_index)


def episode_seed(base: int, episode: int, stream: int) -> int:
    """The reset seed of episode ``episode`` of an env whose base seed is ``base``, in ``stream``."""
    if stream not in (TRAIN, EVAL):
        raise ValueError(f"stream must be TRAIN (0) or EVAL (1), got {stream}")
    return (stream << 31) | (_draw(stream, base, episode) >> 1)


def stream_of(seed: int) -> int:
    """Which stream an episode seed belongs to."""
    return int(seed) >> 31 & 1

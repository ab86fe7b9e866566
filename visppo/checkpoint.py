"""Checkpoints that are never half-written and never execute code when loaded.

Saving writes a temporary file in the same directory, fsyncs it, and renames
it over the target: a crash at any point leaves either the old complete file
or the new complete file. Loading uses ``torch.load(weights_only=True)``, which
refuses pickled objects other than tensors and plain containers.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from visppo.config import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says which file and why."""


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file; ``mkstemp`` makes 0600 ones."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically (temp file + fsync + rename + dir fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file (JSON, YAML) so that it is either complete or absent."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint safely; anything but tensors and plain data is refused."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: give a run directory or a .pt file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unsafe content"
        raise CheckpointError(f"checkpoint {path} was refused: it holds objects other than tensors "
                              f"and plain data ({first[:160]}); only load files you trust") from None
    except Exception as exc:  # truncated or not a torch file
        raise CheckpointError(f"checkpoint {path} is corrupt or not a visppo checkpoint "
                              f"({type(exc).__name__}): use another checkpoint") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a visppo checkpoint (no 'model' entry)")
    return ckpt


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch global RNG states, as plain data that weights_only accepts."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

"""Files written whole or not at all (a leaf: imports only visppo.errors).

A write goes to a temporary file in the target's directory, is fsynced, and is renamed over
the target; then the directory is fsynced. A crash at any point leaves either the old complete
file or the new complete one, never half of one, and at worst a hidden ``.NAME.*.tmp`` file
that the run-directory lock sweeps (:func:`visppo.checkpoint.run_dir_lock`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from visppo.errors import UserError


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file; ``mkstemp`` makes 0600 ones."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode a plain ``mkdir`` would give a new folder; ``mkdtemp`` makes 0700 ones."""
    return 0o777 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[IO], None], binary: bool) -> None:
    """Write ``path`` so that it is either the old complete file or the new complete one:
    a temporary file in the same directory, fsynced, renamed over ``path``, directory fsynced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # text: UTF-8, as visppo reads it back; newline="": written as given (csv ends its own lines)
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as f:
            write(f)
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
    atomic_write(path, lambda f: f.write(text), binary=False)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a binary file so that it is either complete or absent."""
    atomic_write(path, lambda f: f.write(data), binary=True)


def check_writable(path: Path, what: str) -> Path:
    """Check an output's path before the work that makes it, so a bad one fails first: its nearest
    existing folder must be a writable directory. Missing folders are made only when the file is
    written (a refused command leaves nothing behind)."""
    if path.is_dir():
        raise UserError(f"{what} output {path} is a directory: give a file name")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"cannot write the {what} output {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the {what} output {path}: {folder} is not writable")
    return path

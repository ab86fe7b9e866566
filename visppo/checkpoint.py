"""Every read and write of checkpoints: never half-written, never executing code when loaded.

Saving goes through :mod:`visppo.atomic` (a temporary file in the same directory, fsynced,
renamed over the target): a crash at any point leaves either the old complete file or the new
complete file. Loading uses ``torch.load(weights_only=True)``, which refuses pickled objects
other than tensors and plain containers.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import random
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from visppo import distributed
from visppo.atomic import atomic_write, atomic_write_bytes, file_mode
from visppo.config import (
    CODE_PREFIX,
    RESUMABLE,
    Config,
    build_config,
    differences,
    load_config,
    not_resumable,
    read_config_file,
    to_dict,
)
from visppo.errors import ConfigError, UserError

UNREADABLE = frozenset({errno.EACCES, errno.EPERM, errno.EIO})
"""The errors of a file that cannot be read, as opposed to one that is not a checkpoint (torch
reports a truncated file as an OSError of another errno)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says which file and why."""


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically. A failed write (a full disk) is the OSError it was:
    torch's zip writer reports it as a RuntimeError ("unexpected pos") whose context holds it."""
    def save(f) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            cause = exc.__context__
            if isinstance(cause, OSError):
                raise OSError(cause.errno, cause.strerror, str(path)) from None
            raise

    atomic_write(path, save, binary=True)


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint safely; anything but tensors and plain data is refused."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: give a run directory or a .pt file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" not in str(exc).lower():  # garbage, not a pickle whose classes were refused
            raise CheckpointError(f"checkpoint {path} is corrupt or not a visppo checkpoint "
                                  f"(UnpicklingError){_other_checkpoints(path)}") from None
        raise CheckpointError(f"checkpoint {path} was refused: it holds objects other than tensors "
                              f"and plain data ({refused_global(exc)}); only load files you trust") from None
    except Exception as exc:  # truncated or not a torch file (torch reports some as OSErrors), or unreadable
        if isinstance(exc, OSError) and exc.errno in UNREADABLE:
            raise CheckpointError(f"checkpoint {path} cannot be read ({exc.strerror or exc}): fix its "
                                  "permissions or give another checkpoint") from None
        raise CheckpointError(f"checkpoint {path} is corrupt or not a visppo checkpoint "
                              f"({type(exc).__name__}){_other_checkpoints(path)}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a visppo checkpoint (no 'model' entry)")
    bad = non_finite(ckpt["model"])
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite weights ({bad}): it cannot act or "
                              f"train{_other_checkpoints(path)}")
    return ckpt


def refused_global(exc: Exception) -> str:
    """What torch's weights-only unpickler refused, from its message (a few paragraphs of advice,
    with terminal escape codes): "unsupported global NAME", or the refusal's first words."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", text, re.IGNORECASE)  # both of torch's wordings
    if found:
        return f"unsupported global {found.group(1)}"
    return " ".join(text.split())[:120] or "unsafe content"


def non_finite(state: Any) -> str:
    """The first tensor of a state dict with a NaN or infinite value (its name), or ''."""
    if not isinstance(state, dict):
        return ""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            return str(key)
    return ""


def _other_checkpoints(path: Path) -> str:
    """What to do instead of a bad checkpoint: the others of its run, newest written first (after a
    resume from an earlier one, the abandoned branch's higher numbers are older), as commands."""
    others = _newest_first(p for p in path.parent.glob("iter_*.pt") if p != path)
    if path.parent.name != "checkpoints" or not others:
        return ": use another checkpoint"
    return (f": use an earlier one of the run, e.g. visppo train --resume {others[0]} (or visppo eval "
            f"{others[0]}); the run has {', '.join(p.name for p in others[:4])}")


def _iteration_of(path: Path) -> int:
    """N of ``iter_N.pt``, by number: past iteration 999,999 the names grow a digit and sort wrong."""
    digits = path.stem.removeprefix("iter_")
    return int(digits) if digits.isdigit() else -1


def _newest_first(paths) -> list[Path]:
    """Checkpoints, the most recently written first (the name breaks ties)."""
    return sorted(paths, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)


def read_weights_file(path: Path) -> dict:
    """A weights file for ``model.encoder_weights`` (a state dict, or a visppo checkpoint), read
    safely; a ConfigError says what is wrong with it."""
    if not path.is_file():
        raise ConfigError(f"model.encoder_weights: {path} is not a file: give a torchvision state dict, a "
                          "visppo checkpoint, imagenet or none")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        if isinstance(exc, OSError) and exc.errno in UNREADABLE:
            raise ConfigError(f"model.encoder_weights: {path} cannot be read ({exc.strerror or exc}): fix "
                              "its permissions or give another file") from None
        raise ConfigError(f"model.encoder_weights: cannot read {path} with torch.load(weights_only=True) "
                          f"({str(exc).splitlines()[0][:120]}): give a state dict of tensors or a visppo "
                          "checkpoint") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"model.encoder_weights: {path} holds a {type(obj).__name__}, not a state dict")
    state = obj["model"] if isinstance(obj.get("model"), dict) else obj  # a visppo checkpoint's, or itself
    bad = next(((k, v) for k, v in state.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))), None)
    if bad is not None:
        what = str(path) if state is obj else f"{path}'s 'model' entry"
        raise ConfigError(f"model.encoder_weights: {what} is not a state dict: its entry {bad[0]!r} holds a "
                          f"{type(bad[1]).__name__}, where a state dict maps names to tensors")
    nan = non_finite(state)
    if nan:  # else the first rollout's NaN actions would read as the env's fault
        raise ConfigError(f"model.encoder_weights: {path} holds non-finite weights ({nan}): give another file")
    return obj


def describe_mismatch(expected: dict[str, torch.Tensor], got: dict[str, Any], theirs: str = "file") -> str:
    """What keeps state dict ``got`` from loading into a module whose state dict is ``expected``:
    missing and unexpected keys and shape mismatches, a few of each; empty when it fits."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k} {tuple(got[k].shape)} vs {tuple(expected[k].shape)}" for k in expected
              if k in got and isinstance(got[k], torch.Tensor) and got[k].shape != expected[k].shape]
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         (f"shape mismatch ({theirs} vs model)", shapes)):
        if items:
            more = f" ... (+{len(items) - 4} more)" if len(items) > 4 else ""
            parts.append(f"{label}: {', '.join(items[:4])}{more}")
    return "; ".join(parts)


REMOVED_HEADS = ("decoder.", "invdyn.", "reward_head.")
"""Modules of removed keys (model.recon_size, model.invdyn, model.reward_head) that older checkpoints hold."""
REMOVED_BUFFERS = ("kp_count", "kp_mean", "kp_m2")
"""Buffers of spatial_softmax's removed model.keypoint_norm."""
REMOVED_VALUE_NORM = ("value_norm.", "value_count", "value_mean", "value_var")
"""The critic's target statistics of the removed model.norm_value, under their names before and
after they moved into a ValueNorm module."""


def without_removed_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """A policy state dict without the tensors of removed features: the auxiliary heads, the
    keypoint statistics, the value statistics (model.norm_value's) and a critic encoder that
    reads no pixels (model.privileged_critic's). What remains must still fit the model (the
    caller checks)."""
    state_only_critic = not any(k.startswith("critic_encoder.pixels.") for k in state)

    def removed(key: str) -> bool:
        return (key.startswith(REMOVED_HEADS + REMOVED_VALUE_NORM) or key.rsplit(".", 1)[-1] in REMOVED_BUFFERS
                or (state_only_critic and key.startswith("critic_encoder.")))

    return {k: v for k, v in state.items() if not removed(k)}


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
        # one state per GPU of the machine that saved it: a run moved to one with fewer GPUs keeps
        # those it has (more GPUs: the others keep their seeds)
        for index, gpu_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(gpu_state, index)


# --------------------------------------------------------------------------- a run's checkpoints



def rank_state(generator: torch.Generator, envs, reward_scale=None) -> dict:
    """The states a process's own streams need to resume: RNGs, minibatch order, env episode
    counters, and with ``ppo.norm_reward`` the return statistics (a resumed run's envs start new
    episodes, so their running returns start again from 0)."""
    state = {"rng": rng_state(), "minibatch_generator": generator.get_state(),
             "env_episodes": [int(e) for e in envs.get_attr("episode")]}
    if reward_scale is not None:
        state["reward_scale"] = reward_scale.state_dict()
    return state


def save_checkpoint(run_dir: Path, cfg: Config, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None, iteration: int, global_step: int,
                    memory_sizes: dict[str, int], ranks: list[dict], recent: list[dict],
                    ended_since_row: int = 0, updates_since_row: tuple[int, int] = (0, 0), amp: str = "") -> Path:
    """Write ``checkpoints/latest.pt`` and ``iter_N.pt`` atomically; keep the last few numbered ones.

    ``ranks``: every process's :func:`rank_state` (one under a single process); rank 0's
    streams are also saved at the top level, where a single process reads them. ``recent``: the
    last finished episodes, whose mean the log reports, so a resumed run's logged return goes on
    over the same window rather than starting again from the episodes after the cut.
    ``ended_since_row``: the episodes finished since the last metrics row, which the next row's
    ``episodes`` column counts (a checkpoint can fall between rows when ``run.log_every`` > 1);
    ``updates_since_row`` likewise, the optimizer steps taken and skipped.
    ``amp``: the precision the update ran in (``train.amp`` resolved: :func:`check_same_precision`).
    """
    folder = run_dir / "checkpoints"
    state = {
        "model": policy.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler else {},
        "config": to_dict(cfg),
        "iteration": iteration,
        "global_step": global_step,
        **ranks[0],
        "memory_sizes": memory_sizes,
        "recent_episodes": list(recent),  # plain floats and ints (rollout.collect): weights_only loads them
        "episodes_since_row": int(ended_since_row),
        "updates_since_row": [int(n) for n in updates_since_row],
        "amp": amp,
    }
    if len(ranks) > 1:
        state.update(world_size=len(ranks), ranks=ranks)
    numbered = folder / f"iter_{iteration:06d}.pt"
    atomic_save(state, folder / "latest.pt")  # first: a kill between the two saves leaves it the newest
    atomic_save(state, numbered)
    # Only this iteration and those before it are pruned: a resume from an older iter_N.pt leaves the
    # abandoned branch's later files, which must not take the places of this branch's newest ones.
    old = sorted((path for path in folder.glob("iter_*.pt") if _iteration_of(path) <= iteration), key=_iteration_of)
    for path in old[: max(0, len(old) - cfg.run.keep_checkpoints)]:
        path.unlink(missing_ok=True)
    return folder / "latest.pt"


def resume_paths(source: str | Path) -> tuple[Path, Path]:
    """``--resume`` takes a run directory (its ``checkpoints/latest.pt``) or one of its checkpoints
    (``RUN/checkpoints/iter_N.pt``): returns (run directory, checkpoint)."""
    source = Path(source)
    if source.is_file() and source.parent.name == "checkpoints":
        run_dir, latest = source.parent.parent, source
    elif source.is_file():
        raise ConfigError(f"--resume {source} is a file: give its run directory ({source.parent}) or one "
                          "of the run's checkpoints/iter_N.pt")
    else:
        run_dir, latest = source, source / "checkpoints" / "latest.pt"
    if not run_dir.is_dir() or not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {source} is not a run directory (no config.yaml): give the directory "
                          "a run printed at its start, or one of its checkpoints/iter_N.pt")
    if not latest.is_file():
        numbered = _newest_first((run_dir / "checkpoints").glob("iter_*.pt"))
        if numbered:  # latest.pt was deleted or moved away: the newest numbered one
            return run_dir, numbered[0]
        raise ConfigError(f"--resume {source}: the run stopped before its first checkpoint, there is nothing "
                          f"to resume; start it again with: visppo train {run_dir / 'config.yaml'} "
                          f"run.dir=NEW_DIR (or delete {run_dir})")
    return run_dir, latest


def trained_env_id(run_dir: Path) -> str:
    """The env.id in a run's config.yaml ('' when it has none visppo can read)."""
    try:
        return str(read_config_file(Path(run_dir) / "config.yaml").get("env", {}).get("id", ""))
    except (UserError, OSError):
        return ""


def resume_command(run_dir: Path) -> str:
    """How to resume ``run_dir``: ``visppo train --resume``, or for a run on an env built in code the
    Python call that hands the env back (no other process can build it)."""
    if trained_env_id(run_dir).startswith(CODE_PREFIX):
        return f"visppo.train(resume={str(run_dir)!r}, env=<the env>)"
    return f"visppo train --resume {run_dir}"


SOURCE = "resumed_from"
"""In a checkpoint loaded to resume (not in the file): (path, mtime_ns, size) as it was read."""


def check_unchanged(ckpt: dict) -> None:
    """Under the run-dir lock: the checkpoint file read to resume is still as it was read. The run
    that held the lock may have saved since; resuming its older state would redo that work over it.
    (A checkpoint a caller built, not read from a file, has nothing to check.)"""
    if SOURCE not in ckpt:
        return
    path, mtime_ns, size = ckpt[SOURCE]
    now = Path(path).stat()
    if (now.st_mtime_ns, now.st_size) != (mtime_ns, size):
        raise UserError(f"{path} was written while this resume started (the run was still going): resume again")


def make_head(run_dir: Path, ckpt: dict) -> None:
    """A resume from an earlier ``iter_N.pt`` makes that file the run's ``latest.pt`` before the logs
    drop what came after it, so that a crash before the branch's first checkpoint leaves
    ``--resume RUN`` on the branch, not on the abandoned one whose metrics rows are gone."""
    if SOURCE not in ckpt:
        return
    path = Path(ckpt[SOURCE][0])
    latest = run_dir / "checkpoints" / "latest.pt"
    if path.resolve() != latest.resolve():
        atomic_write_bytes(latest, path.read_bytes())


RESUME_KEYS = ("config", "optimizer", "iteration", "global_step", "rng", "minibatch_generator", "env_episodes")
"""What a checkpoint needs besides its weights to go on training (:func:`restore`)."""


def load_for_resume(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, dict]:
    """The saved config (with the few allowed overrides) and the checkpoint of a run directory
    (or of one of its ``checkpoints/*.pt`` files)."""
    source = run_dir
    run_dir, latest = resume_paths(source)
    for item in overrides:
        key, eq, _ = item.partition("=")
        key = key.strip()
        if not eq or "/" in key:  # a config file's path: the saved config is the run's
            raise ConfigError(f"'{item}' is not a key=value override: --resume takes the run's saved config")
        if key not in RESUMABLE:
            raise ConfigError(f"{key} cannot change when resuming (only {', '.join(RESUMABLE)}); "
                              "start a new run for other changes")
    check_link(run_dir, latest)
    read = latest.stat()
    ckpt = load(latest)
    ckpt[SOURCE] = (str(latest), read.st_mtime_ns, read.st_size)  # for check_unchanged and make_head; never saved
    missing = [key for key in RESUME_KEYS if key not in ckpt]
    if missing or not (isinstance(ckpt["config"], dict) and isinstance(ckpt["config"].get("run"), dict)):
        raise CheckpointError(f"checkpoint {latest} cannot be resumed: it has no "
                              f"{', '.join(missing) or 'run section in its config'} (visppo train writes "
                              "them all): resume from another checkpoint or start a new run")
    saved = ckpt["config"]
    saved["run"]["dir"] = str(run_dir)
    why = not_resumable(saved)
    if why:
        raise ConfigError(f"{latest} {why}")
    cfg = build_config(saved, overrides, source=str(latest))
    check_same_run(run_dir, latest, cfg, {item.split("=", 1)[0].strip() for item in overrides}, source)
    if cfg.ppo.total_steps <= ckpt["global_step"]:
        raise ConfigError(f"ppo.total_steps={cfg.ppo.total_steps} is already reached (the run is at step "
                          f"{ckpt['global_step']}): raise it to train further")
    return cfg, ckpt


def check_link(run_dir: Path, checkpoint: Path) -> None:
    """A run's checkpoint is a file of its own ``checkpoints/``, not a link to another run's."""
    if checkpoint.is_symlink() and checkpoint.resolve().parent != (run_dir / "checkpoints").resolve():
        raise ConfigError(f"{checkpoint} is a link to {checkpoint.resolve()}, outside this run's checkpoints: "
                          f"resume that run itself, or replace the link with one of {run_dir / 'checkpoints'}")


def check_same_run(run_dir: Path, checkpoint: Path, cfg: Config, overridden: set[str] = frozenset(),
                   source: str | Path | None = None) -> None:
    """The checkpoint's config is the run's (its config.yaml) but for the keys a resume may change:
    else it is another run's checkpoint put in this run's place, and resuming it would go on with
    that run under this one's name (or config.yaml was edited, which a resume does not read). A key a
    resume may change, edited in config.yaml rather than given as an override, is refused too: the
    resume would go on with the checkpoint's value and write it back over the edit (``source``: what
    ``--resume`` was given, for the command to suggest). A config.yaml visppo cannot read is left to
    the user."""
    try:
        on_disk = load_config(run_dir / "config.yaml")  # run.dir is not compared (a moved run's differs)
    except (UserError, OSError):
        return
    for name, value, theirs in differences(cfg, on_disk):
        if name == "run.dir" or name in overridden:
            continue
        if name in RESUMABLE:
            raise ConfigError(f"{run_dir / 'config.yaml'} says {name}={theirs} but the checkpoint has {value}: "
                              f"a resume reads its settings from the checkpoint, so give the change as an "
                              f"override: visppo train --resume {source or run_dir} {name}={theirs}")
        raise ConfigError(f"{checkpoint} is not this run's checkpoint: it was trained with {name}={value}, "
                          f"and {run_dir / 'config.yaml'} says {theirs}: resume the run it belongs to, put "
                          f"this run's own checkpoint back, or set {name} back to {value} in config.yaml "
                          "if it was edited")


def check_same_precision(cfg: Config, ckpt: dict, amp: str) -> None:
    """A resume trains in the precision its run trained in unless ``train.amp`` is given anew:
    ``auto`` resolved again on another machine (a CPU run resumed on a GPU) would switch it silently."""
    saved = ckpt.get("amp")
    if not saved or saved == amp or cfg.train.amp != ckpt["config"]["train"]["amp"]:
        return  # an older checkpoint, the same precision, or a train.amp given on purpose
    raise ConfigError(f"the run trained with amp {saved}, and its train.amp={cfg.train.amp} picks {amp} here: "
                      f"resume with train.amp={saved} to go on as it trained, or train.amp={amp} to switch")


def resume_for_rank(ckpt: dict, ctx: distributed.Context) -> dict:
    """The checkpoint as this process resumes it: under torchrun, with its own rank's streams
    (RNGs, minibatch order, env episodes); refused if the number of processes changed."""
    saved = int(ckpt.get("world_size", 1))
    if saved != ctx.world:
        how = "without torchrun" if saved == 1 else f"with torchrun and {saved} processes in all"
        raise ConfigError(f"this run was trained by {saved} process(es), not {ctx.world}: resume it {how} "
                          "(another count would change the rollout and minibatch sizes)")
    return {**ckpt, **ckpt["ranks"][ctx.rank]} if ctx.enabled else ckpt


def restore(ckpt: dict, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler | None, generator: torch.Generator, envs,
            reward_scale=None) -> tuple[int, int]:
    """Load every state a checkpoint carries; returns (first iteration to run, global step).
    Call :func:`set_rng_state` (``ckpt["rng"]``) last, once building has drawn what it draws."""
    try:
        policy.load_state_dict(without_removed_tensors(ckpt["model"]))
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint does not fit this model: {str(exc).splitlines()[0][:200]}") from None
    if scaler and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    generator.set_state(ckpt["minibatch_generator"])
    envs.set_attr("episode", list(ckpt["env_episodes"]))
    if reward_scale is not None and "reward_scale" in ckpt:
        reward_scale.load_state_dict(ckpt["reward_scale"])
    return int(ckpt["iteration"]) + 1, int(ckpt["global_step"])


# --------------------------------------------------------------------------- one writer per run directory

LOCK_FILE = ".lock"
"""In the run directory: ``flock``-ed by the process that writes the run, holding its pid."""


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` while the block runs; another process's run there is
    refused (a UserError naming its pid). The kernel drops the lock when its holder ends in any way
    (SIGKILL included), so a stale lock never blocks. Temporary files of saves that a kill
    interrupted are swept here, under the lock: no other process can be writing them."""
    fd = _open_lock_file(run_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                _no_locks_here(run_dir, exc)
            else:
                raise UserError(in_use_message(run_dir, _holder(fd))) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        for stale in [*run_dir.glob(".*.tmp"), *(run_dir / "checkpoints").glob(".*.tmp"),
                      *(run_dir / "videos").glob(".iter_*")]:  # video.Frames' temporaries
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def in_use_message(run_dir: Path, pid: str) -> str:
    return (f"run.dir {run_dir} is in use by another visppo process (pid {pid}): wait for it to finish or stop "
            "it, or choose another run.dir")


def in_use(run_dir: Path) -> str | None:
    """The pid of the live visppo process that holds ``run_dir``'s lock, or None (no lock file, or
    nobody holds it). Writes nothing: a check before a new run's directory exists."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # closing the descriptor lets it go
    except OSError as exc:
        return _holder(fd) if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) else None
    finally:
        os.close(fd)


def _open_lock_file(run_dir: Path) -> int:
    """The lock file's descriptor; a directory this user cannot write is a ConfigError."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, file_mode())
    except OSError as exc:
        raise ConfigError(f"run.dir {run_dir} cannot be written ({exc.strerror}): choose a directory you "
                          "can write, or fix its permissions") from None


def _no_locks_here(run_dir: Path, exc: OSError) -> None:
    """A file system without ``flock`` (some network mounts): go on unlocked, and say so."""
    if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
        raise exc
    print(f"visppo: warning: run.dir {run_dir} cannot be locked here ({exc.strerror}): make sure no other "
          "visppo process writes it", file=sys.stderr)


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote (it writes it just after locking: wait a moment for it)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "unknown"

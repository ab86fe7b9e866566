"""``train(cfg)``: collect -> values -> GAE -> update -> log -> checkpoint, once per iteration.

:func:`train` is the loop, top to bottom; :func:`start_run` builds what it needs (a
:class:`Run`) and every step of the loop is a function named after what it does.

Under ``torchrun`` every process runs ``train``: each its own envs (distinct seeds) and
rollout, one policy whose minibatch gradients are averaged over the processes
(:mod:`visppo.distributed`); rank 0 alone logs and writes the run directory.
"""

from __future__ import annotations

import errno
import math
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from visppo import checkpoint as ckpt_io
from visppo import distributed, seeding
from visppo.atomic import atomic_write_text
from visppo.buffer import ReturnScale, RolloutBuffer, compute_gae, explained_variance, obs_of
from visppo.builders import (
    anneal_lr,
    build_optimizer,
    build_policy,
    check_memory,
    frozen_steps,
    resolve_device,
    seed_everything,
)
from visppo.config import CODE_PREFIX, Config, to_yaml
from visppo.deploy import SPEC_FILE, write_spec
from visppo.encoders import FreezeSchedule
from visppo.env_check import check_env
from visppo.envs import check_env_id, close_vector_env, make_env, make_vector_env, preload_before_gl
from visppo.errors import ConfigError, EnvError, RunError, Stopped, UserError
from visppo.evaluate import run_episodes
from visppo.health import activation_health, probe_index
from visppo.metrics import (
    Logger,
    PhaseTimer,
    Span,
    WandbTracker,
    check_metrics,
    check_tracking,
    iteration_profiler,
    open_tracker,
)
from visppo.policy import ActorCritic
from visppo.ppo import MemorySizes, UpdateResult, UpdateSetup, compute_values, update
from visppo.precision import RunPrecision, for_run
from visppo.probe import probe
from visppo.rollout import ActingCopy, RolloutState, collect


def train(cfg: Config, resume: dict | None = None) -> Path:
    """Train a policy as ``cfg`` says; returns the run directory.

    ``resume`` is a checkpoint (from :func:`visppo.checkpoint.load_for_resume`): the run goes on
    in its directory from the iteration after it, with every state restored.
    Under torchrun, all sizes in ``cfg`` are per process: the iteration's rollout is
    ``world * num_envs * num_steps``, an optimizer step averages ``world`` minibatches.
    """
    with start_run(cfg, resume) as run:
        timer = PhaseTimer()
        for iteration in range(run.first_iteration, run.num_iterations + 1):
            if cfg.ppo.anneal_lr:
                anneal_lr(run.optimizer, iteration, run.num_iterations)
            with timer("collect"):
                episodes = collect_rollout(run)
            with timer("values"):
                last_value = compute_values(run.policy, run.buffer, run.setup, run.recompute_logp_old)
                b = run.buffer
                b.advantages[:], b.returns[:] = compute_gae(b.rewards, b.values, last_value, b.terminated,
                                                            b.truncated, b.final_values, cfg.ppo.gamma,
                                                            cfg.ppo.gae_lambda)
                value_fit = explained_variance(b.values, b.returns)  # the critic's, before the update
            with timer("update"):
                run.policy.train()
                result = update(run.policy, run.optimizer, run.buffer, run.setup)
            run.global_step += run.global_rollout
            lap = Span(*timer.lap(), steps=run.global_rollout)  # this iteration's phases, wall time, steps
            with timer("log"):  # eval, logging, checkpoint: in the next lap's time/log
                log(run, iteration, episodes, result, value_fit, lap)
                check_divergence(run, result)
                maybe_checkpoint(run, iteration)
            stop_if_signalled(run, iteration)  # SIGINT / SIGTERM: final checkpoint, then Stopped
    return run.dir


# --------------------------------------------------------------------------- the run's state


@dataclass
class Run:
    """Everything the loop works with, built once by :func:`start_run`."""

    cfg: Config
    ctx: distributed.Context
    dir: Path
    device: torch.device
    rollout_device: torch.device
    precision: RunPrecision
    envs: gym.vector.VectorEnv
    policy: ActorCritic
    optimizer: torch.optim.Optimizer
    setup: UpdateSetup
    buffer: RolloutBuffer
    state: RolloutState
    acting: ActingCopy | None
    first_iteration: int = 1
    global_step: int = 0
    logger: Logger | None = None
    """Rank 0's; None on the other ranks."""
    profiler: torch.profiler.profile | None = None
    """With ``train.profile``: records the third iteration (rank 0)."""
    recent: list[dict] = field(default_factory=list)
    """The last 100 finished episodes (all ranks'), for the logged means."""
    ended_since_row: int = 0
    """Episodes finished (all ranks) since the last metrics row: its ``episodes`` column."""
    updates_since_row: tuple[int, int] = (0, 0)
    """Optimizer steps taken and skipped (a non-finite gradient) since the last metrics row: its
    ``optimizer_steps`` and ``skipped_steps`` columns."""
    since_row: Span = field(default_factory=Span)
    """The laps since the last metrics row, which its steps/s and ``time/*`` cover. Not checkpointed:
    after a resume the next row covers the iterations since the resume (its steps/s is still the
    steps of its span over the span's wall time)."""
    bad_in_a_row: int = 0
    """Optimizer steps skipped in a row for a non-finite loss or gradient."""
    flat_critic: int = 0
    """Iterations in a row whose critic explained none of the returns (see warn_if_flat_critic)."""
    signals: SignalRequest | None = None
    """The SIGINT / SIGTERM received during the run (asks for a final checkpoint)."""
    reward_scale: ReturnScale | None = None
    """With ``ppo.norm_reward``: the return statistics that scale the buffer's rewards."""

    @property
    def global_rollout(self) -> int:
        """Samples per iteration, all ranks together."""
        return self.ctx.world * self.cfg.rollout_size

    @property
    def num_iterations(self) -> int:
        return math.ceil(self.cfg.ppo.total_steps / self.global_rollout)

    @property
    def recompute_logp_old(self) -> bool:
        return self.cfg.ppo.recompute_logp_old or self.precision.recompute_logp_old


@contextmanager
def start_run(cfg: Config, resume: dict | None) -> Iterator[Run]:
    """Check the input, lock the run directory, join the other processes, build envs, policy,
    optimizer and buffer, restore a checkpoint, open the logs; close everything on the way out."""
    ctx = distributed.Context.from_env()  # torchrun's RANK, WORLD_SIZE...; a world of one without them
    check_tracking(cfg)  # run.wandb without the wandb extra: refused before anything is written
    run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
    with env_faults(run_dir), ExitStack() as stack, disk_errors(run_dir):
        signals = stack.enter_context(deferred_signals(run_dir))  # stops the start; saves once armed
        if ctx.is_main:  # rank 0 alone writes the run directory
            if resume is None:
                check_run_dir(run_dir)  # a new run's directory is created (and locked) once built
            else:
                stack.enter_context(ckpt_io.run_dir_lock(run_dir))
        resume = ckpt_io.resume_for_rank(resume, ctx) if resume is not None else None
        check_env_id(cfg.env.id)
        device = ctx.place(resolve_device(cfg.train.device))  # cuda -> cuda:LOCAL_RANK
        rollout_device = (device if cfg.rollout.device == "auto"
                          else ctx.place(resolve_device(cfg.rollout.device, "rollout.device"), "rollout.device"))
        precision = for_run(cfg.train, device, rollout_device)
        if resume is not None:
            ckpt_io.check_same_precision(cfg, resume, precision.update.name)
        check_memory(cfg, device if cfg.memory.buffer_device == "device" else torch.device("cpu"), device)
        check_user_env(cfg)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed_everything(cfg.train.seed, cfg.train.deterministic, device)  # the same model on every rank
        if distributed.init(ctx, device):  # gloo on CPUs, NCCL on GPUs; nothing when alone
            stack.push(lambda kind, *_: distributed.destroy(clean=kind is None))  # barrier unless failing
        if ctx.enabled:
            run_dir = Path(distributed.broadcast(str(run_dir)))  # rank 0's: a default name holds the time
        envs = make_vector_env(cfg)
        stack.push(lambda kind, *_: close_vector_env(envs, failing=kind is not None))
        run = build_run(cfg, ctx, run_dir, device, rollout_device, precision, envs, resume)
        run.signals = signals
        if ctx.is_main:
            if resume is None:
                created = not run_dir.exists()
                stack.enter_context(ckpt_io.run_dir_lock(run_dir))
                check_run_dir(run_dir)  # again, under the lock: another process may have started here
                stack.enter_context(forget_if_unstarted(run_dir, created))
            else:
                ckpt_io.check_unchanged(resume)
            open_logs(run, resume)  # a bad metrics.csv is refused here, before it changes
            stack.callback(run.logger.close)
            run.profiler = iteration_profiler(run_dir) if cfg.train.profile else None
        with run.profiler or _nothing():
            signals.armed = True
            yield run


def check_user_env(cfg: Config) -> None:
    """The env's spaces, one reset and one step (visppo.env_check), before anything is written and
    before the run's seeds are set (the check draws from nothing the run uses)."""
    preload_before_gl()  # before the check env's GL context (see envs.preload_before_gl)
    check_env(cfg, make_env)


@contextmanager
def disk_errors(run_dir: Path) -> Iterator[None]:
    """A full disk (or quota) while writing checkpoints or logs: one RunError. Writes are atomic,
    so what is on disk stays readable and the run resumes from its last checkpoint (if it wrote
    one; else it starts again)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        then = (f"resume with {ckpt_io.resume_command(run_dir)} (its last checkpoint is complete)"
                if has_checkpoint(run_dir) else "start the run again (it had written no checkpoint)")
        raise RunError(f"no space left on the device writing {exc.filename or run_dir}: free some space, "
                       f"then {then}") from None


@contextmanager
def env_faults(run_dir: Path) -> Iterator[None]:
    """The env's error during the run (an :class:`EnvError`, raised below the loop), once the run
    has closed: the same line, with what the run left on disk and how to go on from it."""
    try:
        yield
    except EnvError as exc:
        if has_checkpoint(run_dir):
            kept = (f"the run's last checkpoint is kept: once the env is fixed, {ckpt_io.resume_command(run_dir)} "
                    "goes on from it")
        elif (run_dir / "config.yaml").exists():
            kept = f"the run had written no checkpoint: delete {run_dir} and start it again"
        else:
            raise  # before the run wrote anything (the start check): nothing to say about the disk
        raise EnvError(f"{exc}; {kept}") from None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint a resume can start from."""
    folder = run_dir / "checkpoints"
    return (folder / "latest.pt").is_file() or any(folder.glob("iter_*.pt"))


@contextmanager
def forget_if_unstarted(run_dir: Path, created: bool) -> Iterator[None]:
    """A new run that ends (an error, a signal) before it logged a row or wrote a checkpoint leaves
    nothing behind: its config.yaml, policy.json, lock file and logs (TensorBoard's events, W&B's files) go
    (and the directory, if the run made it), so
    the same run.dir starts afresh rather than asking for a resume that has nothing to resume."""
    def logs() -> set[Path]:  # what opening the logs makes: TensorBoard's events, W&B's files
        return {p for pattern in ("events.out.tfevents.*", "wandb", WandbTracker.ID_FILE) for p in run_dir.glob(pattern)}

    before = logs()  # the folder's own stay
    try:
        yield
    except BaseException:
        if not (run_dir / "metrics.csv").exists() and not (run_dir / "checkpoints").exists():
            for name in ("config.yaml", SPEC_FILE, ckpt_io.LOCK_FILE):
                (run_dir / name).unlink(missing_ok=True)
            for made in logs() - before:
                if made.is_dir():
                    shutil.rmtree(made, ignore_errors=True)
                else:
                    made.unlink(missing_ok=True)
            if created:
                with suppress(OSError):  # not empty: the user's files stay
                    run_dir.rmdir()
        raise


class SignalRequest:
    """SIGINT / SIGTERM during a run: the first asks the loop for a final checkpoint at the end of
    the iteration in progress; a second aborts at once (the last checkpoint on disk is complete)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.signum = 0
        self.armed = False
        """True once the loop runs; before, a signal stops the start at once (nothing to save)."""

    def __call__(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            raise Stopped(f"visppo: stopped by {name} before the first iteration; no checkpoint was due", signum)
        if self.signum:
            os.write(2, f"error: {name} again: aborted without a final checkpoint; resume from the last "
                        f"one with: {ckpt_io.resume_command(self.run_dir)}\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"visppo: {name}: writing a checkpoint at the end of this iteration (send it again to "
                    "abort at once)\n".encode())


@contextmanager
def deferred_signals(run_dir: Path) -> Iterator[SignalRequest]:
    """Route SIGINT and SIGTERM to a :class:`SignalRequest` while the run lives (main thread only:
    Python delivers signals there); the previous handlers come back on the way out."""
    request = SignalRequest(run_dir)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_run(cfg: Config, ctx: distributed.Context, run_dir: Path, device: torch.device,
              rollout_device: torch.device, precision: RunPrecision, envs: gym.vector.VectorEnv,
              resume: dict | None) -> Run:
    """Policy, optimizer, buffer and the update's setup; every state from ``resume`` restored."""
    policy = build_policy(cfg, envs.single_observation_space, envs.single_action_space, device,
                          load_weights=resume is None)  # a resumed run takes the checkpoint's
    optimizer = build_optimizer(cfg, policy)
    seed = distributed.rank_seed(cfg.train.seed, ctx.rank)  # the seed itself on rank 0
    generator = torch.Generator().manual_seed(seed)  # minibatch order, apart from acting
    if ctx.enabled:
        distributed.broadcast_parameters(policy)
    reward_scale = ReturnScale(cfg.ppo.num_envs, cfg.ppo.gamma) if cfg.ppo.norm_reward else None
    first_iteration, global_step = 1, 0
    if resume is not None:
        first_iteration, global_step = ckpt_io.restore(resume, policy, optimizer, precision.update.scaler,
                                                       generator, envs, reward_scale)
    steps = frozen_steps(cfg)  # before_step: the trunks frozen for that many optimizer steps
    freeze = FreezeSchedule(policy.encoders(), steps, optimizer) if steps else None
    on_device = cfg.memory.buffer_device == "device"
    buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.ppo.num_envs, envs.single_observation_space,
                           envs.single_action_space, pin_memory=device.type == "cuda" and not on_device,
                           device=device if on_device else "cpu", channels_last=precision.channels_last)
    state = RolloutState.start(envs, seed=[seeding.env_seed(cfg.train.seed, ctx.rank, i)  # not another run's (but by chance)
                                           for i in range(cfg.ppo.num_envs)])
    if reward_scale is not None:  # every env starts a new episode here, a resumed run's too:
        reward_scale.running.zero_()  # no discounted return carries over from the cut one
    if ctx.rank:  # its own action noise; rank 0 keeps a single process's streams
        seed_everything(seed, cfg.train.deterministic, device)
    if resume is not None:
        ckpt_io.set_rng_state(resume["rng"])  # last: building the model drew from the RNGs
    setup = UpdateSetup(cfg.ppo, memory_sizes(cfg, device, resume, precision.update.name, verbose=ctx.is_main), device,
                        precision.update, generator, before_step=freeze, across_ranks=ctx.enabled)
    acting = ActingCopy(policy, rollout_device) if rollout_device != device else None
    return Run(cfg, ctx, run_dir, device, rollout_device, precision, envs, policy, optimizer, setup,
               buffer, state, acting, first_iteration, global_step, reward_scale=reward_scale,
               recent=list(resume.get("recent_episodes", [])) if resume is not None else [],  # older: none
               ended_since_row=int(resume.get("episodes_since_row", 0)) if resume is not None else 0,
               updates_since_row=tuple(resume.get("updates_since_row", (0, 0))) if resume is not None else (0, 0))


def open_logs(run: Run, resume: dict | None) -> None:
    """Rank 0: create the run directory (only now: bad input leaves nothing behind), write the
    resolved config (and, for an env built in code, which no other process can make, policy.json:
    the run's checkpoints then load anywhere, whatever ends the run, a SIGKILL too), open the
    logger and say where the run lives. A resume from an earlier checkpoint makes it the run's
    head before the logger drops what came after it (:func:`visppo.checkpoint.make_head`)."""
    cfg, sizes, resuming = run.cfg, run.setup.sizes, resume is not None
    run.dir.mkdir(parents=True, exist_ok=True)
    if not resuming:
        atomic_write_text(run.dir / "config.yaml", to_yaml(cfg))
    if cfg.env.id.startswith(CODE_PREFIX) and not (resuming and (run.dir / SPEC_FILE).is_file()):
        write_spec(run.dir, cfg)  # a resume too, of a run whose policy.json was never written
    check_metrics(run.dir / "metrics.csv")  # a resume refused for it starts no W&B run and changes nothing
    tracker = open_tracker(cfg, run.dir, resuming)  # and one W&B refuses drops no row, event or video
    try:
        if resume is not None:  # whatever stops the run from here on, --resume RUN goes on from this branch
            ckpt_io.make_head(run.dir, resume)
        run.logger = Logger(run.dir, run.num_iterations * run.global_rollout, initial_step=run.global_step,
                            tensorboard=cfg.run.tensorboard, progress=cfg.run.progress, tracker=tracker,
                            first_iteration=run.first_iteration)
    except BaseException:
        if tracker is not None:
            tracker.close()
        raise
    if resuming:  # the directory says what the run now is (a raised ppo.total_steps): tools read it
        atomic_write_text(run.dir / "config.yaml", to_yaml(cfg))
    run.logger.message(
        f"visppo: {'resuming' if resuming else 'run directory'} {run.dir}  (train on {run.device}, act on "
        f"{run.rollout_device}, amp {run.precision.update.name}, {run.num_iterations} iterations of "
        f"{run.global_rollout} steps, minibatch {run.ctx.world * cfg.ppo.minibatch_size}, micro-batch "
        f"{sizes.micro}, inference chunk {sizes.chunk}{processes_note(cfg, run.ctx)})")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def default_run_dir(cfg: Config) -> Path:
    """``runs/<task>-<date>-<time>-<random>``: runs started in the same second get different names
    (and the run-dir lock refuses the astronomically unlikely clash)."""
    task = cfg.env.id.replace("/", "-").replace(":", "-")
    return Path("runs") / f"{task}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


RUN_FILES = ("config.yaml", "metrics.csv", "checkpoints")
"""What a run writes in its directory; a new run refuses a directory holding any of them."""


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory we could not write, or one that already holds (part of) a run."""
    long = [part for part in run_dir.parts if len(os.fsencode(part)) > 255]
    if long:  # every file system's limit on one name: checked before exists() raises on it
        raise ConfigError(f"run.dir {run_dir}: the name {long[0][:40]}... is {len(os.fsencode(long[0]))} bytes long "
                          "(at most 255): choose a shorter run.dir")
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found:
        pid = ckpt_io.in_use(run_dir)
        if pid is not None:  # a live run that has not saved yet: not one to delete
            raise UserError(ckpt_io.in_use_message(run_dir, pid))
        if "config.yaml" in found and has_checkpoint(run_dir):
            resume = f"resume it with {ckpt_io.resume_command(run_dir)}"
        elif "config.yaml" in found:
            resume = "delete it (it stopped before its first checkpoint: there is nothing to resume)"
        else:
            resume = "move them away"
        raise ConfigError(f"run.dir {run_dir} already holds a run ({', '.join(found)}): choose another "
                          f"run.dir, or {resume}")
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"run.dir {run_dir} cannot be created: {parent} is not a writable directory")


def processes_note(cfg: Config, ctx: distributed.Context) -> str:
    """For the run's first line under torchrun: how the global sizes split over the processes."""
    if not ctx.enabled:
        return ""
    return (f"; {ctx.world} processes, each {cfg.ppo.num_envs} envs x {cfg.ppo.num_steps} steps and "
            f"minibatch {cfg.ppo.minibatch_size}")


def sizes_found_on(device: torch.device, amp: str) -> str:
    """Where memory sizes hold, as a checkpoint records it: the kind of device and the precision."""
    return f"{device.type} {amp}"


def memory_sizes(cfg: Config, device: torch.device, resume: dict | None, amp: str = "",
                 verbose: bool = True) -> MemorySizes:
    """The micro-batch and chunk sizes to start with: a resumed run keeps the ones it had (an OOM
    may have halved them) where it trained on the same kind of device in the same precision;
    ``auto`` asks the probe for the largest under ``memory.budget``, and a fixed size beside an
    ``auto`` one must fit that budget too."""
    saved = resume.get("memory_sizes") if resume is not None else None
    here = sizes_found_on(device, amp)
    if saved and saved.get("on", here) == here:  # an older checkpoint does not say: kept
        return MemorySizes(saved["micro"], saved["chunk"])
    micro, chunk = cfg.memory.micro_batch_size, cfg.memory.infer_chunk_size
    if "auto" in (micro, chunk):
        fixed = {}  # a size given beside an auto one: measured at that size (0: the whole minibatch)
        if micro != "auto":
            fixed["micro_batch"] = min(int(micro) or cfg.ppo.minibatch_size, cfg.ppo.minibatch_size)
        if chunk != "auto":
            fixed["infer_chunk"] = min(int(chunk), cfg.rollout_size)
        found = probe(cfg, cfg.memory.budget, str(device), mode="fake", fixed=fixed)
        micro, chunk = found.micro_batch_size, found.infer_chunk_size
        if verbose:
            print(f"visppo: memory.budget {cfg.memory.budget} on {device}: micro-batch {micro}, "
                  f"inference chunk {chunk} (probe peak {found.peak_bytes / 2**30:.2f} GiB)")
    return MemorySizes(int(micro) or cfg.ppo.minibatch_size, int(chunk))


# --------------------------------------------------------------------------- the loop's steps


def collect_rollout(run: Run) -> list[dict]:
    """Act in the envs for one rollout (on the rollout device's copy, refreshed once per iteration);
    with ``ppo.norm_reward``, the buffer's rewards are then scaled (the episodes' returns stay raw)."""
    run.policy.eval()
    if run.acting is not None:
        run.acting.sync(run.policy)
    actor = run.acting.module if run.acting is not None else run.policy
    episodes = collect(run.envs, actor, run.buffer, run.state, run.rollout_device,
                       run.precision.acting.autocast(), chunk=run.setup.sizes.chunk)
    if run.reward_scale is not None:
        scale_rewards(run.buffer, run.reward_scale, run.ctx)
    return episodes


def scale_rewards(buffer: RolloutBuffer, scale: ReturnScale, ctx: distributed.Context) -> None:
    """Add this rollout's discounted returns (every rank's: one scale for all) to the statistics,
    then divide the rollout's rewards by their std."""
    ended = (buffer.terminated | buffer.truncated).cpu()
    returns = scale.discounted_returns(buffer.rewards.cpu(), ended)
    if ctx.enabled:
        returns = torch.cat([r.reshape(-1) for r in distributed.all_gather(returns)])
    scale.add(returns)
    buffer.rewards /= scale.std


def log(run: Run, iteration: int, episodes: list[dict], result: UpdateResult, value_fit: float,
        lap: Span) -> None:
    """One metrics row (and a periodic evaluation when due), written by rank 0; ``value_fit`` is the
    critic's explained variance on rank 0's rollout; ``lap`` is this iteration's timing. A row's
    steps/s and phase times cover every lap since the previous row (``run.log_every`` > 1: several);
    the progress line shows this iteration's."""
    if run.ctx.enabled:  # every rank's episodes, for the logs
        episodes = [e for part in distributed.all_gather(episodes) for e in part]
    run.recent = (run.recent + episodes)[-100:]
    run.ended_since_row += len(episodes)
    run.updates_since_row = (run.updates_since_row[0] + result.optimizer_steps,
                             run.updates_since_row[1] + result.skipped_steps)
    run.since_row = run.since_row.plus(lap)
    scalars = iteration_scalars(iteration, run.ended_since_row, run.updates_since_row, run.recent, run.optimizer,
                                result, value_fit, run.since_row)
    last = iteration == run.num_iterations
    evaluated = bool(run.cfg.run.eval_every) and (iteration % run.cfg.run.eval_every == 0 or last)
    if run.cfg.run.eval_every:  # the columns exist from the first row: the CSV header is fixed then
        scalars.update({"eval/return": float("nan"), "eval/success": float("nan")})
        if run.ctx.is_main and evaluated:
            scalars.update(periodic_eval(run.policy, run.cfg, run.dir, iteration, run.device))
    warn_if_flat_critic(run, value_fit)
    if run.logger is not None:
        if iteration % run.cfg.run.log_every == 0 or last or evaluated:  # an evaluation always gets its row
            scalars.update(health_scalars(run))
            run.logger.log(run.global_step, scalars)
            run.ended_since_row, run.updates_since_row, run.since_row = 0, (0, 0), Span()
        run.logger.progress(run.global_rollout, progress_line(scalars, lap))
    if run.profiler is not None:
        run.profiler.step()  # one profiler step per iteration


def health_scalars(run: Run) -> dict[str, float]:
    """Dead features, saturated tanh units and a Gaussian's mean beyond the action bounds
    (visppo.health) on samples spread over this rollout, after the update: the next rollout's policy."""
    parts = probe_index(run.buffer.size).split(run.setup.sizes.chunk)  # health.PROBE_SAMPLES in all
    batches = ((obs_of(b), b["actions"]) for b in (run.buffer.gather(part, run.device) for part in parts))
    with run.setup.precision.autocast():
        return activation_health(run.policy, batches, run.envs.single_action_space)


def check_divergence(run: Run, result: UpdateResult) -> None:
    """Stop the run after ``train.max_bad_steps`` non-finite optimizer steps in a row."""
    carried = 0 if result.optimizer_steps else run.bad_in_a_row  # a good step ends the streak
    run.bad_in_a_row = carried + result.trailing_skips  # fp16's calibration skips are not in it
    if run.bad_in_a_row >= run.cfg.train.max_bad_steps:
        latest = run.dir / "checkpoints" / "latest.pt"
        kept = (f"the last good checkpoint is {latest}" if latest.is_file()
                else "it had written no checkpoint yet")
        amp = run.precision.update.name
        fix = "lower ppo.learning_rate" + (f" or try train.amp=off (it is {amp})" if amp != "off" else "")
        raise RunError(f"training diverged: {run.bad_in_a_row} optimizer steps in a row had a non-finite "
                       f"loss or gradient (train.max_bad_steps={run.cfg.train.max_bad_steps}); {kept}: "
                       f"{fix} and start a new run")


FLAT_CRITIC_ITERATIONS = 20


def warn_if_flat_critic(run: Run, value_fit: float) -> None:
    """Say once when the critic has explained none of the returns (|explained variance| < 1e-3)
    for 20 iterations in a row: its value is then a constant (a saturated hidden layer, seen on
    DMC cartpole-balance), the advantages are the returns' noise, and the policy drifts."""
    run.flat_critic = run.flat_critic + 1 if abs(value_fit) < 1e-3 else 0
    if run.flat_critic == FLAT_CRITIC_ITERATIONS and run.logger is not None:
        run.logger.message(f"warning: the critic has explained none of the returns for {FLAT_CRITIC_ITERATIONS} "
                           "iterations (value/explained_variance ~ 0): its value is a constant; large, alike "
                           "returns saturate it: try ppo.norm_reward=true")


def maybe_checkpoint(run: Run, iteration: int) -> None:
    """Every ``run.checkpoint_every`` iterations and at the end."""
    if iteration % run.cfg.run.checkpoint_every == 0 or iteration == run.num_iterations:
        save_checkpoint(run, iteration)


def save_checkpoint(run: Run, iteration: int) -> None:
    """Every rank's streams, saved by rank 0."""
    mine = ckpt_io.rank_state(run.setup.generator, run.envs, run.reward_scale)
    ranks = distributed.all_gather(mine) if run.ctx.enabled else [mine]
    if run.ctx.is_main:
        sizes = {"micro": run.setup.sizes.micro, "chunk": run.setup.sizes.chunk,  # and where they held
                 "on": sizes_found_on(run.device, run.precision.update.name)}
        ckpt_io.save_checkpoint(run.dir, run.cfg, run.policy, run.optimizer, run.setup.precision.scaler,
                                iteration, run.global_step, sizes, ranks, run.recent, run.ended_since_row,
                                run.updates_since_row, run.precision.update.name)


def stop_if_signalled(run: Run, iteration: int) -> None:
    """After an iteration: on SIGINT / SIGTERM (any rank's), write the final checkpoint (unless
    this iteration wrote one) and raise :class:`Stopped`; a finished run just ends."""
    signum = run.signals.signum if run.signals is not None else 0
    if run.ctx.enabled:  # every rank stops after the same iteration
        signum = max(distributed.all_gather(signum))
    if not signum or iteration == run.num_iterations:
        return
    if iteration % run.cfg.run.checkpoint_every:
        save_checkpoint(run, iteration)
    raise Stopped(f"visppo: stopped by {signal.Signals(signum).name} at step {run.global_step}, checkpoint "
                  f"{run.dir / 'checkpoints' / 'latest.pt'}; resume with: {ckpt_io.resume_command(run.dir)}",
                  signum)


def periodic_eval(policy: ActorCritic, cfg: Config, run_dir: Path, iteration: int,
                  device: torch.device) -> dict[str, float]:
    """Deterministic evaluation episodes (and a video in ``videos/``) during training."""
    video = run_dir / "videos" / f"iter_{iteration:06d}.mp4" if cfg.run.eval_video else None
    if video is not None:
        video.parent.mkdir(exist_ok=True)
    policy.eval()
    result = run_episodes(policy, cfg, cfg.run.eval_episodes, deterministic=True,
                          seed=10**6 + iteration, video=video, device=device)
    success = result["success_rate"]
    return {"eval/return": result["mean_return"],
            "eval/success": float("nan") if success is None else success}


def iteration_scalars(iteration: int, ended: int, updates: tuple[int, int], recent: list[dict],
                      optimizer: torch.optim.Optimizer, result: UpdateResult, value_fit: float,
                      span: Span) -> dict[str, float]:
    """One row of metrics.csv: episode stats over the last 100 episodes, the ``ended`` episodes and
    the ``updates`` (optimizer steps taken, skipped) since the previous row, the last update's
    losses, the steps/s and phase times of ``span``, the laps since the previous row
    (``time/log`` holds the eval, logging and checkpoint of the iteration before each: 0 in the
    first row)."""
    seconds = {**span.seconds, "log": span.seconds.get("log", 0.0)}
    return {
        "iteration": iteration,
        "episode_return": _mean(e["return"] for e in recent),
        "episode_success": _mean(e["success"] for e in recent),
        "episodes": ended,
        "lr": optimizer.param_groups[0]["lr"],
        "steps_per_second": span.steps_per_second,
        "optimizer_steps": updates[0],
        "skipped_steps": updates[1],
        **{f"loss/{k}": v for k, v in result.losses().items()},
        "value/explained_variance": value_fit,
        **{f"time/{k}": v for k, v in seconds.items()},
    }


def progress_line(s: dict[str, float], lap: Span) -> str:
    """The progress bar's postfix: this iteration's speed and phase times (``lap``; a row's may cover
    several), the logged returns."""
    phases = " ".join(f"{k} {v:.1f}s" for k, v in lap.seconds.items())
    return (f"{lap.steps_per_second:.0f} sps, return {s['episode_return']:.2f}, "
            f"success {s['episode_success']:.2f}, {phases}")


def _mean(values) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")

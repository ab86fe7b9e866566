"""``train(cfg)``: collect -> score -> GAE -> update -> log -> checkpoint, once per iteration.

Under ``torchrun`` every process runs ``train``: each its own envs (distinct seeds) and
rollout, one policy whose gradients DDP averages (:mod:`visppo.distributed`); rank 0 alone
logs and writes the run directory.
"""

from __future__ import annotations

import math
import os
import random
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from visppo import checkpoint as ckpt_io
from visppo import distributed
from visppo.buffer import RolloutBuffer
from visppo.config import Config, ConfigError, RunError, build_config, to_dict, to_yaml
from visppo.encoders import FreezeSchedule
from visppo.envs import check_env_id, make_vector_env
from visppo.metrics import Logger, PhaseTimer, iteration_profiler
from visppo.policy import ActorCritic
from visppo.ppo import Evaluate, MemorySizes, resolve_precision, score_rollout, update
from visppo.rollout import ActingCopy, RolloutState, collect, to_torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name} but CUDA is not available here: use train.device=cpu or auto")
    return device


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed python, numpy and torch; with ``deterministic`` on CUDA, also pin cuDNN/cuBLAS.

    The CPU kernels visppo uses are deterministic already, and
    ``torch.use_deterministic_algorithms`` costs a heavy import of the compiler
    stack, so it is only switched on for CUDA.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def default_run_dir(cfg: Config) -> Path:
    task = cfg.env.id.replace("/", "-")
    return Path("runs") / f"{task}-{datetime.now():%Y%m%d-%H%M%S}"


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory we could not write, or one that already holds a run."""
    if (run_dir / "config.yaml").exists():
        raise ConfigError(f"run.dir {run_dir} already holds a run: choose another run.dir")
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"run.dir {run_dir} cannot be created: {parent} is not a writable directory")


def build_policy(cfg: Config, obs_space, action_space, device: torch.device,
                 load_weights: bool = True) -> ActorCritic:
    """The policy on ``device``, its encoders filled with ``model.encoder_weights`` (unless
    ``load_weights`` is false: when a checkpoint's state dict is loaded over it anyway)."""
    policy = ActorCritic(obs_space, action_space, cfg.model)
    if load_weights:
        policy.load_encoder_weights(cfg.model.encoder_weights)
    policy = policy.to(device)
    if cfg.train.channels_last:
        policy = policy.to(memory_format=torch.channels_last)
    return policy


def build_optimizer(cfg: Config, policy: ActorCritic) -> torch.optim.Adam:
    """Adam; with ``model.encoder_lr_scale`` != 1 the encoder trunks get their own param group at
    ``lr * scale``. Every group keeps its ``initial_lr``, which annealing scales, so the ratio holds.

    Fused: one kernel updates every parameter. On CPU torch's default is a
    per-parameter loop: 12 ms per step for the Nature CNN on this 2-core
    machine, against 1.7 ms fused (the same update up to float rounding)."""
    lr, scale = cfg.ppo.learning_rate, cfg.model.encoder_lr_scale
    trunk = {id(p) for p in policy.trunk_parameters()} if scale != 1.0 else set()
    groups = [{"params": [p for p in policy.parameters() if id(p) not in trunk], "lr": lr, "initial_lr": lr}]
    if trunk:
        groups.append({"params": policy.trunk_parameters(), "lr": lr * scale, "initial_lr": lr * scale})
    return torch.optim.Adam(groups, lr=lr, eps=cfg.ppo.adam_eps, fused=True)


def train(cfg: Config, resume: dict | None = None) -> Path:
    """Train a policy as ``cfg`` says; returns the run directory.

    ``resume`` is a checkpoint (from :func:`load_for_resume`): the run goes on
    in its directory from the iteration after it, with every state restored.
    Under torchrun, all sizes in ``cfg`` are per process: the iteration's rollout is
    ``world * num_envs * num_steps``, an optimizer step averages ``world`` minibatches.
    """
    ctx = distributed.Context.from_env()  # torchrun's RANK, WORLD_SIZE...; a world of one without them
    run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
    if resume is None and ctx.is_main:  # rank 0 alone writes the run directory
        check_run_dir(run_dir)
    if resume is not None:
        resume = resume_for_rank(resume, ctx)
    check_env_id(cfg.env.id)
    device = ctx.place(resolve_device(cfg.train.device))  # cuda -> cuda:LOCAL_RANK
    rollout_device = (device if cfg.rollout.device == "auto"
                      else ctx.place(resolve_device(cfg.rollout.device), "rollout.device"))
    try:
        precision = resolve_precision(cfg.train.amp, device)
        acting_amp = "auto" if cfg.train.amp == "fp16" and rollout_device.type != "cuda" else cfg.train.amp
        rollout_precision = resolve_precision(acting_amp, rollout_device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed, cfg.train.deterministic, device)  # the same model on every rank
    owns_group = distributed.init(ctx, device)  # gloo on CPUs, NCCL on GPUs; nothing when alone
    if ctx.enabled:
        run_dir = Path(distributed.broadcast(str(run_dir)))  # rank 0's: a default name holds the time

    envs = make_vector_env(cfg)
    try:
        policy = build_policy(cfg, envs.single_observation_space, envs.single_action_space, device,
                              load_weights=resume is None)  # a resumed run takes the checkpoint's
        optimizer = build_optimizer(cfg, policy)
        seed = distributed.rank_seed(cfg.train.seed, ctx.rank)  # the seed itself on rank 0
        generator = torch.Generator().manual_seed(seed)  # minibatch order, apart from acting
        first_iteration, global_step = 1, 0
        if resume is not None:
            first_iteration, global_step = restore(resume, policy, optimizer, precision, generator, envs)
        freeze = (FreezeSchedule(policy.encoders(), cfg.model.freeze_encoder_updates, optimizer)
                  if cfg.model.freeze_encoder_updates else None)  # before_step: trunks frozen for K steps
        acting = ActingCopy(policy, rollout_device) if rollout_device != device else None
        # the update's forward passes go through DDP, which averages the gradients over the ranks;
        # a frozen trunk gets no gradient, which DDP must look for (find_unused) instead of awaiting it
        ddp = (distributed.wrap(Evaluate(policy), device, find_unused=freeze is not None and freeze.frozen)
               if ctx.enabled else None)
        on_device = cfg.memory.buffer_device == "device"
        buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.ppo.num_envs, envs.single_observation_space,
                               envs.single_action_space, pin_memory=device.type == "cuda" and not on_device,
                               device=device if on_device else "cpu", channels_last=cfg.train.channels_last)
        state = RolloutState.start(envs, seed=cfg.train.seed + ctx.rank * cfg.ppo.num_envs)  # env i of rank r
        if ctx.rank:  # its own action noise; rank 0 keeps a single process's streams
            seed_everything(seed, cfg.train.deterministic, device)
        if resume is not None:
            ckpt_io.set_rng_state(resume["rng"])  # last: building the model drew from the RNGs
        global_rollout = ctx.world * cfg.rollout_size  # samples per iteration, all ranks together
        num_iterations = math.ceil(cfg.ppo.total_steps / global_rollout)
        sizes = memory_sizes(cfg, device, resume, verbose=ctx.is_main)

        if ctx.is_main:  # rank 0 alone logs and writes
            run_dir.mkdir(parents=True, exist_ok=True)  # only now: bad input leaves nothing behind
            if resume is None:
                (run_dir / "config.yaml").write_text(to_yaml(cfg))
            logger = Logger(run_dir, num_iterations * global_rollout, initial_step=global_step,
                            tensorboard=cfg.run.tensorboard, progress=cfg.run.progress)
            logger.message(f"visppo: {'resuming' if resume else 'run directory'} {run_dir}  (train on "
                           f"{device}, act on {rollout_device}, amp {precision.dtype or 'off'}, "
                           f"{num_iterations} iterations of {global_rollout} steps, minibatch "
                           f"{ctx.world * cfg.ppo.minibatch_size}, micro-batch {sizes.micro}, inference "
                           f"chunk {sizes.chunk}{processes_note(cfg, ctx)})")
        timer, recent, bad_in_a_row = PhaseTimer(), [], 0
        profiler = iteration_profiler(run_dir) if cfg.train.profile and ctx.is_main else None
        if profiler is not None:
            profiler.start()
        mark = time.perf_counter()  # steps/s spans a whole iteration: the previous one's logging too
        for iteration in range(first_iteration, num_iterations + 1):
            if cfg.ppo.anneal_lr:
                for group in optimizer.param_groups:
                    base = group.get("initial_lr", cfg.ppo.learning_rate)  # per group: keeps encoder_lr_scale
                    group["lr"] = base * (1.0 - (iteration - 1) / num_iterations)

            policy.eval()
            with timer("collect"):
                if acting is not None:
                    acting.sync(policy)  # once per iteration, never per step
                episodes = collect(envs, acting.module if acting else policy, buffer, state,
                                   rollout_device, rollout_precision.autocast())
            with timer("score"):
                last_obs = to_torch(state.obs, torch.device("cpu"))
                score_rollout(policy, buffer, last_obs, cfg.ppo, sizes, device, precision)
            policy.train()
            with timer("update"):
                result = update(policy, optimizer, buffer, cfg.ppo, sizes, None, device, precision,
                                generator, last_obs=last_obs, before_step=freeze, ddp=ddp)
            global_step += global_rollout

            if ctx.enabled:  # every rank's episodes, for the logs
                episodes = [e for part in distributed.all_gather(episodes) for e in part]
            recent = (recent + episodes)[-100:]
            now = time.perf_counter()
            scalars = iteration_scalars(iteration, episodes, recent, optimizer, result, timer.reset(),
                                        global_rollout / (now - mark))
            mark = now
            last = iteration == num_iterations
            with timer("log"):  # eval, logging, checkpoint: in the next row's time/log
                if cfg.run.eval_every:  # the columns exist from the first row: the CSV header is fixed then
                    scalars.update({"eval/return": float("nan"), "eval/success": float("nan")})
                    if ctx.is_main and (iteration % cfg.run.eval_every == 0 or last):
                        scalars.update(periodic_eval(policy, cfg, run_dir, iteration, device))
                if ctx.is_main:
                    if iteration % cfg.run.log_every == 0 or last:
                        logger.log(global_step, scalars)
                    logger.progress(global_rollout, progress_line(scalars))

                bad_in_a_row = result.trailing_skips if result.optimizer_steps else bad_in_a_row + result.skipped_steps
                if bad_in_a_row >= cfg.train.max_bad_steps:
                    raise RunError(f"training diverged: {bad_in_a_row} optimizer steps in a row had a non-finite "
                                   f"loss or gradient (train.max_bad_steps={cfg.train.max_bad_steps}); the last "
                                   f"good checkpoint is kept in {run_dir / 'checkpoints'}: lower "
                                   "ppo.learning_rate or try train.amp=off")
                if iteration % cfg.run.checkpoint_every == 0 or iteration == num_iterations:
                    ranks = distributed.all_gather(rank_state(generator, envs)) if ctx.enabled else None
                    if ctx.is_main:
                        save_checkpoint(run_dir, cfg, policy, optimizer, precision, generator, envs,
                                        iteration, global_step, sizes, ranks)
            if profiler is not None:
                profiler.step()
        if profiler is not None:
            profiler.stop()
        if ctx.is_main:
            logger.close()
    finally:
        envs.close()
        if owns_group:
            distributed.destroy()
    return run_dir


def processes_note(cfg: Config, ctx: distributed.Context) -> str:
    """For the run's first line under torchrun: how the global sizes split over the processes."""
    if not ctx.enabled:
        return ""
    return (f"; {ctx.world} processes, each {cfg.ppo.num_envs} envs x {cfg.ppo.num_steps} steps and "
            f"minibatch {cfg.ppo.minibatch_size}")


def memory_sizes(cfg: Config, device: torch.device, resume: dict | None,
                 verbose: bool = True) -> MemorySizes:
    """The micro-batch and chunk sizes to start with: a resumed run keeps the ones it had
    (an OOM may have halved them); ``auto`` asks the probe for the largest under ``memory.budget``."""
    if resume is not None and resume.get("memory_sizes"):
        return MemorySizes(**resume["memory_sizes"])
    micro, chunk = cfg.memory.micro_batch_size, cfg.memory.infer_chunk_size
    if "auto" in (micro, chunk):
        from visppo.probe import probe

        found = probe(cfg, cfg.memory.budget, str(device), mode="fake")
        micro = found.micro_batch_size if micro == "auto" else micro
        chunk = found.infer_chunk_size if chunk == "auto" else chunk
        if verbose:
            print(f"visppo: memory.budget {cfg.memory.budget} on {device}: micro-batch {micro}, "
                  f"inference chunk {chunk} (probe peak {found.peak_bytes / 2**30:.2f} GiB)")
    return MemorySizes(int(micro) or cfg.ppo.minibatch_size, int(chunk))


def periodic_eval(policy: ActorCritic, cfg: Config, run_dir: Path, iteration: int,
                  device: torch.device) -> dict[str, float]:
    """Deterministic evaluation episodes (and a video in ``videos/``) during training."""
    from visppo.evaluate import run_episodes

    video = run_dir / "videos" / f"iter_{iteration:06d}.mp4" if cfg.run.eval_video else None
    if video is not None:
        video.parent.mkdir(exist_ok=True)
    policy.eval()
    result = run_episodes(policy, cfg, cfg.run.eval_episodes, deterministic=True,
                          seed=10**6 + iteration, video=video, device=device)
    success = result["success_rate"]
    return {"eval/return": result["mean_return"],
            "eval/success": float("nan") if success is None else success}


def iteration_scalars(iteration: int, episodes: list[dict], recent: list[dict],
                      optimizer: torch.optim.Optimizer, result, seconds: dict[str, float],
                      steps_per_second: float) -> dict[str, float]:
    """One row of metrics.csv: episode stats over the last 100 episodes, losses, phase times
    (``time/log`` is the previous iteration's eval, logging and checkpoint: 0 in the first row)."""
    seconds = {**seconds, "log": seconds.get("log", 0.0)}
    return {
        "iteration": iteration,
        "episode_return": _mean(e["return"] for e in recent),
        "episode_success": _mean(e["success"] for e in recent),
        "episodes": len(episodes),
        "lr": optimizer.param_groups[0]["lr"],
        "steps_per_second": steps_per_second,
        "optimizer_steps": result.optimizer_steps,
        "skipped_steps": result.skipped_steps,
        **{f"loss/{k}": v for k, v in result.stats.items()},
        **{f"time/{k}": v for k, v in seconds.items()},
    }


def progress_line(s: dict[str, float]) -> str:
    phases = " ".join(f"{k[5:]} {v:.1f}s" for k, v in s.items() if k.startswith("time/"))
    return (f"{s['steps_per_second']:.0f} sps, return {s['episode_return']:.2f}, "
            f"success {s['episode_success']:.2f}, {phases}")


# --------------------------------------------------------------------------- checkpoints and resume

RESUMABLE = ("ppo.total_steps", "run.progress", "run.tensorboard", "run.log_every",
             "run.checkpoint_every", "run.keep_checkpoints", "train.threads", "train.max_bad_steps")
"""Keys a resumed run may change; everything else would make it a different run."""


def rank_state(generator: torch.Generator, envs) -> dict:
    """The states a process's own streams need to resume: RNGs, minibatch order, env episode counters."""
    return {"rng": ckpt_io.rng_state(), "minibatch_generator": generator.get_state(),
            "env_episodes": [int(e) for e in envs.get_attr("episode")]}


def save_checkpoint(run_dir: Path, cfg: Config, policy: ActorCritic, optimizer: torch.optim.Optimizer,
                    precision, generator: torch.Generator, envs, iteration: int, global_step: int,
                    sizes: MemorySizes | None = None, ranks: list[dict] | None = None) -> Path:
    """Write ``checkpoints/iter_N.pt`` and ``latest.pt`` atomically; keep the last few numbered ones.

    ``ranks``: under torchrun, every rank's :func:`rank_state` (saved as ``ranks``, with ``world_size``).
    """
    folder = run_dir / "checkpoints"
    state = {
        "model": policy.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": precision.scaler.state_dict() if precision.scaler else {},
        "config": to_dict(cfg),
        "iteration": iteration,
        "global_step": global_step,
        **rank_state(generator, envs),  # this process's (rank 0's)
        "memory_sizes": {"micro": sizes.micro, "chunk": sizes.chunk} if sizes else {},
    }
    if ranks is not None:
        state.update(world_size=len(ranks), ranks=ranks)
    numbered = folder / f"iter_{iteration:06d}.pt"
    for stale in folder.glob(".*.tmp"):  # left by a save that a kill interrupted
        stale.unlink(missing_ok=True)
    ckpt_io.atomic_save(state, numbered)
    ckpt_io.atomic_save(state, folder / "latest.pt")
    old = sorted(folder.glob("iter_*.pt"))
    for path in old[: max(0, len(old) - cfg.run.keep_checkpoints)]:
        path.unlink(missing_ok=True)
    return folder / "latest.pt"


def load_for_resume(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, dict]:
    """The saved config (with the few allowed overrides) and the checkpoint of a run directory."""
    run_dir = Path(run_dir)
    latest = run_dir / "checkpoints" / "latest.pt"
    if not run_dir.is_dir() or not (run_dir / "config.yaml").is_file() or not latest.is_file():
        raise ConfigError(f"--resume {run_dir} is not a run directory (no config.yaml and "
                          "checkpoints/latest.pt): give the directory a run printed at its start")
    ckpt = ckpt_io.load(latest)
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key not in RESUMABLE:
            raise ConfigError(f"{key} cannot change when resuming (only {', '.join(RESUMABLE)}); "
                              "start a new run for other changes")
    saved = ckpt["config"]
    saved["run"]["dir"] = str(run_dir)
    cfg = build_config(saved, overrides, source=str(latest))
    if cfg.ppo.total_steps <= ckpt["global_step"]:
        raise ConfigError(f"ppo.total_steps={cfg.ppo.total_steps} is already reached (the run is at step "
                          f"{ckpt['global_step']}): raise it to train further")
    return cfg, ckpt


def resume_for_rank(ckpt: dict, ctx: distributed.Context) -> dict:
    """The checkpoint as this process resumes it: under torchrun, with its own rank's streams
    (RNGs, minibatch order, env episodes); refused if the number of processes changed."""
    saved = int(ckpt.get("world_size", 1))
    if saved != ctx.world:
        how = "without torchrun" if saved == 1 else f"with torchrun and {saved} processes in all"
        raise ConfigError(f"this run was trained by {saved} process(es), not {ctx.world}: resume it {how} "
                          "(another count would change the rollout and minibatch sizes)")
    return {**ckpt, **ckpt["ranks"][ctx.rank]} if ctx.enabled else ckpt


def restore(ckpt: dict, policy: ActorCritic, optimizer: torch.optim.Optimizer, precision,
            generator: torch.Generator, envs) -> tuple[int, int]:
    """Load every state a checkpoint carries; returns (first iteration to run, global step)."""
    try:
        policy.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ckpt_io.CheckpointError(f"checkpoint does not fit this model: {str(exc).splitlines()[0][:200]}") from None
    if precision.scaler and ckpt.get("scaler"):
        precision.scaler.load_state_dict(ckpt["scaler"])
    generator.set_state(ckpt["minibatch_generator"])
    envs.set_attr("episode", list(ckpt["env_episodes"]))
    return int(ckpt["iteration"]) + 1, int(ckpt["global_step"])


def _mean(values) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")

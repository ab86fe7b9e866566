"""``train(cfg)``: collect -> score -> GAE -> update -> log -> checkpoint, once per iteration."""

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
from visppo.buffer import RolloutBuffer, compute_gae
from visppo.config import Config, ConfigError, to_dict, to_yaml
from visppo.envs import check_env_id, make_vector_env
from visppo.metrics import Logger, PhaseTimer
from visppo.policy import ActorCritic
from visppo.ppo import resolve_precision, score, update
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


def build_policy(cfg: Config, obs_space, action_space, device: torch.device) -> ActorCritic:
    policy = ActorCritic(obs_space, action_space, cfg.model).to(device)
    if cfg.train.channels_last:
        policy = policy.to(memory_format=torch.channels_last)
    return policy


def train(cfg: Config) -> Path:
    """Train a policy as ``cfg`` says; returns the run directory."""
    run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
    check_run_dir(run_dir)
    check_env_id(cfg.env.id)
    device = resolve_device(cfg.train.device)
    rollout_device = device if cfg.rollout.device == "auto" else resolve_device(cfg.rollout.device)
    try:
        precision = resolve_precision(cfg.train.amp, device)
        acting_amp = "auto" if cfg.train.amp == "fp16" and rollout_device.type != "cuda" else cfg.train.amp
        rollout_precision = resolve_precision(acting_amp, rollout_device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed, cfg.train.deterministic, device)

    envs = make_vector_env(cfg)
    try:
        policy = build_policy(cfg, envs.single_observation_space, envs.single_action_space, device)
        optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.ppo.learning_rate, eps=cfg.ppo.adam_eps)
        acting = ActingCopy(policy, rollout_device) if rollout_device != device else None
        buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.ppo.num_envs, envs.single_observation_space,
                               envs.single_action_space, pin_memory=device.type == "cuda")
        state = RolloutState.start(envs, seed=cfg.train.seed)
        generator = torch.Generator().manual_seed(cfg.train.seed)  # minibatch order, apart from acting
        num_iterations = math.ceil(cfg.ppo.total_steps / cfg.rollout_size)
        micro, chunk = cfg.micro_batch, cfg.memory.infer_chunk_size

        run_dir.mkdir(parents=True, exist_ok=True)  # only now: bad input leaves nothing behind
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        logger = Logger(run_dir, num_iterations * cfg.rollout_size,
                        tensorboard=cfg.run.tensorboard, progress=cfg.run.progress)
        logger.message(f"visppo: run directory {run_dir}  (train on {device}, act on {rollout_device}, amp "
                       f"{precision.dtype or 'off'}, {num_iterations} iterations of "
                       f"{cfg.rollout_size} steps, minibatch {cfg.ppo.minibatch_size}, micro-batch {micro})")
        timer, recent = PhaseTimer(), []
        global_step = 0
        for iteration in range(1, num_iterations + 1):
            start = time.perf_counter()
            if cfg.ppo.anneal_lr:
                for group in optimizer.param_groups:
                    group["lr"] = cfg.ppo.learning_rate * (1.0 - (iteration - 1) / num_iterations)

            policy.eval()
            with timer("collect"):
                if acting is not None:
                    acting.sync(policy)  # once per iteration, never per step
                episodes = collect(envs, acting.module if acting else policy, buffer, state,
                                   rollout_device, rollout_precision.autocast())
            with timer("score"):
                last_obs = to_torch(state.obs, torch.device("cpu"))
                last_value, _ = score(policy, last_obs, None, chunk, device, precision)
                if cfg.ppo.recompute_logp_old:
                    flat_obs = {k: buffer.flat(v) for k, v in buffer.obs.items()}
                    _, logp = score(policy, flat_obs, buffer.flat(buffer.actions), chunk, device, precision)
                    buffer.logp.copy_(logp.view(buffer.T, buffer.N))
                adv, ret = compute_gae(buffer.rewards, buffer.values, last_value, buffer.terminated,
                                       buffer.truncated, buffer.final_values, cfg.ppo.gamma, cfg.ppo.gae_lambda)
                buffer.advantages.copy_(adv)
                buffer.returns.copy_(ret)

            policy.train()
            with timer("update"):
                result = update(policy, optimizer, buffer, cfg.ppo, micro, chunk, device, precision,
                                generator, last_obs=last_obs)
            global_step += cfg.rollout_size

            recent = (recent + episodes)[-100:]
            seconds = timer.reset()
            elapsed = time.perf_counter() - start
            scalars = {
                "iteration": iteration,
                "episode_return": _mean(e["return"] for e in recent),
                "episode_success": _mean(e["success"] for e in recent),
                "episodes": len(episodes),
                "lr": optimizer.param_groups[0]["lr"],
                "steps_per_second": cfg.rollout_size / elapsed,
                "optimizer_steps": result.optimizer_steps,
                "skipped_steps": result.skipped_steps,
                **{f"loss/{k}": v for k, v in result.stats.items()},
                **{f"time/{k}": v for k, v in seconds.items()},
            }
            if iteration % cfg.run.log_every == 0 or iteration == num_iterations:
                logger.log(global_step, scalars)
            logger.progress(cfg.rollout_size, f"{scalars['steps_per_second']:.0f} sps, return "
                            f"{scalars['episode_return']:.2f}, success {scalars['episode_success']:.2f}, "
                            + " ".join(f"{k} {v:.1f}s" for k, v in seconds.items()))
            if iteration % cfg.run.checkpoint_every == 0 or iteration == num_iterations:
                save_checkpoint(run_dir, cfg, policy, optimizer, generator, iteration, global_step)
        logger.close()
    finally:
        envs.close()
    return run_dir


def save_checkpoint(run_dir: Path, cfg: Config, policy: ActorCritic, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, iteration: int, global_step: int) -> Path:
    """Write ``checkpoints/iter_N.pt`` and ``latest.pt`` atomically; keep the last few numbered ones."""
    folder = run_dir / "checkpoints"
    state = {
        "model": policy.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": to_dict(cfg),
        "iteration": iteration,
        "global_step": global_step,
        "rng": ckpt_io.rng_state(),
        "minibatch_generator": generator.get_state(),
    }
    numbered = folder / f"iter_{iteration:06d}.pt"
    ckpt_io.atomic_save(state, numbered)
    ckpt_io.atomic_save(state, folder / "latest.pt")
    old = sorted(folder.glob("iter_*.pt"))
    for path in old[: max(0, len(old) - cfg.run.keep_checkpoints)]:
        path.unlink(missing_ok=True)
    return folder / "latest.pt"


def _mean(values) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")

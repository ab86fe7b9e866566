"""Evaluate a trained policy: run whole episodes, report return and success, record a video.

``evaluate(source, episodes)`` loads a checkpoint safely (``weights_only``),
rebuilds the policy from the config stored in it, on the CPU, and runs
:func:`run_episodes` in one env made exactly as training makes its envs.

A video records one frame per observation: the reset observation of each episode
and the observation after every step, so a video of ``n`` episodes of ``L`` steps
has ``n * (L + 1)`` frames (what a frame shows, and the writer: :mod:`visppo.video`).
Videos and JSON files are written to a temporary file in the target's directory and
renamed into place: a crash never leaves a half file under the final name.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from visppo import checkpoint as ckpt_io
from visppo import seeding
from visppo.atomic import atomic_write_text, check_writable
from visppo.builders import build_policy, initialised_gpus
from visppo.checkpoint import CheckpointError
from visppo.config import Config, from_dict
from visppo.env_check import check_rollout_step, env_errors, success_of
from visppo.envs import check_env_id, make_env
from visppo.errors import ConfigError, EnvError, UserError
from visppo.policy import ActorCritic
from visppo.video import check_suffix, compose_frame, no_writer, video_fps, video_writer

# --------------------------------------------------------------------------- episodes


def run_episodes(policy: ActorCritic, cfg: Config, episodes: int, deterministic: bool = False,
                 seed: int = 0, video: Path | None = None,
                 device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Run ``episodes`` whole episodes in one env: evaluation stream ``seed``, episodes 0, 1, ...

    Episode ``i`` is reset with :func:`visppo.seeding.episode_seed` ``(seed, i, EVAL)``, a seed
    no training episode of any run uses.

    Actions are sampled (or the distribution's mode with ``deterministic``)
    under ``torch.inference_mode`` and clipped to a Box action space's bounds,
    as in training. Sampling draws from a torch RNG seeded with ``seed`` inside
    ``torch.random.fork_rng``, so stochastic evaluations are repeatable too and
    the caller's RNG states (the CPU's and every initialised GPU's) are untouched. Acting uses ``train.threads`` torch
    threads, or 1 when it is 0 (the caller's setting is restored afterwards).

    Returns ``{"episodes", "mean_return", "std_return", "success_rate",
    "mean_length", "returns", "lengths", "successes", "deterministic", "seed",
    "video"}``. ``success_rate`` is over the episodes whose final step's info reports
    ``is_success`` (an env that reports it only on success reads 100%), ``None`` where none does;
    a ``successes`` entry is ``None`` for an episode that does not report it.
    """
    if episodes < 1:
        raise UserError(f"episodes must be at least 1, got {episodes}")
    if video is not None:
        video = check_writable(Path(video), "video")
        check_suffix(video)
    check_env_id(cfg.env.id)
    with env_errors(cfg.env.id, "evaluation"):
        env = make_env(cfg, seeding.EVAL)
    results: list[tuple[float, int, bool | None]] = []
    written: Path | None = None
    was_training = policy.training
    policy.eval()
    threads = torch.get_num_threads()
    # One observation per forward pass: intra-op threads barely help a batch of 1 and,
    # on a busy machine, waiting for them makes each step many times slower.
    torch.set_num_threads(cfg.train.threads or 1)
    try:
        render_view = getattr(env.unwrapped, "render_view", None)
        render_view = _env_call(render_view, cfg.env.id) if callable(render_view) else None
        if video is not None:
            video.parent.mkdir(parents=True, exist_ok=True)  # only now: the checks before have passed
        writer_cm = video_writer(video, video_fps(env, cfg.env.action_repeat)) if video is not None else no_writer()
        with writer_cm as writer, torch.random.fork_rng(devices=initialised_gpus()), torch.inference_mode():
            torch.manual_seed(seed)
            record = ((lambda obs: writer.append(compose_frame(obs["pixels"], cfg.env.frame_stack, render_view)))
                      if writer is not None else None)
            cap = step_cap(env, cfg)
            for i in range(episodes):
                # the first reset sets the stream's base; later ones step its episode index
                results.append(run_episode(env, policy, seed if i == 0 else None, deterministic, device,
                                           record, env_id=cfg.env.id, max_steps=cap))
            written = writer.path if writer is not None else None
    finally:
        with contextlib.suppress(Exception, SystemExit):  # a failing env's error matters more
            env.close()
        policy.train(was_training)
        torch.set_num_threads(threads)
    return summarize(results, deterministic, seed, written)


def _env_call(call: Callable[..., Any], env_id: str) -> Callable[..., Any]:
    """``call`` (a method of the env, e.g. its ``render_view``) with what it raises as the env's error."""
    def env_part(*args: Any, **kwargs: Any) -> Any:
        with env_errors(env_id, "evaluation"):
            return call(*args, **kwargs)

    return env_part


EPISODE_STEP_CAP = 100_000
"""Agent steps after which an evaluation episode that has not ended is an error, unless the env's
time limit is longer: an env without one (gymnasium allows it) would otherwise evaluate for ever."""


def step_cap(env: gym.Env, cfg: Config) -> int:
    """:data:`EPISODE_STEP_CAP`, or twice the env's known time limit where that is longer."""
    spec = getattr(env, "spec", None)
    known = cfg.env.max_episode_steps or (spec.max_episode_steps if spec is not None else None) or 0
    return max(EPISODE_STEP_CAP, 2 * int(known))


def run_episode(env: gym.Env, policy: ActorCritic, seed: int | None, deterministic: bool, device: torch.device,
                record=None, env_id: str = "(unnamed)", max_steps: int = EPISODE_STEP_CAP
                ) -> tuple[float, int, bool | None]:
    """One episode reset with ``seed`` (``None``: the env's next episode): (return, length, success or
    None); ``record(obs)`` every frame. What the env's reset and step raise, a non-finite reward or
    state, an ``is_success`` that is not a bool, or an episode still going after ``max_steps`` is an
    EnvError naming ``env_id``, as in training; what the policy or ``record`` raises is theirs, and
    propagates as it is."""
    space = env.action_space
    low, high = (space.low, space.high) if isinstance(space, gym.spaces.Box) else (None, None)
    with env_errors(env_id, "evaluation"):
        obs, info = env.reset(seed=seed)
    if record is not None:
        record(obs)
    total, length, done = 0.0, 0, False
    while not done:
        batch = {k: torch.as_tensor(np.asarray(v))[None].to(device) for k, v in obs.items()}
        action, _, _ = policy.act(batch, deterministic=deterministic)
        env_action = action[0].cpu().numpy()
        if low is not None:
            env_action = np.clip(env_action, low, high)
        elif env_action.ndim == 0:
            env_action = int(env_action)
        with env_errors(env_id, "evaluation"):
            obs, reward, terminated, truncated, info = env.step(env_action)
            check_rollout_step(env_id, np.asarray([reward], dtype=np.float64),
                               {k: np.asarray(v)[None] for k, v in obs.items()})
            total, length, done = total + float(reward), length + 1, bool(terminated or truncated)
        if record is not None:
            record(obs)
        if not done and length >= max_steps:
            raise EnvError(f"env {env_id}: an evaluation episode did not end in {max_steps:,} steps: the env has "
                           "no time limit; set env.max_episode_steps")
    with env_errors(env_id, "evaluation"):
        success = bool(success_of(info["is_success"], env_id)) if "is_success" in info else None
    return total, length, success


def summarize(results: list[tuple[float, int, bool | None]], deterministic: bool, seed: int,
              video: Path | None) -> dict[str, Any]:
    """The dict :func:`run_episodes` returns, from its episodes' (return, length, success)."""
    returns = [r for r, _, _ in results]
    lengths = [n for _, n, _ in results]
    successes = [s for _, _, s in results]
    reported = [s for s in successes if s is not None]
    return {
        "episodes": len(results),
        "mean_return": float(np.mean(returns)),
        "std_return": float(np.std(returns)),
        "success_rate": float(np.mean(reported)) if reported else None,
        "mean_length": float(np.mean(lengths)),
        "returns": returns,
        "lengths": lengths,
        "successes": successes,
        "deterministic": bool(deterministic),
        "seed": int(seed),
        "video": str(video) if video is not None else None,
    }


# --------------------------------------------------------------------------- checkpoints


def resolve_checkpoint(source: str | Path) -> Path:
    """A run directory -> its ``checkpoints/latest.pt``; a file -> itself."""
    source = Path(source)
    if source.is_dir():
        latest = source / "checkpoints" / "latest.pt"
        if latest.is_file():
            return latest
        numbered = sorted((source / "checkpoints").glob("iter_*.pt"))
        if numbered:  # a crash between the numbered save and latest.pt
            return numbered[-1]
        raise CheckpointError(f"{source} is not a run directory (no checkpoints/latest.pt): give the "
                              "directory a `visppo train` run wrote, or a .pt checkpoint file")
    if not source.exists():
        raise CheckpointError(f"{source} not found: give a run directory or a .pt checkpoint file")
    return source


def _check_env_overrides(overrides: Sequence[str]) -> None:
    """Evaluation may change the env a policy acts in, nothing else: only ``env.KEY=VALUE``."""
    for item in overrides:
        if not item.strip().startswith("env.") or "=" not in item:
            raise ConfigError(f"'{item}': evaluation overrides change the env only; give env.KEY=VALUE "
                              "(e.g. env.kwargs.look=published)")


def read_trained(path: Path, env_overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Config, dict]:
    """A checkpoint ``visppo train`` wrote, loaded safely (``weights_only``) for acting on the CPU:
    ``(ckpt, cfg, weights)``. Evaluation and :mod:`visppo.deploy` both read checkpoints with it.

    ``env_overrides`` (``env.KEY=VALUE``, checked by the caller) change the saved config's env.
    """
    ckpt = ckpt_io.load(path)
    if not isinstance(ckpt.get("config"), dict):
        raise CheckpointError(f"checkpoint {path} has no saved config: it was not written by visppo train")
    try:
        cfg = from_dict(ckpt["config"], to_act=True)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {path} holds a config this visppo cannot use ({exc})") from None
    if env_overrides:
        cfg = from_dict(ckpt["config"], env_overrides, to_act=True)
    return ckpt, cfg, tensor_state(ckpt["model"], f"checkpoint {path}: 'model'")


def tensor_state(state: Any, what: str) -> dict[str, torch.Tensor]:
    """``state`` if it is a state dict of tensors, without the tensors visppo no longer has."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{what} is not a state dict of tensors")
    return ckpt_io.without_removed_tensors(state)


def load_weights(network: ActorCritic, state: dict[str, torch.Tensor], what: str,
                 mismatch_error: Callable[[str], Exception] | None = None) -> ActorCritic:
    """Fill ``network`` with ``state``, refused unless every tensor fits; returned in eval mode."""
    mismatch = ckpt_io.describe_mismatch(network.state_dict(), state, theirs="saved")
    if mismatch:
        raise (mismatch_error(mismatch) if mismatch_error is not None else CheckpointError(
            f"{what} is a checkpoint of another architecture than its saved config builds ({mismatch}): "
            "use a checkpoint written by this version of visppo"))
    network.load_state_dict(state)
    return network.eval()


def load_policy(path: Path, device: torch.device = torch.device("cpu"), env_overrides: Sequence[str] = ()
                ) -> tuple[ActorCritic, Config, dict[str, Any]]:
    """Load a checkpoint safely and rebuild its policy on ``device``: ``(policy, cfg, ckpt)``.

    ``env_overrides`` (``env.KEY=VALUE``) change the saved config's env, e.g. to
    evaluate a policy trained on DMC's fast look in the published one (checked by the caller).
    """
    ckpt, cfg, state = read_trained(path, env_overrides)
    check_env_id(cfg.env.id)
    env = make_env(cfg)
    try:
        policy = build_policy(cfg, env.observation_space, env.action_space, device, load_weights=False)
    finally:
        env.close()

    def changed_env(mismatch: str) -> Exception:
        return ConfigError(f"with {' '.join(env_overrides)} the env's observations or actions no longer fit "
                           f"the trained policy ({mismatch}): keep what the policy sees (image size, frame "
                           "stack, state, action space) as it was trained")

    return load_weights(policy, state, f"checkpoint {path}", changed_env if env_overrides else None), cfg, ckpt


def evaluate(source: str | Path, episodes: int, deterministic: bool = False, video: Path | None = None,
             json_path: Path | None = None, seed: int = 0, env_overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Evaluate the checkpoint at ``source`` (a run directory or a ``.pt`` file) on the CPU.

    ``env_overrides`` (``env.KEY=VALUE``) evaluate in a changed env (another look,
    camera or episode length) with the same weights. Returns :func:`run_episodes`'s
    result with ``"checkpoint"``, ``"global_step"``, ``"env_id"`` and
    ``"env_overrides"`` added; with ``json_path``, also writes it there as JSON.
    """
    _check_env_overrides(env_overrides)  # before any file is looked at
    if json_path is not None:
        json_path = check_writable(Path(json_path), "JSON")
    path = resolve_checkpoint(source)
    device = torch.device("cpu")
    policy, cfg, ckpt = load_policy(path, device, env_overrides)
    result = run_episodes(policy, cfg, episodes, deterministic=deterministic, seed=seed, video=video,
                          device=device)
    step = ckpt.get("global_step")
    result = {"checkpoint": str(path), "global_step": int(step) if step is not None else None,
              "env_id": cfg.env.id, "env_overrides": list(env_overrides), **result}
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(_jsonable(result), indent=2) + "\n")
    return result


def format_result(result: dict[str, Any]) -> str:
    """One line: mean ± std return, success rate, episodes (and mean length)."""
    success = result.get("success_rate")
    success_text = "n/a" if success is None or (isinstance(success, float) and math.isnan(success)) \
        else f"{100 * success:.0f}%"
    mode = "deterministic" if result.get("deterministic") else "stochastic"
    changed = f" ({' '.join(result['env_overrides'])})" if result.get("env_overrides") else ""
    head = f"{result['env_id']}{changed}: " if result.get("env_id") else ""
    return (f"{head}return {result['mean_return']:.2f} ± {result['std_return']:.2f}, success {success_text}, "
            f"{result['episodes']} episodes ({mode}, mean length {result['mean_length']:.0f})")


# --------------------------------------------------------------------------- output files


def _jsonable(value: Any) -> Any:
    """NaN/inf -> None (strict JSON), numpy scalars -> Python numbers."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

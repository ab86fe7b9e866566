"""Evaluate a trained policy: run whole episodes, report return and success, record a video.

``evaluate(source, episodes)`` loads a checkpoint safely (``weights_only``),
rebuilds the policy from the config stored in it, on the CPU, and runs
:func:`run_episodes` in one env made exactly as training makes its envs.

A video frame shows what the policy sees (the newest RGB frame of its stack,
upscaled with nearest-neighbour so it is visible) and, for tasks that have one
(``env.unwrapped.render_view``), a third-person view of the same height beside
it. One frame per observation: the reset observation of each episode and the
observation after every step, so a video of ``n`` episodes of ``L`` steps has
``n * (L + 1)`` frames. Videos and JSON files are written to a temporary file
in the target's directory and renamed into place: a crash never leaves a half
file under the final name.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from visppo import checkpoint as ckpt_io
from visppo import seeding
from visppo.atomic import atomic_write_text, file_mode
from visppo.builders import build_policy
from visppo.checkpoint import CheckpointError
from visppo.config import Config, build_config, from_dict
from visppo.envs import check_env_id, make_env
from visppo.errors import ConfigError, UserError
from visppo.policy import ActorCritic

MIN_VIDEO_HEIGHT = 256
"""The policy's camera is upscaled by an integer factor to at least this height in videos."""
VIEW_ASPECT = 4 / 3
"""Width / height of the third-person view beside the policy's camera."""
SEPARATOR = 4
"""Pixels of dark border between the two panels of a video frame."""
VIDEO_SUFFIXES = (".mp4", ".gif", ".mkv", ".mov", ".avi")  # imageio-ffmpeg has no webm encoder
_X264_SUFFIXES = (".mp4", ".mkv", ".mov")


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
    the caller's RNG state is untouched. Acting uses ``train.threads`` torch
    threads, or 1 when it is 0 (the caller's setting is restored afterwards).

    Returns ``{"episodes", "mean_return", "std_return", "success_rate",
    "mean_length", "returns", "lengths", "successes", "deterministic", "seed",
    "video"}``. ``success_rate`` and the ``successes`` entries are ``None``
    when the env does not report ``is_success`` in its final step's info.
    """
    if episodes < 1:
        raise UserError(f"episodes must be at least 1, got {episodes}")
    if video is not None:
        video = _check_output_path(Path(video), "video")
        if video.suffix.lower() not in VIDEO_SUFFIXES:
            raise UserError(f"video file {video} must end in one of {', '.join(VIDEO_SUFFIXES)}")
    check_env_id(cfg.env.id)
    env = make_env(cfg, seeding.EVAL)
    results: list[tuple[float, int, bool | None]] = []
    written: Path | None = None
    was_training = policy.training
    policy.eval()
    threads = torch.get_num_threads()
    # One observation per forward pass: intra-op threads barely help a batch of 1 and,
    # on a busy machine, waiting for them made each step ~40x slower here (29 ms vs 0.7 ms).
    torch.set_num_threads(cfg.train.threads or 1)
    try:
        render_view = getattr(env.unwrapped, "render_view", None)
        render_view = render_view if callable(render_view) else None
        writer_cm = _video_writer(video, _video_fps(env, cfg)) if video is not None else _no_writer()
        with writer_cm as writer, torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(seed)
            record = ((lambda obs: writer.append(compose_frame(obs["pixels"], cfg.env.frame_stack, render_view)))
                      if writer is not None else None)
            for i in range(episodes):
                # the first reset sets the stream's base; later ones step its episode index
                results.append(run_episode(env, policy, seed if i == 0 else None, deterministic, device, record))
            written = writer.path if writer is not None else None
    finally:
        env.close()
        policy.train(was_training)
        torch.set_num_threads(threads)
    return summarize(results, deterministic, seed, written)


def run_episode(env: gym.Env, policy: ActorCritic, seed: int | None, deterministic: bool, device: torch.device,
                record=None) -> tuple[float, int, bool | None]:
    """One episode reset with ``seed`` (``None``: the env's next episode): (return, length, success or
    None); ``record(obs)`` every frame."""
    space = env.action_space
    low, high = (space.low, space.high) if isinstance(space, gym.spaces.Box) else (None, None)
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
        obs, reward, terminated, truncated, info = env.step(env_action)
        total, length, done = total + float(reward), length + 1, bool(terminated or truncated)
        if record is not None:
            record(obs)
    success = bool(np.asarray(info["is_success"]).item()) if "is_success" in info else None
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


def load_policy(path: Path, device: torch.device = torch.device("cpu"), env_overrides: Sequence[str] = ()
                ) -> tuple[ActorCritic, Config, dict[str, Any]]:
    """Load a checkpoint safely and rebuild its policy on ``device``: ``(policy, cfg, ckpt)``.

    ``env_overrides`` (``env.KEY=VALUE``) change the saved config's env, e.g. to
    evaluate a policy trained on DMC's fast look in the published one (checked by the caller).
    """
    ckpt = ckpt_io.load(path)
    if not isinstance(ckpt.get("config"), dict):
        raise CheckpointError(f"checkpoint {path} has no saved config: it was not written by visppo train")
    try:
        cfg = from_dict(ckpt["config"])
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {path} holds a config this visppo cannot use ({exc})") from None
    if env_overrides:
        cfg = build_config(ckpt["config"], env_overrides, source="the saved config")
    cfg.train.device = "cpu"
    cfg.rollout.device = "cpu"
    state = ckpt["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {path}: 'model' is not a state dict of tensors")
    state = ckpt_io.without_removed_tensors(state)
    check_env_id(cfg.env.id)
    env = make_env(cfg)
    try:
        policy = build_policy(cfg, env.observation_space, env.action_space, device)
    finally:
        env.close()
    mismatch = ckpt_io.describe_mismatch(policy.state_dict(), state, theirs="saved")
    if mismatch and env_overrides:
        raise ConfigError(f"with {' '.join(env_overrides)} the env's observations or actions no longer fit "
                          f"the trained policy ({mismatch}): keep what the policy sees (image size, frame "
                          "stack, state, action space) as it was trained")
    if mismatch:
        raise CheckpointError(f"checkpoint {path} is a checkpoint of another architecture than its saved "
                              f"config builds ({mismatch}): use a checkpoint written by this version of visppo")
    policy.load_state_dict(state)
    policy.eval()
    return policy, cfg, ckpt


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
        json_path = _check_output_path(Path(json_path), "JSON")
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


# --------------------------------------------------------------------------- video frames


def camera_image(pixels: np.ndarray, frame_stack: int) -> np.ndarray:
    """The newest frame of a stacked CHW observation, as RGB HWC uint8."""
    channels = pixels.shape[0] // max(1, frame_stack)
    frame = pixels[-channels:] if channels else pixels
    frame = np.transpose(frame, (1, 2, 0))
    if frame.shape[2] == 1:
        frame = np.repeat(frame, 3, axis=2)
    return np.ascontiguousarray(frame[..., :3], dtype=np.uint8)


def resize_nearest(image: np.ndarray, height: int, width: int) -> np.ndarray:
    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    rows = np.arange(height) * h // height
    cols = np.arange(width) * w // width
    return image[rows[:, None], cols[None, :]]


def video_layout(image_height: int, image_width: int, has_view: bool) -> tuple[int, int, int]:
    """``(height, camera_width, view_width)`` of a video frame's panels (view_width 0 without a view)."""
    scale = max(1, math.ceil(MIN_VIDEO_HEIGHT / image_height))
    height = image_height * scale
    view_width = int(round(height * VIEW_ASPECT)) if has_view else 0
    return height, image_width * scale, view_width


def compose_frame(pixels: np.ndarray, frame_stack: int, render_view=None) -> np.ndarray:
    """One video frame: the policy's camera, upscaled, and the third-person view beside it.

    The frame's height and width are rounded up to even numbers (H.264 in
    yuv420p needs them) by a dark border at the bottom / right.
    """
    cam = camera_image(pixels, frame_stack)
    height, cam_width, view_width = video_layout(cam.shape[0], cam.shape[1], render_view is not None)
    panels = [resize_nearest(cam, height, cam_width)]
    if render_view is not None:
        view = np.asarray(render_view(width=view_width, height=height), dtype=np.uint8)[..., :3]
        panels += [np.full((height, SEPARATOR, 3), 16, np.uint8), resize_nearest(view, height, view_width)]
    frame = np.concatenate(panels, axis=1)
    pad_h, pad_w = frame.shape[0] % 2, frame.shape[1] % 2
    if pad_h or pad_w:
        frame = np.pad(frame, ((0, pad_h), (0, pad_w), (0, 0)), constant_values=16)
    return np.ascontiguousarray(frame)


# --------------------------------------------------------------------------- writing files


def _video_fps(env: gym.Env, cfg: Config) -> float:
    fps = float(env.metadata.get("render_fps") or 30)
    return max(1.0, fps / max(1, cfg.env.action_repeat))


def _ffmpeg_available() -> bool:
    try:
        import imageio_ffmpeg

        return bool(imageio_ffmpeg.get_ffmpeg_exe())
    except Exception:
        return False


class _Frames:
    """Streams frames to a temp file next to ``path``; renamed into place by :func:`_video_writer`."""

    def __init__(self, path: Path, fps: float):
        self.path = path
        if path.suffix.lower() != ".gif" and not _ffmpeg_available():
            self.path = path.with_suffix(".gif")
            warnings.warn(f"ffmpeg is not available (install imageio-ffmpeg): writing {self.path} instead "
                          f"of {path}", RuntimeWarning, stacklevel=3)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}.",
                                   suffix=self.path.suffix)
        os.close(fd)
        self.tmp = Path(tmp)
        self.frames = 0
        try:
            self._open(fps)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def _open(self, fps: float) -> None:
        suffix = self.path.suffix.lower()
        if suffix == ".gif":
            import imageio.v3 as iio

            self._gif = iio.imopen(self.tmp, "w", plugin="pillow", extension=".gif")
            self._gif_duration = int(round(1000 / fps))
            self._writer = None
        else:
            import imageio.v2 as iio2

            self._gif = None
            codec = {"codec": "libx264"} if suffix in _X264_SUFFIXES else {}
            self._writer = iio2.get_writer(self.tmp, format="FFMPEG", mode="I", fps=fps, quality=8,
                                           macro_block_size=1, ffmpeg_log_level="error", **codec)

    def append(self, frame: np.ndarray) -> None:
        if self._gif is not None:
            self._gif.write(frame, duration=self._gif_duration, loop=0)
        else:
            self._writer.append_data(frame)
        self.frames += 1

    def close(self) -> None:
        if self._gif is not None:
            self._gif.close()
        else:
            self._writer.close()


@contextmanager
def _video_writer(path: Path, fps: float) -> Iterator[_Frames]:
    frames = _Frames(path, fps)
    try:
        yield frames
        frames.close()
        if frames.frames == 0:
            raise RuntimeError("no video frames were recorded")
        os.chmod(frames.tmp, file_mode())
        os.replace(frames.tmp, frames.path)
    except BaseException:
        try:
            frames.close()
        except Exception:
            pass
        frames.tmp.unlink(missing_ok=True)
        raise


@contextmanager
def _no_writer() -> Iterator[None]:
    yield None


def _check_output_path(path: Path, what: str) -> Path:
    """Create the output's directory now, so a bad path fails before the episodes run."""
    if path.is_dir():
        raise UserError(f"{what} output {path} is a directory: give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write the {what} output {path}: {exc.strerror or exc}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the {what} output {path}: {path.parent} is not writable")
    return path


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

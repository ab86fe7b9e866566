"""Evaluation videos: what a frame shows, and a writer that never leaves half a file.

A video frame shows what the policy sees (the newest RGB frame of its stack, upscaled with
nearest-neighbour so it is visible) and, for tasks that have one (``env.unwrapped.render_view``),
a third-person view of the same height beside it (:func:`compose_frame`). :func:`video_writer`
streams frames to a temporary file in the target's directory and renames it into place when
the block ends: a crash never leaves a half file under the final name. Without ffmpeg
(imageio-ffmpeg) it writes a GIF instead, and says so.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gymnasium as gym
import numpy as np
from PIL import Image

from visppo.atomic import file_mode
from visppo.errors import UserError

MIN_VIDEO_HEIGHT = 256
"""The policy's camera is upscaled by an integer factor to at least this height in videos."""
VIEW_ASPECT = 4 / 3
"""Width / height of the third-person view beside the policy's camera."""
SEPARATOR = 4
"""Pixels of dark border between the two panels of a video frame."""
VIDEO_SUFFIXES = (".mp4", ".gif", ".mkv", ".mov", ".avi")  # imageio-ffmpeg has no webm encoder
_X264_SUFFIXES = (".mp4", ".mkv", ".mov")


def check_suffix(path: Path) -> None:
    """A UserError unless ``path`` ends in a video format the writer knows."""
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise UserError(f"video file {path} must end in one of {', '.join(VIDEO_SUFFIXES)}")


# --------------------------------------------------------------------------- frames


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


# --------------------------------------------------------------------------- writing


def video_fps(env: gym.Env, action_repeat: int) -> float:
    """Frames per second that play the episode in real time: the env's ``render_fps`` (30 when it
    has none) over ``env.action_repeat`` (one frame per agent step)."""
    fps = float(env.metadata.get("render_fps") or 30)
    return max(1.0, fps / max(1, action_repeat))


def ffmpeg_available() -> bool:
    try:
        import imageio_ffmpeg

        return bool(imageio_ffmpeg.get_ffmpeg_exe())
    except Exception:
        return False


class Frames:
    """Streams frames to a temp file next to ``path``; renamed into place by :func:`video_writer`."""

    def __init__(self, path: Path, fps: float):
        self.path = path
        if path.suffix.lower() != ".gif" and not ffmpeg_available():
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
        if suffix == ".gif":  # Pillow holds a GIF's frames until it writes them all, as imageio's plugin does
            self._gif, self._gif_durations = [], []
            # GIF frame times are whole centiseconds, 2 at least (viewers slow shorter ones): above
            # 50 fps every k-th frame is kept, and each kept frame lasts the centiseconds that bring
            # the video's clock to its real time (30 fps: 3, 3, 4, ...)
            self._gif_every = math.ceil(fps / 50)
            self._gif_fps = fps / self._gif_every
            self._writer = None
        else:
            import imageio.v2 as iio2

            self._gif = None
            codec = {"codec": "libx264"} if suffix in _X264_SUFFIXES else {}
            self._writer = iio2.get_writer(self.tmp, format="FFMPEG", mode="I", fps=fps, quality=8,
                                           macro_block_size=1, ffmpeg_log_level="error", **codec)

    def append(self, frame: np.ndarray) -> None:
        if self._gif is not None:
            if self.frames % self._gif_every == 0:
                kept = self.frames // self._gif_every
                centiseconds = round(100 * (kept + 1) / self._gif_fps) - round(100 * kept / self._gif_fps)
                self._gif.append(Image.fromarray(frame))
                self._gif_durations.append(10 * centiseconds)
        else:
            self._writer.append_data(frame)
        self.frames += 1

    def close(self) -> None:
        if self._gif is not None:
            if self._gif:  # each frame its own time (imageio's plugin gives every frame the last one's)
                self._gif[0].save(self.tmp, format="GIF", save_all=True, append_images=self._gif[1:],
                                  duration=self._gif_durations, loop=0)
            self._gif = []
        else:
            self._writer.close()


@contextmanager
def video_writer(path: Path, fps: float) -> Iterator[Frames]:
    """Frames appended in the block land in ``path`` (or its ``.gif`` without ffmpeg) once it ends;
    an error or no frame at all leaves neither the file nor its temporary one."""
    frames = Frames(path, fps)
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
def no_writer() -> Iterator[None]:
    """``video_writer``'s stand-in when there is no video to record."""
    yield None

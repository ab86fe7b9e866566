"""visppo.video: what an evaluation frame shows, and a writer that never leaves half a file."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import imageio.v3 as iio
import numpy as np
import pytest

import visppo.video
from visppo.errors import UserError
from visppo.video import (
    SEPARATOR,
    camera_image,
    check_suffix,
    compose_frame,
    video_fps,
    video_layout,
    video_writer,
)


def test_compose_frame_with_view():
    stacked = np.zeros((6, 40, 40), np.uint8)
    stacked[3:, :, :] = 200  # the newest frame of a stack of 2 RGB frames
    calls = []

    def render_view(width, height):
        calls.append((width, height))
        return np.full((height, width, 3), 50, np.uint8)

    frame = compose_frame(stacked, 2, render_view)
    height, cam_width, view_width = video_layout(40, 40, True)
    assert (height, cam_width) == (280, 280) and calls == [(view_width, height)]
    assert frame.shape[0] == height and frame.shape[1] >= cam_width + view_width
    assert frame.shape[0] % 2 == 0 and frame.shape[1] % 2 == 0  # H.264 yuv420p needs even sizes
    assert (frame[:, :cam_width] == 200).all()  # newest frame, not the older one
    start = cam_width + SEPARATOR
    assert frame.shape[1] == start + view_width + (start + view_width) % 2
    assert (frame[:, start:start + view_width] == 50).all()  # the view, same height, beside the camera


def test_a_grey_stack_shows_its_newest_frame_in_rgb_and_odd_sizes_are_padded():
    stacked = np.stack([np.full((9, 9), 10, np.uint8), np.full((9, 9), 90, np.uint8)])  # 2 grey frames
    image = camera_image(stacked, 2)
    assert image.shape == (9, 9, 3) and (image == 90).all()
    frame = compose_frame(stacked, 2)
    assert frame.shape == (9 * 29 + 1, 9 * 29 + 1, 3)  # 29x to >= 256 px, then even: one dark row and column
    assert (frame[:-1, :-1] == 90).all() and (frame[-1] == 16).all()


def test_suffixes_and_fps():
    check_suffix(Path("a/eval.MP4"))
    with pytest.raises(UserError, match="must end in one of .mp4, .gif"):
        check_suffix(Path("eval.webm"))
    env = gym.make("CartPole-v1")
    assert env.metadata["render_fps"] == 50 and video_fps(env, 2) == 25.0 and video_fps(env, 1) == 50.0


def _frames(n: int) -> list[np.ndarray]:
    return [np.full((16, 24, 3), 40 * i, np.uint8) for i in range(n)]


@pytest.mark.parametrize("name", ["clip.mp4", "clip.gif"])
def test_the_video_holds_every_frame_and_no_temp_file_is_left(tmp_path, name):
    with video_writer(tmp_path / "out" / name, fps=10) as writer:
        for frame in _frames(5):
            writer.append(frame)
    assert writer.path == tmp_path / "out" / name and writer.frames == 5
    assert iio.imread(writer.path, index=None).shape[:3] == (5, 16, 24)
    assert [p.name for p in writer.path.parent.iterdir()] == [name]


def test_gif_when_ffmpeg_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(visppo.video, "ffmpeg_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="ffmpeg is not available"), \
            video_writer(tmp_path / "eval.mp4", fps=20) as writer:
        writer.append(_frames(1)[0])
    assert writer.path == tmp_path / "eval.gif"
    assert [p.name for p in tmp_path.iterdir()] == ["eval.gif"]


def test_a_crash_or_no_frame_leaves_nothing(tmp_path):
    (tmp_path / "eval.mp4").write_bytes(b"an older video")
    with pytest.raises(KeyboardInterrupt), video_writer(tmp_path / "eval.mp4", fps=10) as writer:
        writer.append(_frames(1)[0])
        raise KeyboardInterrupt
    assert (tmp_path / "eval.mp4").read_bytes() == b"an older video"  # the old file, untouched
    with pytest.raises(RuntimeError, match="no video frames"), video_writer(tmp_path / "new.gif", fps=10):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["eval.mp4"]  # no temp file, no empty video


@pytest.mark.parametrize("fps, frames, kept", [(30, 60, 60), (15, 45, 45), (12.5, 10, 10), (100, 60, 30), (60, 60, 30)])
def test_a_gif_plays_in_real_time(tmp_path, fps, frames, kept):
    """GIF frame times are whole centiseconds (2 at least): they add up to the frames' real time
    (30 fps: 30, 40, 30 ms...), and above 50 fps every k-th frame is kept."""
    from PIL import Image

    with video_writer(tmp_path / "v.gif", fps=fps) as writer:
        for i in range(frames):
            writer.append(np.full((8, 8, 3), 4 * i, np.uint8))  # each frame differs: Pillow merges equal ones
    with Image.open(tmp_path / "v.gif") as im:
        durations = []
        for i in range(im.n_frames):
            im.seek(i)
            durations.append(im.info["duration"])
    assert len(durations) == kept and min(durations) >= 20
    assert sum(durations) == pytest.approx(1000 * frames / fps, abs=10)

"""Pick a headless OpenGL backend for MuJoCo before it is imported.

MuJoCo reads ``MUJOCO_GL`` once, when ``mujoco`` is first imported, so every
task module calls :func:`ensure_headless_gl` before ``import mujoco``. On a
machine without a display (servers, CI, containers) the default GLFW backend
cannot create a context, while EGL renders offscreen through Mesa or the GPU
driver.
"""

from __future__ import annotations

import os
import sys
import warnings


def ensure_headless_gl() -> None:
    """Set ``MUJOCO_GL=egl`` unless the user chose a backend or has a display.

    An explicit ``MUJOCO_GL`` always wins; with a ``DISPLAY`` we leave MuJoCo's
    own default (GLFW) alone. If ``mujoco`` was already imported the setting
    comes too late for this process (only subprocesses see it), so we warn.
    """
    if "MUJOCO_GL" in os.environ or os.environ.get("DISPLAY"):
        return
    os.environ["MUJOCO_GL"] = "egl"
    if "mujoco" in sys.modules:
        warnings.warn(
            "mujoco was imported before visppo_envs could select the headless EGL "
            "backend and there is no DISPLAY, so rendering will fail in this process; "
            "set MUJOCO_GL=egl in the environment or import visppo_envs first.",
            RuntimeWarning,
            stacklevel=2,
        )

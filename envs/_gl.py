"""Pick a headless OpenGL backend for MuJoCo before it is imported.

MuJoCo reads ``MUJOCO_GL`` once, when ``mujoco`` is first imported, so every
task module calls :func:`ensure_headless_gl` before ``import mujoco``. On a
machine without a display (servers, CI, containers) the default GLFW backend
cannot create a context, while EGL renders offscreen through Mesa or the GPU
driver.
"""

from __future__ import annotations

import os


def ensure_headless_gl() -> None:
    """Set ``MUJOCO_GL=egl`` unless the user chose a backend or has a display.

    An explicit ``MUJOCO_GL`` always wins; with a ``DISPLAY`` we leave MuJoCo's
    own default (GLFW) alone. Has no effect if ``mujoco`` was already imported.
    """
    if "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
        os.environ["MUJOCO_GL"] = "egl"

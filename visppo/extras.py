"""Optional extras (``pip install -e ".[deploy]"``, ``".[wandb]"``): is one installed, and the one-line
error when it is not.

A missing extra is found with ``importlib.util.find_spec``, before anything is imported or
written, so the ``error:`` line comes before any work.
"""

from __future__ import annotations

import importlib.util
import sys

from visppo.errors import ConfigError

EXTRAS = {
    "deploy": ("onnx", "onnxscript", "onnxruntime", "safetensors"),
    "wandb": ("wandb",),
}
"""Each extra and the modules it installs (pyproject.toml's [project.optional-dependencies])."""


def missing(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent that fails to import; a module without a spec
            found = sys.modules.get(name) is not None
        if not found:
            absent.append(name)
    return absent


def require(extra: str, modules: tuple[str, ...] | list[str], what: str) -> None:
    """Raise a :class:`ConfigError` naming ``extra`` when one of ``modules`` is missing."""
    absent = missing(modules)
    if absent:
        raise ConfigError(f"{what} needs the {extra} extra ({', '.join(absent)} not installed): "
                          f'pip install -e ".[{extra}]" in the visppo checkout')

"""visppo: PPO for robot policies from camera images, with a memory-bounded update.

The Python API, imported on first use (``import visppo`` itself loads neither torch nor an env):

- ``visppo.train(config=None, *, env=None, **overrides) -> Path``: train a policy, return its run
  directory (:func:`visppo.api.train`; overrides are ``section__key=value``).
- ``visppo.load_policy(path_or_run) -> Policy``: a run's, a checkpoint's or an exported folder's
  policy; ``Policy.reset()``, ``Policy.act(observation, deterministic=True) -> action``
  (:mod:`visppo.deploy`).

``visppo.train`` is also the module of the training loop (``visppo.train.train(cfg)``): the
package makes that module callable, its call being :func:`visppo.api.train`, so the name means
one thing whichever was imported first.
"""

import sys
import types

__version__ = "0.1.0"
__all__ = ["train", "load_policy", "Policy", "__version__"]


class _TrainModule(types.ModuleType):
    """``visppo.train``: the training loop's module, which ``visppo.train(...)`` calls as the API."""

    def __call__(self, config=None, *, env=None, **overrides):
        from visppo.api import train

        return train(config, env=env, **overrides)


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # the import system sets visppo.train to the submodule when it is first imported
        if name == "train" and type(value) is types.ModuleType:
            value.__class__ = _TrainModule
        super().__setattr__(name, value)

    def __getattr__(self, name):  # only for names not set yet
        if name == "train":
            import importlib

            return importlib.import_module("visppo.train")
        if name in ("load_policy", "Policy"):
            from visppo import deploy

            return getattr(deploy, name)
        raise AttributeError(f"module 'visppo' has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package

"""visppo: PPO for robot policies from camera images, with a memory-bounded update.

The Python API, imported on first use (``import visppo`` itself loads neither torch nor an env):

- ``visppo.train(config=None, *, env=None, **overrides) -> Path``: train a policy, return its run
  directory (:func:`visppo.api.train`; overrides are ``section__key=value``). The training loop
  it runs is :func:`visppo.loop.train`.
- ``visppo.load_policy(path_or_run) -> Policy``: a run's, a checkpoint's or an exported folder's
  policy; ``Policy.reset()``, ``Policy.act(observation, deterministic=True) -> action``
  (:mod:`visppo.deploy`).
"""

__version__ = "0.1.0"
__all__ = ["train", "load_policy", "Policy", "__version__"]


def __getattr__(name: str):  # PEP 562: the API's modules load when first named
    if name == "train":
        from visppo.api import train

        return train
    if name in ("load_policy", "Policy"):
        from visppo import deploy

        return getattr(deploy, name)
    raise AttributeError(f"module 'visppo' has no attribute {name!r}")

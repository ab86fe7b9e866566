"""visppo's tasks, registered with gymnasium as ``visppo/<Name>-v0`` on import.

- ``visppo/DotReach-v0``: a synthetic pixel task drawn with numpy (no MuJoCo),
  cheap enough for the test suite to train a real pixel policy on a CPU.
- ``visppo/Reach-v0``, ``visppo/Push-v0``, ``visppo/Balance-v0``: MuJoCo robot
  tasks seen through a fixed camera.
"""

from gymnasium.envs.registration import register, registry

from visppo_envs._gl import ensure_headless_gl

ensure_headless_gl()  # before anything imports mujoco: EGL when there is no display

_TASKS = {
    "visppo/DotReach-v0": ("visppo_envs.dot:DotReachEnv", 50, {}),
    "visppo/DotReachDiscrete-v0": ("visppo_envs.dot:DotReachEnv", 50, {"discrete": True}),
    "visppo/Reach-v0": ("visppo_envs.reach:ReachEnv", 100, {}),
    "visppo/Push-v0": ("visppo_envs.push:PushEnv", 200, {}),
    "visppo/Balance-v0": ("visppo_envs.balance:BalanceEnv", 500, {}),
}

for _id, (_entry, _steps, _kwargs) in _TASKS.items():
    if _id not in registry:
        register(id=_id, entry_point=_entry, max_episode_steps=_steps, kwargs=_kwargs)

TASK_IDS = tuple(_TASKS)

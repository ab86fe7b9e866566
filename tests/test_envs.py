import functools
import warnings

import gymnasium as gym
import numpy as np
import pytest
from conftest import tiny_overrides
from gymnasium.utils.env_checker import check_env

from visppo import envs as envs_module
from visppo.config import load_config
from visppo.env_process import EnvProcess
from visppo.envs import PixelDict, check_env_id, make_env, make_vector_env, use_async
from visppo.errors import ConfigError
from visppo_envs.dot import DotReachEnv

DOT = "env.id=visppo/DotReach-v0"


@pytest.mark.parametrize("obs_mode", ["pixels", "pixels_state"])
@pytest.mark.parametrize("discrete", [False, True])
def test_dot_reach_passes_gymnasium_check_env(obs_mode, discrete):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checker reports many problems as warnings only
        env = gym.make("visppo/DotReach-v0", obs_mode=obs_mode, discrete=discrete).unwrapped  # with its spec
        assert isinstance(env, DotReachEnv)
        check_env(env, skip_render_check=False)


def test_dot_reach_rewards_moving_onto_the_target():
    env = DotReachEnv()
    env.reset(seed=3)
    total, success = 0.0, False
    for _ in range(50):  # an oracle that moves straight to the target
        step = np.clip((env.target - env.dot) / env.speed, -1, 1)
        _, r, _, _, info = env.step(step)
        total, success = total + r, info["is_success"]
    assert success and total > 1.0


def test_dot_reach_moves_nothing_on_a_nan_action_and_clips_an_infinite_one():
    """As MuJoCo treats a non-finite control: one NaN action must not leave NaN in the dot's
    position (and so in every later state and reward of the episode)."""
    env = DotReachEnv(obs_mode="pixels_state")
    env.reset(seed=0)
    start = env.dot.copy()
    obs, reward, *_ = env.step(np.array([np.nan, np.nan], np.float32))
    assert np.array_equal(env.dot, start) and reward == pytest.approx(0.1 if env._inside() else 0.0)
    obs, reward, *_ = env.step(np.zeros(2, np.float32))
    assert np.isfinite(obs["state"]).all() and np.isfinite(reward)
    env.step(np.array([np.inf, -np.inf], np.float32))
    assert np.allclose(env.dot, np.clip(start + env.speed * np.array([1, -1]), 0, 1))


def test_vector_env_gives_stacked_uint8_chw_frames_and_state():
    cfg = load_config(None, [DOT, "ppo.num_envs=3", "env.frame_stack=4", "env.state=true", "env.image_size=48"])
    envs = make_vector_env(cfg)
    obs, _ = envs.reset(seed=0)
    assert obs["pixels"].shape == (3, 12, 48, 48) and obs["pixels"].dtype == np.uint8
    assert obs["state"].shape == (3, 4) and obs["state"].dtype == np.float32
    envs.close()


def test_frame_stack_holds_consecutive_frames_newest_last():
    env = PixelDict(gym.make("visppo/DotReach-v0"), frame_stack=3, keep_state=False)
    obs, _ = env.reset(seed=0)
    first = obs["pixels"][-3:].copy()
    assert np.array_equal(obs["pixels"][:3], first)  # reset repeats the first frame
    obs, *_ = env.step(np.array([1.0, 0.0], np.float32))
    assert np.array_equal(obs["pixels"][3:6], first)
    assert np.array_equal(obs["pixels"][6:], np.transpose(env.unwrapped.render(), (2, 0, 1)))


def test_action_repeat_sums_rewards():
    cfg = load_config(None, [DOT, "env.action_repeat=3"])
    env, ref = make_env(cfg), make_env(load_config(None, [DOT]))
    env.reset(seed=1)
    ref.reset(seed=1)
    a = np.array([0.3, -0.2], np.float32)
    _, r, *_ = env.step(a)
    expected = sum(ref.step(a)[1] for _ in range(3))
    assert r == pytest.approx(expected, rel=1e-5)


def test_non_image_env_without_pixels_is_refused():
    cfg = load_config(None, ["env.id=CartPole-v1", "env.pixels=false"])
    with pytest.raises(ConfigError, match="not an image"):
        make_env(cfg)


def test_unknown_env_id_is_refused():
    cfg = load_config(None, ["env.id=visppo/Nope-v0"])
    with pytest.raises(ConfigError, match="not a registered"):
        make_vector_env(cfg)


def test_episodes_are_seeded_from_the_base_seed_and_their_index():
    cfg = load_config(None, [DOT, "env.max_episode_steps=2"])
    a, b = make_env(cfg), make_env(cfg)
    first, _ = a.reset(seed=7)
    a.step(a.action_space.sample())
    a.step(a.action_space.sample())
    second, _ = a.reset()
    b.episode = 1  # as a resumed run sets it before its first reset: replay episode 1 of seed 7
    replay, _ = b.reset(seed=7)
    assert np.array_equal(replay["pixels"], second["pixels"])
    assert not np.array_equal(first["pixels"], second["pixels"])


def test_a_gymnasium_pixel_env_then_an_optimizer_does_not_crash(tmp_path):
    """Regression: Reacher-v5's renderer made an EGL context in the parent (Mesa's LLVM), then the
    first optimizer imported triton's LLVM and the process segfaulted. A fresh process, as in training."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from visppo.config import load_config\n"
            "from visppo.envs import make_vector_env\n"
            "cfg = load_config(None, ['env.id=Reacher-v5', 'env.pixels=true', 'env.image_size=48',\n"
            "                         'ppo.num_envs=1', 'ppo.minibatch_size=32', 'env.vector=sync'])\n"
            "envs = make_vector_env(cfg); envs.reset(seed=0)\n"
            "torch.optim.Adam([torch.zeros(1, requires_grad=True)])\n"
            "envs.close(); print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-1500:])


def test_render_samples_turns_off_a_mujoco_envs_anti_aliasing_before_its_first_frame():
    from visppo.envs import preload_before_gl

    preload_before_gl()  # this process may build an optimizer after the GL context (see the test above)
    base = ["env.id=Reacher-v5", "env.pixels=true", "env.image_size=48"]
    frames, samples = [], []
    for extra in ([], ["env.render_samples=0"]):  # one GL context at a time
        env = make_env(load_config(None, base + extra))
        try:
            obs, _ = env.reset(seed=3)
            frames.append(obs["pixels"].astype(int))
            samples.append(env.unwrapped.mujoco_renderer._get_viewer("rgb_array").con.offSamples)
        finally:
            env.close()
    assert samples == [4, 0]  # Reacher-v5's own, then ours: set before the first frame built the context
    diff = np.abs(frames[0] - frames[1])
    assert frames[1].mean() > 20 and 0 < diff.mean() < 5.0  # only edges change, not the scene


def test_render_samples_is_refused_for_an_env_that_is_not_mujoco():
    with pytest.raises(ConfigError, match="env.render_samples"):
        make_env(load_config(None, [DOT, "env.render_samples=0"]))
    with pytest.raises(ConfigError, match="env.render_samples"):
        load_config(None, [DOT, "env.render_samples=-2"])


def test_with_pixels_off_the_render_keys_are_applied_or_refused_never_ignored():
    """env.pixels=false: the env's own observations; env.camera cannot choose them, and
    env.render_samples goes to its renderer (refused for one that is not MuJoCo), as with pixels on."""
    own = "visppo_envs:visppo/DotReach-v0"
    with pytest.raises(ConfigError, match="with env.pixels=false the env's own observations choose their camera"):
        make_env(load_config(None, tiny_overrides(**{"env.id": own, "env.pixels": "false", "env.camera": "nope",
                                                     "env.vector": "sync"})))
    with pytest.raises(ConfigError, match="env.render_samples"):
        make_env(load_config(None, tiny_overrides(**{"env.id": own, "env.pixels": "false", "env.render_samples": 0,
                                                     "env.vector": "sync"})))


class _TakesACamera(gym.Env):
    """Renders, takes ``camera_name`` but no render size."""

    metadata = {"render_modes": ["rgb_array"]}
    observation_space = gym.spaces.Box(-1, 1, (2,))
    action_space = gym.spaces.Box(-1, 1, (2,))

    def __init__(self, render_mode=None, camera_name=None):
        self.render_mode, self.camera_name = render_mode, camera_name


class _TakesNoCamera(_TakesACamera):
    def __init__(self, render_mode=None):
        super().__init__(render_mode)


def test_an_env_without_a_render_size_still_gets_the_camera_asked_for(monkeypatch):
    seen = []
    monkeypatch.setattr(envs_module, "check_camera", lambda env, camera, env_id: seen.append(env.unwrapped.camera_name))
    for name, cls in (("TakesACamera-v0", _TakesACamera), ("TakesNoCamera-v0", _TakesNoCamera)):
        monkeypatch.setitem(gym.registry, name, gym.envs.registration.EnvSpec(name, entry_point=cls))
    cfg = load_config(None, tiny_overrides(**{"env.id": "TakesACamera-v0", "env.camera": "side"}))
    with pytest.raises(NotImplementedError):  # past the camera: the stub cannot reset, let alone render
        make_env(cfg)
    assert seen == ["side"]
    cfg = load_config(None, tiny_overrides(**{"env.id": "TakesNoCamera-v0", "env.camera": "side"}))
    with pytest.raises(ConfigError, match="takes no camera_name: remove env.camera"):
        make_env(cfg)


@pytest.mark.parametrize("cpus, overrides, expected", [
    (2, [], False),                                   # 2 CPUs: the learner's process steps the envs
    (4, [], True),                                    # more: worker processes render in parallel
    (4, ["env.id=visppo/DotReach-v0"], False),        # synthetic: never worth a process
    (4, ["ppo.num_envs=1", "ppo.minibatch_size=64"], False),
    (2, ["env.vector=async"], True),                  # an explicit choice is kept
    (4, ["env.vector=sync"], False),
    (2, ["env.id=my_robot.envs:Arm-v0"], True),       # a user's env: in workers on any machine
    (2, ["env.id=my_robot.envs:Arm-v0", "ppo.num_envs=1", "ppo.minibatch_size=64"], True),
    (4, ["env.id=my_robot.envs:Arm-v0", "env.vector=sync"], False),  # unless told
    (4, ["env.id=dmc:reacher-easy", "ppo.num_envs=1", "ppo.minibatch_size=64"], False),  # not a module
])
def test_auto_vector_mode_follows_the_cpus(monkeypatch, cpus, overrides, expected):
    monkeypatch.setattr(envs_module, "usable_cpus", lambda: cpus)
    assert use_async(load_config(None, ["ppo.num_envs=8", *overrides])) is expected


def test_reach_frames_are_the_same_in_the_learners_process_and_in_workers():
    """Choosing sync or async changes where an env renders, never what it shows."""
    runs = []
    for vector in ("sync", "async"):
        envs = make_vector_env(load_config(None, ["ppo.num_envs=2", "env.image_size=48", f"env.vector={vector}"]))
        try:
            obs, _ = envs.reset(seed=0)
            frames = [obs["pixels"]]
            for a in np.random.default_rng(0).uniform(-1, 1, (5, 2, 2)).astype(np.float32):
                frames.append(envs.step(a)[0]["pixels"])
        finally:
            envs.close()
        runs.append(np.stack(frames))
    assert runs[0].std() > 0 and np.array_equal(runs[0], runs[1])


CUSTOM_ENV = '''
import gymnasium as gym
import numpy as np


class Blink(gym.Env):
    """A user's own env: a 32x32 image that lights up where the action points."""

    def __init__(self, brightness=255):
        self.brightness = brightness
        self.observation_space = gym.spaces.Box(0, 255, (32, 32, 3), np.uint8)
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def _obs(self, action):
        img = np.zeros((32, 32, 3), np.uint8)
        i, j = ((np.asarray(action) + 1) * 15.5).astype(int)
        img[i, j] = self.brightness
        return img

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(np.zeros(2)), {}

    def step(self, action):
        return self._obs(action), float(-np.abs(action).sum()), False, False, {}


gym.register("{name}/Blink-v0", entry_point="{name}:Blink", max_episode_steps=16)
'''


def _custom_module(tmp_path, name: str) -> str:
    (tmp_path / f"{name}.py").write_text(CUSTOM_ENV.replace("{name}", name))
    return name


def test_a_custom_env_module_trains_from_the_command_line(tmp_path):
    """`env.id=module:EnvId`: gymnasium imports the module (found on PYTHONPATH), which registers the id;
    `env.kwargs` reaches the env's constructor."""
    import os
    import subprocess
    import sys

    name = _custom_module(tmp_path, "my_blink_robot")
    overrides = tiny_overrides(tmp_path, **{"env.id": f"{name}:{name}/Blink-v0", "env.pixels": "false",
                                            "env.kwargs.brightness": 200, "env.image_size": 36})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    proc = subprocess.run([sys.executable, "-m", "visppo", "train", *overrides], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # header + 128 steps / (2 envs x 32)
    bad = tiny_overrides(tmp_path, **{"env.id": "no_such_robot_pkg:Arm-v0", "run.dir": str(tmp_path / "bad")})
    proc = subprocess.run([sys.executable, "-m", "visppo", "train", *bad], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: env.id no_such_robot_pkg:Arm-v0: cannot import module 'no_such_robot_pkg'")
    assert "PYTHONPATH" in proc.stderr and not (tmp_path / "bad").exists()


def test_a_custom_env_gets_its_kwargs_and_bad_ones_are_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _custom_module(tmp_path, "my_blink_kwargs")
    base = [f"env.id={name}:{name}/Blink-v0", "env.pixels=false", "env.image_size=36"]
    for vector in ("auto", "sync"):  # the env in a process of its own (EnvProcess), or in this one
        env = make_env(load_config(None, [*base, "env.kwargs.brightness=77", f"env.vector={vector}"]))
        assert isinstance(env.unwrapped, EnvProcess) is (vector == "auto")
        obs, _ = env.reset(seed=0)
        assert obs["pixels"].shape == (3, 36, 36) and 0 < obs["pixels"].max() <= 77
        env.close()
        with pytest.raises(ConfigError, match=r"refused its arguments .*colour.*: check env.kwargs"):
            make_env(load_config(None, [*base, "env.kwargs.colour=1", f"env.vector={vector}"]))
    env = make_env(load_config(None, [*base, "env.kwargs.brightness=77", "env.vector=sync"]))
    assert env.unwrapped.brightness == 77


def test_an_env_process_forwards_the_side_camera_only_where_the_env_has_one():
    """Evaluation videos show ``env.unwrapped.render_view`` beside the policy's frames: an env run in
    a process of its own keeps that view, and one without it gets no ``render_view``."""
    here = gym.make("visppo/Reach-v0", image_size=32)
    apart = EnvProcess(functools.partial(gym.make, "visppo_envs:visppo/Reach-v0", image_size=32), "reach")
    try:
        here.reset(seed=1)
        apart.reset(seed=1)
        view = apart.render_view(width=64, height=48)
        assert view.shape == (48, 64, 3) and view.std() > 0
        assert np.array_equal(view, here.unwrapped.render_view(width=64, height=48))
    finally:
        apart.close()
        here.close()
    dot = EnvProcess(functools.partial(gym.make, "visppo_envs:visppo/DotReach-v0"), "dot")
    try:
        assert getattr(dot, "render_view", None) is None
    finally:
        dot.close()


def test_a_custom_module_that_does_not_register_the_id_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _custom_module(tmp_path, "my_blink_ids")
    with pytest.raises(ConfigError, match=rf"module '{name}' imported but did not register 'Blinky-v0' "
                                          rf"\(it registers {name}/Blink-v0\)"):
        check_env_id(f"{name}:Blinky-v0")
    (tmp_path / "my_broken_env.py").write_text("raise RuntimeError('needs a robot arm attached')\n")
    with pytest.raises(ConfigError, match=r"cannot import module 'my_broken_env' \(RuntimeError: needs a robot"):
        check_env_id("my_broken_env:Arm-v0")
    with pytest.raises(ConfigError, match="must look like module:EnvId"):
        check_env_id(":Arm-v0")


def test_a_class_entry_point_counts_among_the_ids_a_module_registers(tmp_path, monkeypatch):
    """gymnasium's tutorial registers the class itself: a wrong version then names the ids there."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_class_ids.py").write_text(CUSTOM_ENV.replace("{name}", "my_class_ids").replace(
        'entry_point="my_class_ids:Blink"', "entry_point=Blink"))
    with pytest.raises(ConfigError, match=r"did not register 'my_class_ids/Blink-v1' \(it registers my_class_ids/Blink-v0\)"):
        check_env_id("my_class_ids:my_class_ids/Blink-v1")


def test_a_typeerror_in_an_envs_constructor_is_the_envs_not_its_kwargs(tmp_path, monkeypatch):
    """Only an argument the constructor refuses reads "check env.kwargs"; a TypeError of its own
    code is the env's to fix, and is not run a second time without a render size."""
    from visppo.errors import EnvError

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_buggy_ctor.py").write_text(CUSTOM_ENV.replace("{name}", "my_buggy_ctor").replace(
        "        self.brightness = brightness\n",
        "        import my_buggy_ctor as me\n        me.MADE += 1\n        self.brightness = None * brightness\n")
        + "MADE = 0\n")
    base = ["env.id=my_buggy_ctor:my_buggy_ctor/Blink-v0", "env.vector=sync", "env.pixels=false"]
    cfg = load_config(None, base)
    with pytest.raises(EnvError, match=r"its constructor raised TypeError \(unsupported operand.*fix the env") as info:
        make_env(cfg)
    assert "env.kwargs" not in str(info.value)
    import my_buggy_ctor
    assert my_buggy_ctor.MADE == 1
    with pytest.raises(ConfigError, match=r"refused its arguments .*colour.*: check env.kwargs"):
        make_env(load_config(None, [*base, "env.kwargs.colour=1"]))


def test_an_argument_error_inside_a_rendering_envs_constructor_is_the_envs(tmp_path, monkeypatch):
    """gymnasium appends every argument it passed (width and height among them) to the error: a
    constructor that takes a render size and calls a helper wrongly is not retried without one, and
    is not told to check env.kwargs."""
    from visppo.errors import EnvError

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_sized_env.py").write_text(
        "import gymnasium as gym\nMADE = []\n\n\ndef helper(a, b):\n    return a + b\n\n\n"
        "class Sized(gym.Env):\n    metadata = {'render_modes': ['rgb_array']}\n\n"
        "    def __init__(self, render_mode=None, width=84, height=84):\n"
        "        MADE.append((width, height))\n        helper(1)\n\n\n"
        "gym.register('my_sized_env/Sized-v0', entry_point='my_sized_env:Sized')\n")
    with pytest.raises(EnvError, match=r"its constructor raised TypeError \(helper\(\) missing"):
        make_env(load_config(None, ["env.id=my_sized_env:my_sized_env/Sized-v0", "env.vector=sync",
                                    "env.image_size=48"]))
    import my_sized_env
    assert my_sized_env.MADE == [(48, 48)]  # once: not again without a render size


def test_a_learner_in_a_sweeps_child_process_keeps_its_stop_signals():
    """A SyncVectorEnv makes its envs in the learner's process; a learner that a sweep started in a
    child process has a parent, and must still not ignore SIGTERM (its final checkpoint) there."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_make_in_a_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) == (True, False)  # its handler kept; not taken for a worker
    finally:
        child.join(30)


def _make_in_a_child(queue) -> None:
    import signal

    from visppo import env_process, envs

    handler = lambda *a: None  # noqa: E731 - the learner's (deferred_signals)
    signal.signal(signal.SIGTERM, handler)
    envs._thunk(load_config(None, [DOT]))().close()
    queue.put((signal.getsignal(signal.SIGTERM) is handler, env_process.in_worker))


def test_an_async_workers_leave_sigterm_to_the_learner():
    """A Ctrl-C or SIGTERM reaches the process group: the workers live on for the final checkpoint."""
    import os
    import signal
    import time

    envs = make_vector_env(load_config(None, [DOT, "ppo.num_envs=2", "env.vector=async"]))
    try:
        envs.reset(seed=0)
        for proc in envs.processes:
            os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(proc.is_alive() for proc in envs.processes)
        envs.step(envs.action_space.sample())
    finally:
        envs.close()


def test_frame_stack_fills_pushes_resizes_and_keeps_the_state():
    """FrameStack packs what PixelDict gives the policy, and what deploy.Policy packs a camera's frames with."""
    stack = envs_module.FrameStack(3, keep_state=True, image_size=4)
    frames = [np.full((8, 8, 3), v, np.uint8) for v in (10, 20, 30, 40)]
    first = stack.first({"pixels": frames[0], "state": [1, 2]})
    assert first["pixels"].shape == (9, 4, 4) and first["state"].dtype == np.float32
    assert list(first["pixels"][::3, 0, 0]) == [10, 10, 10]  # the first frame fills the stack
    for frame in frames[1:]:
        out = stack.next({"pixels": frame, "state": [3, 4]})
    assert list(out["pixels"][::3, 0, 0]) == [20, 30, 40]  # oldest first
    plain = envs_module.FrameStack(1, keep_state=False)
    assert set(plain.first(frames[0])) == {"pixels"} and plain.first(frames[0])["pixels"].shape == (3, 8, 8)


def test_a_grayscale_frame_of_another_size_is_resized_as_a_colour_one():
    """HxWx1 frames (a gray camera) resize like each channel of an RGB frame."""
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (10, 12, 1), dtype=np.uint8)
    out = envs_module.chw_frame(gray, 6)
    assert out.shape == (1, 6, 6) and out.dtype == np.uint8
    rgb = envs_module.chw_frame(np.repeat(gray, 3, axis=2), 6)
    assert np.array_equal(out[0], rgb[0]) and np.array_equal(out[0], rgb[2])


def test_a_frame_stack_of_gray_frames_keeps_each_frame_when_the_camera_reuses_its_buffer():
    """An HxWx1 frame transposes to a contiguous view: the stack must copy it, as it does RGB."""
    stack = envs_module.FrameStack(3, keep_state=False)
    buf = np.zeros((4, 4, 1), np.uint8)
    buf[:] = 10
    stack.first(buf)
    buf[:] = 20
    stack.next(buf)
    buf[:] = 30
    assert list(stack.next(buf)["pixels"][:, 0, 0]) == [10, 20, 30]


def test_a_seeded_reset_of_a_used_env_replays_the_streams_first_episode():
    env = envs_module.SeededEpisodes(gym.make("visppo/DotReach-v0"))
    first, _ = env.reset(seed=7)
    env.reset()
    again, _ = env.reset(seed=7)
    assert np.array_equal(first, again) and env.episode == 0


def test_action_repeat_stops_at_the_episode_end():
    class Counted(gym.Wrapper):
        steps = 0

        def step(self, action):
            Counted.steps += 1
            return self.env.step(action)

    env = envs_module.ActionRepeat(Counted(gym.make("visppo/DotReach-v0", max_episode_steps=2)), repeat=3)
    env.reset(seed=0)
    *_, terminated, truncated, _ = env.step(env.action_space.sample())
    assert truncated and not terminated and Counted.steps == 2  # the time limit ended it after 2 of 3


def test_action_repeat_stops_at_termination_with_the_rewards_up_to_it():
    class EndsOnSecondStep(gym.Env):
        observation_space = gym.spaces.Box(0, 1, (1,))
        action_space = gym.spaces.Box(-1, 1, (1,))
        rewards = (1.0, 10.0, 100.0)

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return np.zeros(1, np.float32), {}

        def step(self, action):
            self.t += 1
            return np.full(1, self.t, np.float32), self.rewards[self.t - 1], self.t == 2, False, {}

    env = envs_module.ActionRepeat(EndsOnSecondStep(), repeat=3)
    env.reset()
    obs, reward, terminated, truncated, _ = env.step(np.zeros(1))
    assert terminated and not truncated and reward == 11.0 and obs[0] == 2  # the third step never ran


def test_async_workers_never_fork(monkeypatch):
    """Forking after an EGL context hangs: workers start from the forkserver, or spawn without one."""
    import multiprocessing

    envs = make_vector_env(load_config(None, ["ppo.num_envs=2", "env.image_size=48", "env.vector=async"]))
    try:
        kinds = {type(p).__name__ for p in envs.processes}
    finally:
        envs.close()
    assert kinds == {"ForkServerProcess"}
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    assert envs_module.worker_start_method.__wrapped__() == "spawn"


def test_each_episode_of_a_vector_env_starts_with_a_stack_of_its_own_first_frame():
    """SAME_STEP autoreset: the observation that starts episode 2 is its first frame k times, no
    frame of episode 1 left in the stack (checked at the env level, not only through deploy)."""
    from visppo.envs import make_vector_env

    cfg = load_config(None, tiny_overrides(None, **{"ppo.num_envs": 1, "env.frame_stack": 3,
                                                    "env.max_episode_steps": 4, "env.vector": "sync"}))
    envs = make_vector_env(cfg)
    try:
        envs.reset(seed=0)
        for _ in range(4):
            obs, _, terminated, truncated, info = envs.step(np.ones((1, 2), np.float32))
        assert truncated[0] or terminated[0]
        first = obs["pixels"][0]
        assert np.array_equal(first[0:3], first[3:6]) and np.array_equal(first[3:6], first[6:9])
        assert not np.array_equal(info["final_obs"][0]["pixels"][6:9], first[6:9])  # the new episode's frame
    finally:
        envs.close()

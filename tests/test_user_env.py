"""A user's own env (``env.id=module:EnvId``): checked once before any run directory is made
(spaces, one reset, one step), and its failures during a run reported as the env's.

``tests/broken_envs.py`` is the user's module: one env whose ``env.kwargs.defect`` picks what is
wrong with it and ``env.kwargs.at`` from which call (resets and steps, counted over its life).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from broken_envs import DEFECTS
from conftest import one_error_line, run_main, tiny_overrides

from visppo.config import load_config
from visppo.env_check import check_env, is_image_space, validate_spaces
from visppo.errors import ConfigError

START = [d for d in DEFECTS if d != "none"]
"""Every defect, shown from the first call: the start check finds it."""
RUNTIME = [d for d in DEFECTS if d.startswith("step_") and d not in ("step_not_tuple", "step_four_tuple",
                                                                       "step_info_not_dict", "step_terminated_str",
                                                                       "step_reward_str", "step_reward_array")]
"""Defects that a run meets mid-rollout (shown from a later step) and must name as the env's; the
others there are gymnasium's vector env's to refuse (it raises, and worker_errors names the env)."""


def overrides(tmp_path, defect: str, at: int = 0, env: str = "BrokenUnchecked-v0", **extra) -> list[str]:
    return tiny_overrides(tmp_path, **{"env.id": f"broken_envs:{env}", "env.pixels": "false", "env.state": "true",
                                       "env.kwargs.defect": defect, "env.kwargs.at": at, "ppo.total_steps": 64,
                                       **extra})


def nothing_half_written(run_dir) -> None:
    """No run directory, or one whose files are all complete (no temporary file, a loadable latest.pt)."""
    if not run_dir.exists():
        return
    names = {p.name for p in run_dir.rglob("*")}
    assert not [n for n in names if n.endswith(".tmp")], names
    latest = run_dir / "checkpoints" / "latest.pt"
    if latest.exists():
        torch.load(latest, weights_only=True)


def fuzz_cases() -> list[tuple[str, str, int]]:
    """(env id, defect, at): every defect at the start under visppo's check alone, a sample of them
    behind gymnasium's own passive checker, and a sample of mid-run ones at random calls of the
    first rollout (each env makes about 35: a reset, 32 steps, autoresets)."""
    rng = random.Random(59)
    cases = [("BrokenUnchecked-v0", d, 0) for d in START]
    cases += [("Broken-v0", d, 0) for d in rng.sample(START, 8)]
    cases += [(rng.choice(["Broken-v0", "BrokenUnchecked-v0"]), d, rng.randint(3, 30)) for d in rng.sample(RUNTIME, 4)]
    return cases


@pytest.mark.parametrize(("env", "defect", "at"), fuzz_cases(), ids=lambda v: str(v))
def test_fuzz_a_broken_user_env_is_one_error_line_and_leaves_nothing_half_written(tmp_path, capsys, env, defect, at):
    code, err = run_main(capsys, "train", *overrides(tmp_path, defect, at, env))
    if at == 0:  # the start check: bad input, nothing written
        assert code == 2, err
        one_error_line(err, f"broken_envs:{env}")  # the env as the user named it
        assert not (tmp_path / "run").exists()
    else:  # mid-run: the env's fault, exit 1, the env named
        assert code == 1, err
        one_error_line(err, "env broken_envs:")
        nothing_half_written(tmp_path / "run")


def test_a_typeerror_in_the_constructor_is_bad_input_as_any_other_error_there(tmp_path, capsys):
    """visppo.envs.make_env names a TypeError of the constructor's own code as the env's; before a
    run, as a ValueError there, it is one error line, exit 2, without gymnasium's list of kwargs."""
    code, err = run_main(capsys, "train", *overrides(tmp_path, "init_typeerror"))
    assert code == 2, err
    line = one_error_line(err, "env broken_envs:BrokenUnchecked-v0", "constructor raised TypeError (unsupported operand")
    assert "environment creator" not in line
    assert not (tmp_path / "run").exists()


def test_a_healthy_user_env_passes_the_check_and_trains(tmp_path, capsys):
    code, err = run_main(capsys, "train", *overrides(tmp_path, "none", env="Broken-v0"))
    assert code == 0, err
    assert (tmp_path / "run" / "checkpoints" / "latest.pt").is_file()


def test_a_new_run_failing_before_its_first_row_leaves_no_run_dir(tmp_path, capsys):
    """Its TensorBoard events file (opened with the logger) goes with its config.yaml: the
    directory is removed, and the same run.dir starts afresh with one events file, not two."""
    args = overrides(tmp_path, "step_raises", 20, **{"run.tensorboard": True})
    code, err = run_main(capsys, "train", *args)
    assert code == 1, err
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").iterdir())


@pytest.mark.parametrize("defect", ["step_reward_nan"])
def test_an_env_failing_in_iteration_2_keeps_the_checkpoint_of_iteration_1(tmp_path, capsys, defect):
    args = overrides(tmp_path, defect, 40, **{"ppo.total_steps": 128, "run.checkpoint_every": 1})
    code, err = run_main(capsys, "train", *args)
    assert code == 1, err
    one_error_line(err, "env broken_envs:BrokenUnchecked-v0")
    assert torch.load(tmp_path / "run" / "checkpoints" / "latest.pt", weights_only=True)["global_step"] == 64
    nothing_half_written(tmp_path / "run")


@pytest.mark.parametrize("during", ["periodic", "eval"])
def test_an_env_failing_during_evaluation_is_the_envs_error(tmp_path, capsys, during):
    if during == "periodic":  # iteration 1's periodic evaluation (before its checkpoint) meets the defect
        args = overrides(tmp_path, "step_raises", 40, **{"run.eval_every": 1, "run.checkpoint_every": 1,
                                                         "ppo.total_steps": 128})
        code, err = run_main(capsys, "train", *args)
    else:  # visppo eval of a finished run in an env that now fails at its 5th step
        code, err = run_main(capsys, "train", *overrides(tmp_path, "none"))
        assert code == 0, err
        code, err = run_main(capsys, "eval", tmp_path / "run", "env.kwargs.defect=step_raises", "env.kwargs.at=5")
    assert code == 1, err
    line = one_error_line(err, "env broken_envs:BrokenUnchecked-v0", "joint 3 over its torque limit")
    nothing_half_written(tmp_path / "run")
    if during == "periodic":  # no checkpoint and no logged row yet: the run left nothing, and says nothing of it
        assert not (tmp_path / "run" / "config.yaml").exists() and ";" not in line, line


@pytest.mark.parametrize("defect", ["step_reward_none", "step_reward_inf"])
def test_item6_non_finite_env_output_mid_run_names_the_env_not_a_divergence(tmp_path, capsys, defect):
    code, err = run_main(capsys, "train", *overrides(tmp_path, defect, 30))
    assert code == 1, err
    line = one_error_line(err, "env broken_envs:BrokenUnchecked-v0 returned a non-finite")
    assert "diverged" not in line and "learning_rate" not in line


@pytest.mark.parametrize("defect", ["obs_dict_no_pixels", "obs_not_image"])
def test_item2_a_bad_observation_space_names_the_env_as_the_user_wrote_it(tmp_path, capsys, defect):
    """PixelDict's refusal names env.id (module:EnvId), not the gymnasium id below it."""
    code, err = run_main(capsys, "train", *overrides(tmp_path, defect))
    assert code == 2, err
    one_error_line(err, "env broken_envs:BrokenUnchecked-v0: its ")


# --------------------------------------------------------------------------- envs that end their process

TESTS = Path(__file__).resolve().parent


def visppo_train(tmp_path, args: list[str]) -> subprocess.CompletedProcess:
    """``python -m visppo train ARGS`` in a process of its own (a crash in this one would end the
    tests), ``broken_envs`` on its PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    return subprocess.run([sys.executable, "-m", "visppo", "train", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)


KEPT = "the run's last checkpoint is kept: once the env is fixed, visppo train --resume"


@pytest.mark.parametrize(("defect", "at", "extra", "needle", "kept"), [
    # the start check's step, in the check's own process: no run folder, nothing said about one
    ("step_segfaults", 0, {}, "during step(), the process it runs in died of signal SIGSEGV (a crash in the env", None),
    # a rollout worker in iteration 2: iteration 1's checkpoint stays
    ("step_segfaults", 40, {}, ("during step, worker ", "died of signal SIGSEGV (a crash in the env"), 64),
    # the periodic evaluation of iteration 2 (its env's 80th call; the workers make 68 in 2 iterations)
    ("step_segfaults", 80, {"run.eval_every": 2, "ppo.total_steps": 192},
     "during step(), the process it runs in died of signal SIGSEGV", 64),
    # sys.exit(3) in a worker, and in this process (env.vector=sync): never mistaken for an exit
    ("step_exits", 40, {}, ("during step, worker ", "exited with code 3 (sys.exit or os._exit"), 64),
    ("step_exits", 40, {"env.vector": "sync"}, "failed during step: called sys.exit(3)", 64),
], ids=["check-segfault", "rollout-segfault", "eval-segfault", "worker-sys-exit", "sync-sys-exit"])
def test_an_env_that_ends_its_process_is_one_error_line_naming_the_env(tmp_path, defect, at, extra, needle, kept):
    args = overrides(tmp_path, defect, at, **{"run.checkpoint_every": 1, "ppo.total_steps": 128, **extra})
    proc = visppo_train(tmp_path, args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr, "env broken_envs:BrokenUnchecked-v0", *([needle] if isinstance(needle, str) else needle))
    run_dir = tmp_path / "run"
    assert (KEPT in line) == (kept is not None), line
    if kept is None:
        assert not run_dir.exists()
    else:
        assert torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)["global_step"] == kept
        nothing_half_written(run_dir)


# --------------------------------------------------------------------------- validate_spaces


def _cfg(**extra):
    return load_config(None, [f"{k}={v}" for k, v in {"env.state": "true", **extra}.items()])


IMAGE = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
STATE = gym.spaces.Box(-1, 1, (2,), np.float32)


@pytest.mark.parametrize(("obs", "action", "needle"), [
    (gym.spaces.Dict({"image": IMAGE, "state": STATE}), gym.spaces.Discrete(2), "no 'pixels' key"),
    (gym.spaces.Dict({"pixels": IMAGE}), gym.spaces.Discrete(2), "no state vector"),
    (gym.spaces.Dict({"pixels": IMAGE, "state": gym.spaces.Discrete(2)}), gym.spaces.Discrete(2), "not a Box"),
    (STATE, gym.spaces.Discrete(2), "not an image"),
    (gym.spaces.Dict({"pixels": IMAGE, "state": STATE}), gym.spaces.MultiDiscrete([2, 2]), "not supported"),
    (gym.spaces.Dict({"pixels": IMAGE, "state": STATE}), gym.spaces.Box(-1, 1, (2, 2)), "1-D float Box"),
    (gym.spaces.Dict({"pixels": IMAGE, "state": STATE}), gym.spaces.Discrete(3, start=-1), "starts at -1"),
])
def test_validate_spaces_names_what_visppo_cannot_act_in(obs, action, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_spaces(obs, action, _cfg())


CHANNELS_FIRST = gym.spaces.Box(0, 255, (3, 40, 36), np.uint8)


class ChannelsFirstEnv(gym.Env):
    """A user's env that gives CxHxW frames and renders HxWxC ones too."""

    metadata = {"render_modes": ["rgb_array"]}
    observation_space = CHANNELS_FIRST
    action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    render_mode = "rgb_array"

    def reset(self, *, seed=None, options=None):
        return np.zeros(CHANNELS_FIRST.shape, np.uint8), {}

    def step(self, action):
        return np.zeros(CHANNELS_FIRST.shape, np.uint8), 0.0, False, False, {}

    def render(self):
        return np.zeros((40, 36, 3), np.uint8)


def test_an_image_space_is_hxwxc_with_1_3_or_4_channels():
    """What chw_frame transposes for the network and videos show: a CxHxW Box is not one (its rows
    would be read as channels), and is refused with the transpose to make."""
    for channels in (1, 3, 4):
        assert is_image_space(gym.spaces.Box(0, 255, (40, 36, channels), np.uint8))
    for obs in (CHANNELS_FIRST, gym.spaces.Dict({"pixels": CHANNELS_FIRST, "state": STATE})):
        assert not is_image_space(obs)
        with pytest.raises(ConfigError, match=r"shape \(3, 40, 36\), channels first \(CxHxW\): visppo takes "
                                              r"HxWxC frames; transpose .*\(40, 36, 3\)") as err:
            validate_spaces(obs, gym.spaces.Discrete(2), _cfg())
        assert "\n" not in str(err.value)
    two = gym.spaces.Box(0, 255, (40, 36, 2), np.uint8)
    with pytest.raises(ConfigError, match=r"2 channels last: visppo takes HxWxC frames of 1 \(gray\), 3"):
        validate_spaces(two, gym.spaces.Discrete(2), _cfg(**{"env.state": "false"}))


def test_a_code_env_with_channels_first_frames_is_refused_not_rendered_in_their_place():
    """env.pixels=true renders only envs that observe no images: a CxHxW one is named, not trained
    on its renders instead of its observations."""
    from visppo.envs import make_env, register_code_env

    env_id = register_code_env(ChannelsFirstEnv)
    with pytest.raises(ConfigError, match=r"channels first \(CxHxW\)"):
        make_env(load_config(None, [f"env.id={env_id}", "env.image_size=36"]))


def test_visppo_tasks_pass_the_check():
    from visppo.envs import make_env

    check_env(load_config(None, ["env.id=visppo/DotReach-v0", "env.image_size=48"]), make_env)


@pytest.mark.parametrize("defect, needle", [("step_reward_nan", "returned a non-finite reward"),
                                            ("step_success_str", "info['is_success']=")])
def test_evaluation_checks_the_envs_output_as_training_does(tmp_path, capsys, defect, needle):
    """visppo eval of a finished run in an env that turns bad at its 5th step: one error line, not
    a NaN return or a string read as success."""
    code, err = run_main(capsys, "train", *overrides(tmp_path, "none"))
    assert code == 0, err
    code, err = run_main(capsys, "eval", tmp_path / "run", "env.kwargs.defect=" + defect, "env.kwargs.at=5")
    assert code == 1, err
    one_error_line(err, "env broken_envs:BrokenUnchecked-v0", needle)

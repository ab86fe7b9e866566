"""tools/speed_vs_sb3.py: visppo and SB3 timed side by side in one script, on the CPU at the
tiniest sizes (the GPU run is tools/gpu_session.sh's); bad input is one ``error:`` line, exit 2,
and writes no JSON."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from conftest import one_error_line

TOOLS = Path(__file__).resolve().parents[1] / "tools"
TINY = ["--device", "cpu", "--num-envs", "2", "--steps-per-env", "16", "--minibatch", "32", "--epochs", "1",
        "--iterations", "1", "--repeats", "1", "--threads", "1"]


def tool():
    """tools/speed_vs_sb3.py as a module; tools/ on sys.path so that it (and the processes it
    spawns) import tools/bench.py and tools/bench_sb3.py by name."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module("speed_vs_sb3")


def call(capsys, *args) -> tuple[int, str, str]:
    try:
        code = tool().main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_both_learners_are_timed_and_the_ratio_is_their_quotient(tmp_path, capsys, monkeypatch):
    pytest.importorskip("stable_baselines3", reason="the SB3 comparison needs stable-baselines3")
    monkeypatch.setenv("MUJOCO_GL", "egl")
    out = tmp_path / "speed.json"
    code, text, err = call(capsys, *TINY, "--json", out)
    assert code == 0, err
    fig = json.loads(out.read_text())
    assert fig["complete"] and fig["device"] == "cpu" and fig["torch"] and fig["stable_baselines3"] and fig["date"]
    assert {k: fig["sizes"][k] for k in (
        "image_size", "frame_stack", "encoder", "num_envs", "steps_per_env", "minibatch", "epochs")} == {
        "image_size": 84, "frame_stack": 3, "encoder": "nature", "num_envs": 2, "steps_per_env": 16,
        "minibatch": 32, "epochs": 1}
    for learner in ("visppo", "sb3"):
        assert len(fig[learner]["runs"]) == 1
        for key in ("steps_per_s", "collect_s", "update_s"):
            assert fig[learner]["median"][key] > 0, (learner, key)
    assert fig["ratio"] == pytest.approx(fig["visppo"]["median"]["steps_per_s"] / fig["sb3"]["median"]["steps_per_s"])
    # the placement is visppo bench devices' own, printed beside the figures
    assert fig["placement"]["train.device"] == "cpu" and "recommended: train.device=cpu" in fig["placement"]["text"]
    for needle in ("visppo ", "SB3 ", "visppo / SB3:", "recommended: train.device=cpu"):
        assert needle in text, text


def test_the_placement_is_saved_before_the_first_timed_run(tmp_path, capsys, monkeypatch):
    """A device call cut short during the first repeat still has visppo bench's placement."""
    pytest.importorskip("stable_baselines3", reason="the SB3 comparison needs stable-baselines3")
    monkeypatch.setenv("MUJOCO_GL", "egl")
    module = tool()

    def cut(*args, **kwargs):
        raise KeyboardInterrupt  # the call's timeout

    monkeypatch.setattr(module, "visppo_run", cut)
    out = tmp_path / "speed.json"
    with pytest.raises(KeyboardInterrupt):
        module.main([str(a) for a in (*TINY, "--json", out)])
    fig = json.loads(out.read_text())
    assert not fig["complete"] and fig["placement"]["train.device"] == "cpu" and fig["date"]
    assert "recommended: train.device=cpu" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--num-envs", "0"], "--num-envs must be at least 1"),
    (["--repeats", "0"], "--repeats"),
    (["--iterations", "0"], "--iterations"),
    (["--num-envs", "2", "--steps-per-env", "8", "--minibatch", "64"], "larger than the rollout"),
    (["--visppo", "ppo.num_envs=4"], "matched sizes"),
    (["--visppo", "train.amp"], "KEY=VALUE"),
    (["--visppo", "ppo.gamma=2"], "ppo.gamma"),
    (["--visppo", "env.action_repeat=4"], "would change visppo's work and not SB3's"),
    (["--visppo", "ppo.target_kl=0.01"], "would change visppo's work and not SB3's"),
    (["--device", "cpu", "--visppo", "train.amp=fp16"], "fp16 needs a CUDA device"),
    (["--config", TOOLS.parent / "configs" / "dot_reach.yaml"], "pixel Reacher-v5"),
    (["--config", "no/such.yaml"], "no such file"),
    (["--device", "tpu"], "--device"),
])
def test_bad_input_is_one_error_line_exit_2_and_no_json(tmp_path, capsys, args, needle):
    out = tmp_path / "speed.json"
    code, text, err = call(capsys, *args, "--json", out)
    assert code == 2 and text == "" and not out.exists()
    one_error_line(err, needle)


def test_a_missing_json_folder_is_refused(tmp_path, capsys):
    code, _, err = call(capsys, "--json", tmp_path / "nowhere" / "speed.json")
    assert code == 2 and one_error_line(err, "does not exist")
    code, _, err = call(capsys, "--json", tmp_path)
    assert code == 2 and one_error_line(err, "is a folder")


def test_a_config_that_gives_visppo_other_work_than_sb3s_is_refused(tmp_path, capsys):
    config = tmp_path / "repeat.yaml"
    config.write_text((TOOLS.parent / "configs" / "reacher_pixels.yaml").read_text().replace(
        "  frame_stack: 1\n", "  frame_stack: 1\n  action_repeat: 2\n"))
    code, text, err = call(capsys, "--config", config, "--json", tmp_path / "speed.json")
    assert code == 2 and text == "" and not (tmp_path / "speed.json").exists()
    one_error_line(err, "env.action_repeat=2", "SB3's side has 1")


def test_sb3s_seeding_leaves_cudnn_as_visppo_runs_it(monkeypatch):
    """On a GPU SB3's seed switches cuDNN to its deterministic algorithms (slower), for SB3 alone:
    the timed SB3 run puts it back to what visppo's train.deterministic (off) gives."""
    pytest.importorskip("stable_baselines3", reason="the SB3 comparison needs stable-baselines3")
    import stable_baselines3.common.base_class as base
    import torch
    from stable_baselines3 import PPO

    tool()
    import bench_sb3

    def as_on_a_gpu(seed, using_cuda=False):
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    monkeypatch.setattr(base, "set_random_seed", as_on_a_gpu)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    seen, real_learn = [], PPO.learn
    monkeypatch.setattr(PPO, "learn", lambda self, *a, **k: seen.append(torch.backends.cudnn.deterministic)
                        or real_learn(self, *a, **k))
    monkeypatch.setenv("MUJOCO_GL", "egl")
    bench_sb3.run(1, 1, 0, num_envs=1, n_steps=16, batch_size=16, n_epochs=1)
    assert seen == [False]


def test_cuda_without_a_gpu_exits_2(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "speed.json"
    code, text, err = call(capsys, "--device", "cuda", "--json", out)
    assert code == 2 and text == "" and not out.exists()
    one_error_line(err, "--device cuda", "--device cpu")


def test_without_stable_baselines3_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    module = tool()
    real = module.importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "stable_baselines3" else real(name, *a))
    out = tmp_path / "speed.json"
    code, text, err = call(capsys, "--json", out)
    assert code == 2 and text == "" and not out.exists()
    one_error_line(err, "pip install stable-baselines3")

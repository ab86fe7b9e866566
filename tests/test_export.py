"""visppo export: ONNX, torch.export (pt2) and TorchScript files that act as the eager policy does, a shareable folder
that visppo.load_policy loads, and the deploy extra's one-line error when it is missing."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import act_on, evaluate_recorded, one_error_line, run_main, tiny_kwargs

import visppo
from visppo import export as export_module
from visppo.deploy import load_policy
from visppo.errors import ConfigError

TOLERANCE = 1e-4
"""The largest difference allowed between an exported network's actions and the eager policy's."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny DotReach run that reads 2 stacked frames and a state vector: both inputs exported."""
    tmp = tmp_path_factory.mktemp("export")
    return visppo.train(None, **tiny_kwargs(tmp, env__frame_stack=2, env__state=True, ppo__total_steps=64,
                                            ppo__num_epochs=1))


@pytest.fixture(scope="module")
def recorded(run_dir):
    """Evaluation's episodes: raw frames, and the 100 packed observations the policy read first."""
    with pytest.MonkeyPatch.context() as patch:
        raw, packed = evaluate_recorded(patch, run_dir)
    obs = [o for episode in packed for o in episode["obs"]][:100]
    taken = [a for episode in packed for a in episode["actions"]]
    return raw, np.stack([o["pixels"] for o in obs]), np.stack([o["state"] for o in obs]), np.stack(taken)


def exported(run_dir, tmp_path, capsys, fmt):
    out = tmp_path / fmt
    code, err = run_main(capsys, "export", run_dir, "--format", fmt, "--out", out)
    assert code == 0, err
    return out


def test_onnx_runs_in_onnx_runtime_with_the_eager_policys_actions(run_dir, recorded, tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime", reason="the deploy extra (pip install -e \".[deploy]\")")
    _, pixels, state, taken = recorded
    eager = load_policy(run_dir).act_stacked(pixels, state)
    assert pixels.shape == (100, 6, 48, 48) and pixels.dtype == np.uint8
    # the eager policy is evaluation's (a batch of 100 rounds otherwise than evaluation's batches of 1)
    assert np.max(np.abs(eager[:50] - taken[:50])) <= 1e-6
    out = exported(run_dir, tmp_path, capsys, "onnx")
    session = ort.InferenceSession(str(out / "policy.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixels", "state"]
    (actions,) = session.run(["action"], {"pixels": pixels, "state": state})
    diff = float(np.max(np.abs(actions - eager)))
    print(f"ONNX Runtime vs eager, {len(pixels)} observations: max abs diff {diff:.3g}")
    assert actions.shape == eager.shape and diff <= TOLERANCE
    spec = json.loads((out / "policy.json").read_text())
    assert spec["inputs"]["pixels"]["shape"] == ["batch", 6, 48, 48] and spec["frame_stack"] == 2
    assert spec["inputs"]["pixels"]["dtype"] == "uint8" and spec["action"]["low"] == [-1.0, -1.0]
    assert spec["files"]["model"] == "policy.onnx" and spec["config"]["env"]["state"] is True


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")  # still loads; pt2 is the successor
def test_torchscript_loads_with_torch_jit_and_acts_as_the_eager_policy(run_dir, recorded, tmp_path, capsys):
    _, pixels, state, _ = recorded
    eager = load_policy(run_dir).act_stacked(pixels, state)
    out = exported(run_dir, tmp_path, capsys, "torchscript")
    network = torch.jit.load(str(out / "policy.pt"))
    with torch.no_grad():
        actions = network(torch.from_numpy(pixels), torch.from_numpy(state)).numpy()
    diff = float(np.max(np.abs(actions - eager)))
    print(f"TorchScript vs eager, {len(pixels)} observations: max abs diff {diff:.3g}")
    assert actions.shape == eager.shape and diff <= TOLERANCE
    assert sorted(p.name for p in out.iterdir()) == ["policy.json", "policy.pt"]


def test_pt2_loads_with_torch_export_and_acts_as_the_eager_policy(run_dir, recorded, tmp_path, capsys):
    _, pixels, state, _ = recorded
    eager = load_policy(run_dir).act_stacked(pixels, state)
    out = exported(run_dir, tmp_path, capsys, "pt2")
    network = torch.export.load(str(out / "policy.pt2")).module()
    with torch.no_grad():
        actions = network(torch.from_numpy(pixels), torch.from_numpy(state)).numpy()
        three = network(torch.from_numpy(pixels[:3]), torch.from_numpy(state[:3])).numpy()
    diff = float(np.max(np.abs(actions - eager)))
    print(f"torch.export vs eager, {len(pixels)} observations: max abs diff {diff:.3g}")
    assert actions.shape == eager.shape and diff <= TOLERANCE
    assert np.max(np.abs(three - eager[:3])) <= TOLERANCE  # the batch dimension is not fixed at export
    assert sorted(p.name for p in out.iterdir()) == ["policy.json", "policy.pt2"]
    assert json.loads((out / "policy.json").read_text())["files"]["model"] == "policy.pt2"


def test_the_folder_holds_weights_config_and_a_model_card_and_loads(run_dir, recorded, tmp_path, capsys):
    pytest.importorskip("safetensors", reason="the deploy extra (pip install -e \".[deploy]\")")
    raw = recorded[0]
    code, err = run_main(capsys, "eval", run_dir, "--episodes", "3", "--deterministic", "--seed", "7",
                         "--json", run_dir / "final_eval.json")
    assert code == 0, err
    evaluation = json.loads((run_dir / "final_eval.json").read_text())
    out = exported(run_dir, tmp_path, capsys, "folder")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.yaml", "model.safetensors", "policy.json"]
    exported_cfg, run_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (out, run_dir))
    assert exported_cfg["ppo"]["total_steps"] == 64
    # the run's config as it trained, devices included (rollout.device auto, not the CPU it loads on)
    assert {k: exported_cfg[k] for k in ("train", "rollout")} == {k: run_cfg[k] for k in ("train", "rollout")}
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: visppo\n")  # the Hub's front matter
    from visppo.seeding import EVAL, episode_seed

    seeds = ", ".join(str(episode_seed(7, i, EVAL)) for i in range(3))
    for needle in ["task: `visppo/DotReach-v0`", "budget: 64 agent steps", f"{evaluation['mean_return']:.2f}",
                   "over 3 episodes (deterministic actions)", f"seed 7: episode reset seeds {seeds}",
                   "`visppo train config.yaml`"]:
        assert needle in card, needle
    policy = visppo.load_policy(out)
    assert policy.info["global_step"] == 64 and policy.spec.state_dim == 4
    assert act_on(policy, raw) == 0.0  # the folder's policy is the run's, bit for bit


def test_the_cli_offers_every_format_export_writes():
    from visppo.cli import build_parser

    export_parser = build_parser()._subparsers._group_actions[0].choices["export"]
    [fmt] = [a for a in export_parser._actions if a.dest == "format"]
    assert tuple(fmt.choices) == export_module.FORMATS  # the CLI keeps torch out of its imports: a copy


def test_a_run_never_evaluated_says_so_in_its_card(run_dir):
    policy = load_policy(run_dir)
    card = export_module.model_card(policy, None)
    assert "Not evaluated" in card and f"visppo eval {run_dir}" in card


@pytest.mark.parametrize("fmt, module", [("onnx", "onnxscript"), ("folder", "safetensors")])
def test_without_the_deploy_extra_one_error_line_names_it(run_dir, tmp_path, capsys, monkeypatch, fmt, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed: imports of it fail
    code, err = run_main(capsys, "export", run_dir, "--format", fmt, "--out", tmp_path / "out")
    assert code == 2
    one_error_line(err, 'pip install -e ".[deploy]"', module)
    assert list(tmp_path.iterdir()) == []


def test_loading_a_folder_without_safetensors_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "policy.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[deploy\]"'):
        visppo.load_policy(tmp_path)


def test_a_bad_out_or_a_failed_export_leaves_nothing(run_dir, tmp_path, capsys, monkeypatch):
    code, err = run_main(capsys, "export", tmp_path / "no_run", "--out", tmp_path / "a" / "b")
    assert code == 2 and "not found" in one_error_line(err) and not (tmp_path / "a").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    code, err = run_main(capsys, "export", run_dir, "--format", "torchscript", "--out", full)
    assert code == 2 and "not empty" in one_error_line(err)
    assert [p.name for p in full.iterdir()] == ["keep.txt"]

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "write_network", broken)
    with pytest.raises(OSError):
        export_module.export(run_dir, tmp_path / "new", "torchscript")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no new folder, no temporary one
    code, err = run_main(capsys, "export", run_dir, "--format", "tflite", "--out", tmp_path / "x")
    assert code == 2 and "tflite" in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("out", [".", "../here"])
def test_the_folder_you_are_in_is_refused_as_out_before_any_work(run_dir, tmp_path, capsys, monkeypatch, out):
    """An empty current folder passed the emptiness check, then the export failed on rmdir('.'), exit 1."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)

    def built(*args, **kwargs):
        raise AssertionError("exported before --out was checked")

    monkeypatch.setattr(export_module, "write_network", built)
    code, err = run_main(capsys, "export", run_dir, "--format", "torchscript", "--out", out)
    assert code == 2 and one_error_line(err, f"--out {out}", "the folder you are in")
    assert list(tmp_path.iterdir()) == [here] and list(here.iterdir()) == []


def test_the_card_takes_no_evaluation_of_another_env_or_checkpoint(tmp_path):
    """A result with env overrides, or of another step, is not the task's evaluation of this policy."""
    def result(mean, step, overrides=()):
        return {"mean_return": mean, "std_return": 1.0, "episodes": 3, "global_step": step,
                "env_overrides": list(overrides), "deterministic": True, "seed": 0}

    (tmp_path / "final_eval.json").write_text(json.dumps(result(1.0, 64, ["env.max_episode_steps=20"])))
    (tmp_path / "a_older.json").write_text(json.dumps(result(2.0, 32)))
    assert export_module.find_evaluation(str(tmp_path), 64) is None
    (tmp_path / "b_this.json").write_text(json.dumps(result(3.0, 64)))
    name, found = export_module.find_evaluation(str(tmp_path), 64)
    assert (name, found["mean_return"]) == ("b_this.json", 3.0)
    assert export_module.find_evaluation(str(tmp_path))[1]["mean_return"] == 2.0  # step unknown: any step


def test_the_card_skips_another_tools_json_in_the_run_folder(tmp_path):
    """A stray file with a mean_return, but not visppo eval's fields, is not an evaluation (its
    list of episodes crashed the export)."""
    good = {"mean_return": 2.0, "std_return": 1.0, "episodes": 3, "global_step": 64, "seed": 0}
    for name, stray in (("a.json", {**good, "episodes": [1.0, 2.0], "std_return": "n/a"}),
                        ("b.json", {**good, "episodes": 0}), ("c.json", {**good, "mean_return": True}),
                        ("d.json", {**good, "seed": "x"})):
        (tmp_path / name).write_text(json.dumps(stray))
    assert export_module.find_evaluation(str(tmp_path), 64) is None
    (tmp_path / "e.json").write_text(json.dumps(good))
    name, found = export_module.find_evaluation(str(tmp_path), 64)
    assert name == "e.json" and export_module.evaluation_lines((name, found), str(tmp_path))


def _pushed_out_of_bounds(run_dir, tmp_path):
    """A copy of the run whose actor's last bias puts the Gaussian's mean far outside [-1, 1]."""
    import shutil

    from visppo.checkpoint import atomic_save, load

    copy = tmp_path / "pushed"
    shutil.copytree(run_dir, copy)
    latest = copy / "checkpoints" / "latest.pt"
    ckpt = load(latest)
    last = max((k for k in ckpt["model"] if k.startswith("actor.") and k.endswith(".bias")),
               key=lambda k: int(k.split(".")[1]))
    ckpt["model"][last] = torch.tensor([5.0, -5.0])
    atomic_save(ckpt, latest)
    return copy


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_an_exported_network_clips_its_actions_to_the_bounds(run_dir, recorded, tmp_path, capsys, fmt):
    _, pixels, state, _ = recorded
    pushed = _pushed_out_of_bounds(run_dir, tmp_path)
    eager = load_policy(pushed).act_stacked(pixels, state)
    assert np.all(eager[:, 0] == 1.0) and np.all(eager[:, 1] == -1.0)
    out = exported(pushed, tmp_path, capsys, fmt)
    if fmt == "pt2":
        network = torch.export.load(str(out / "policy.pt2")).module()
        with torch.no_grad():
            actions = network(torch.from_numpy(pixels), torch.from_numpy(state)).numpy()
    else:
        ort = pytest.importorskip("onnxruntime", reason="the deploy extra (pip install -e \".[deploy]\")")
        session = ort.InferenceSession(str(out / "policy.onnx"), providers=["CPUExecutionProvider"])
        (actions,) = session.run(["action"], {"pixels": pixels, "state": state})
    assert np.array_equal(actions, eager)


def test_a_discrete_policy_exports_its_most_likely_action(tmp_path, capsys):
    run = visppo.train(None, **tiny_kwargs(tmp_path / "d", env__id="visppo/DotReachDiscrete-v0",
                                           ppo__total_steps=64, ppo__num_epochs=1))
    policy = load_policy(run)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (16, 3, 48, 48), dtype=np.uint8)
    eager = policy.act_stacked(pixels)
    out = exported(run, tmp_path, capsys, "pt2")
    network = torch.export.load(str(out / "policy.pt2")).module()
    with torch.no_grad():
        actions = network(torch.from_numpy(pixels)).numpy()
    assert actions.dtype == np.int64 and np.array_equal(actions, eager)
    assert json.loads((out / "policy.json").read_text())["action"]["type"] == "discrete"

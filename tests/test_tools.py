"""The scripts in tools/ as code: each is a module with ``main(argv) -> int``, imported here and
called in this process on tiny configs (visppo never imports them). A subprocess appears only
where starting one is what the tool does (bench_ddp's torchrun). tools/learning_table.py has its
own file, tests/test_tool_learning_table.py; tools/validate_probe.py, tests/test_validate_probe.py."""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import one_error_line, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
TOOL_FILES = sorted(TOOLS.glob("*.py"))


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package). tools/ goes on sys.path so that the
    processes a tool spawns (bench.py's measurements) import it by name too."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


def call(capsys, tool: str, *args) -> tuple[int, str, str]:
    """``tools/<tool>.py ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        code = load_tool(tool).main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own errors exit, with the same one-line message
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny() -> list[str]:
    return [o for o in tiny_overrides() if not o.startswith("run.")]


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    """Relative config paths (configs/dot_reach.yaml, bench_ddp's default) from the repository root."""
    monkeypatch.chdir(ROOT)


# --------------------------------------------------------------------------- every tool


def imports_of(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import statement, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found.append(("." * node.level + (node.module or ""), [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", TOOL_FILES, ids=lambda p: p.stem)
def test_no_tool_edits_sys_path_or_imports_a_private_name(path):
    """A tool runs on visppo's public API: no sys.path edits, no ``_name`` from visppo, visppo_envs
    or another tool (nor a private module of theirs)."""
    tree = ast.parse(path.read_text())
    ours = {"visppo", "visppo_envs"} | {p.stem for p in TOOL_FILES}
    private = [f"{module}: {names}" for module, names in imports_of(tree)
               if module.startswith(".") or module.split(".")[0] in ours
               and any(part.startswith("_") for part in module.split(".") + names)]
    assert not private, private
    touches_path = [ast.unparse(node) for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    touches_path += [m for m, names in imports_of(tree) if m == "sys" and "path" in names]
    assert not touches_path, touches_path


@pytest.mark.parametrize("path", TOOL_FILES, ids=lambda p: p.stem)
def test_every_tool_is_a_module_with_main_argv_returning_its_exit_code(path):
    tree = ast.parse(path.read_text())
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert len(mains) == 1, "no module-level main()"
    args = mains[0].args
    assert [a.arg for a in args.args] == ["argv"] and len(args.defaults) == 1, ast.unparse(args)
    assert isinstance(args.defaults[0], ast.Constant) and args.defaults[0].value is None
    assert "None" in ast.unparse(args.args[0].annotation) and ast.unparse(mains[0].returns) == "int"
    assert ast.unparse(tree.body[-1]) == "if __name__ == '__main__':\n    sys.exit(main())"
    module = load_tool(path.stem)  # importable: importing runs nothing
    assert callable(module.main) and module.__doc__


# --------------------------------------------------------------------------- bench, bench_update


def test_bench_prints_every_figure_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code, text, err = call(capsys, "bench", *tiny(), "env.vector=sync", "--repeats", "1", "--iterations", "2",
                           "--steps", "64", "--json", out)
    assert code == 0, err
    for label in ("raw env, 1 process", "raw env, 2 async workers", "collection", "update",
                  "end to end", "per iteration", "peak memory"):
        assert label in text, text
    figures = json.loads(out.read_text())
    assert set(figures["raw_env_sps"]) == {"1 process", "2 async workers", "4 async workers"}
    assert all(v > 0 for v in figures["raw_env_sps"].values())
    for key in ("end_to_end_sps", "collect_sps", "update_samples_per_s", "peak_rss_bytes",
                "time/collect", "time/values", "time/update"):
        assert figures[key] > 0, key
    # the end-to-end rate cannot beat collection alone, and the ratio is against the fastest raw env
    assert figures["end_to_end_sps"] < figures["collect_sps"]
    assert abs(figures["ratio_to_raw"] - figures["end_to_end_sps"] / max(figures["raw_env_sps"].values())) < 1e-9


def test_bench_counts_the_short_minibatch_and_the_one_an_early_stop_computed():
    bench = load_tool("bench")
    # a rollout of 10 in minibatches of 8: 8 and 2 per epoch
    assert [bench.update_samples(10, 8, m) for m in (1, 2, 3, 4)] == [8, 10, 18, 20]
    row = {"optimizer_steps": "2", "skipped_steps": "1", "loss/stop_kl": "nan"}
    assert bench.minibatches_done(row) == 3
    assert bench.minibatches_done({**row, "loss/stop_kl": ""}) == 3
    assert bench.minibatches_done({**row, "loss/stop_kl": "0.08"}) == 4


def test_bench_update_samples_are_those_the_update_scored(tmp_path, monkeypatch):
    """The samples bench credits each iteration's update with are the samples that went through
    ``score_actions`` (forward and backward): a minibatch that does not divide the rollout and an
    update stopped early by the KL target included."""
    import csv

    import torch

    from visppo.config import load_config
    from visppo.loop import train
    from visppo.policy import ActorCritic

    bench = load_tool("bench")
    scored = []
    score = ActorCritic.score_actions
    monkeypatch.setattr(ActorCritic, "score_actions", lambda self, obs, actions: (  # backprop's, not no-grad passes'
        scored.append(len(actions) * torch.is_grad_enabled()), score(self, obs, actions))[1])
    for extra in ({}, {"ppo.target_kl": 1e-6, "ppo.learning_rate": 0.01}):
        scored.clear()
        cfg = load_config(None, tiny_overrides(tmp_path / str(len(extra)), **{
            "ppo.minibatch_size": 24, "ppo.num_epochs": 3, "run.log_every": 1, **extra}))
        rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
        counted = sum(bench.update_samples(cfg.rollout_size, 24, bench.minibatches_done(r)) for r in rows)
        assert counted == sum(scored) > 0
    assert any(bench.minibatches_done(r) < 9 for r in rows)  # the KL target did stop an update


@pytest.mark.parametrize("args, needle", [
    (["--iterations", "1"], "--iterations must be at least 2"),
    (["--repeats", "0"], "--repeats"),
    (["ppo.bogus=1"], "bogus"),
    (["configs/nosuch.yaml"], "nosuch.yaml"),
    (["--json", "{tmp}/nowhere/b.json"], "does not exist"),
    (["--json", "{tmp}"], "is a folder"),
    (["--nosuch"], "unrecognized arguments"),
    (["env.id=visppo/Nope-v0", "--no-raw", "--repeats", "1", "--iterations", "2"], "visppo/Nope-v0"),
])
def test_bench_refuses_bad_input_with_one_error_line(tmp_path, capsys, args, needle):
    code, text, err = call(capsys, "bench", *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2 and text == ""
    one_error_line(err, needle)


def test_bench_reports_bad_input_found_while_measuring_as_one_error_line(capsys, monkeypatch):
    """What only making the env finds (env.kwargs it refuses) is raised in a measurement's process."""
    from visppo.errors import ConfigError

    def refused(*args, **kwargs):
        raise ConfigError("env.id visppo/DotReach-v0 refused its arguments: check env.kwargs")

    monkeypatch.setattr(load_tool("bench"), "measure", refused)
    code, text, err = call(capsys, "bench", *tiny(), "--no-raw", "--repeats", "1", "--iterations", "2")
    assert code == 2 and text == ""
    one_error_line(err, "env.kwargs")


def test_bench_update_compares_a_plain_update_with_visppos_and_writes_json(tmp_path, capsys):
    out = tmp_path / "update.json"
    code, text, err = call(capsys, "bench_update", *tiny(), "ppo.minibatch_size=16", "--micro", "8,0", "--amp", "off",
                           "--repeats", "2", "--json", out)
    assert code == 0, err
    assert "samples/s" in text and f"wrote {out}" in text
    rows = json.loads(out.read_text())["rows"]
    # the plain baseline (NCHW, Adam's loop), then fused Adam alone, then the config's layout per micro-batch
    assert [(r["name"], r["channels_last"], r["fused_adam"], r["micro_batch_size"]) for r in rows] == [
        ("baseline", False, False, 16), ("fused Adam", False, True, 16),
        ("micro=8", True, True, 8), ("micro=mb", True, True, 16)]
    assert all(len(r["seconds"]) == 2 and r["samples_per_second"] > 0 and r["peak_bytes"] > 0 for r in rows)
    assert rows[0]["ratio"] == 1.0


def out_of_memory_at(monkeypatch, too_big):
    """visppo.ppo's minibatch gradient raises an out-of-memory error at the micro-batch sizes
    ``too_big`` refuses, as a card would."""
    import torch

    from visppo import ppo

    gradient = ppo.minibatch_gradient

    def limited(policy, buffer, mb, advantages, setup):
        if too_big(setup.sizes.micro):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return gradient(policy, buffer, mb, advantages, setup)

    monkeypatch.setattr(ppo, "minibatch_gradient", limited)


def test_bench_update_skips_a_row_whose_micro_batch_backed_off(tmp_path, capsys, monkeypatch):
    """A row that runs out of memory is not timed at half its size under its own label."""
    out_of_memory_at(monkeypatch, lambda micro: micro == 8)
    out = tmp_path / "update.json"
    code, text, err = call(capsys, "bench_update", *tiny(), "ppo.minibatch_size=16", "--micro", "4,8,0",
                           "--amp", "off", "--repeats", "1", "--json", out)
    assert code == 0, err
    assert "skip micro=8 off: micro-batch 8 does not fit: the update backed off to 4" in text
    assert [r["name"] for r in json.loads(out.read_text())["rows"]] == ["baseline", "fused Adam", "micro=4", "micro=mb"]


def test_bench_update_refuses_when_the_baseline_does_not_fit(tmp_path, capsys, monkeypatch):
    out_of_memory_at(monkeypatch, lambda micro: micro > 4)
    out = tmp_path / "update.json"
    code, text, err = call(capsys, "bench_update", *tiny(), "ppo.minibatch_size=16", "--micro", "4",
                           "--amp", "off", "--repeats", "1", "--json", out)
    assert code == 2 and not out.exists()
    one_error_line(err, "baseline", "ppo.minibatch_size")


def test_bench_update_runs_with_an_auto_inference_chunk(capsys):
    code, text, err = call(capsys, "bench_update", *tiny(), "ppo.minibatch_size=16", "memory.infer_chunk_size=auto",
                           "--micro", "0", "--amp", "off", "--repeats", "1")
    assert code == 0, err
    assert "skip" not in text and "micro=mb" in text


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (pinned host memory)")
def test_bench_update_buffer_is_pinned_for_a_cuda_update_as_trainings_is():
    import gymnasium as gym
    import torch

    from visppo.config import load_config

    bench_update = load_tool("bench_update")
    cfg = load_config(None, tiny())
    obs = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (9, 48, 48), np.uint8)})
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    buf = bench_update.random_buffer(cfg, obs, act, torch.Generator().manual_seed(0), device=torch.device("cuda"))
    assert buf.obs["pixels"].is_pinned()


def test_bench_update_json_is_whole_or_absent_when_its_write_dies(tmp_path, capsys, monkeypatch):
    """A full disk while --json is written (visppo.atomic's fsync fails) keeps the previous file."""
    import os

    out = tmp_path / "update.json"
    out.write_text('{"old": true}')

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        call(capsys, "bench_update", *tiny(), "--micro", "0", "--amp", "off", "--repeats", "1", "--json", out)
    assert json.loads(out.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["update.json"]  # no temporary file left


@pytest.mark.parametrize("args, needle", [
    (["--micro", "x"], "invalid literal"),
    (["--micro", "-1"], "--micro sizes >= 0"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["model.bogus=1"], "bogus"),
    (["--json", "{tmp}/nowhere/u.json"], "does not exist"),
    (["--json", "{tmp}"], "is a folder"),
    (["--amp", "off,foo"], "--amp foo"),
    (["env.id=visppo/Nope-v0"], "visppo/Nope-v0"),
])
def test_bench_update_refuses_bad_input_with_one_error_line(tmp_path, capsys, args, needle):
    code, text, err = call(capsys, "bench_update", *tiny(), *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2 and text == ""
    one_error_line(err, needle)


# --------------------------------------------------------------------------- bench_ddp


def test_bench_ddp_builds_one_torchrun_per_count_and_splits_the_global_sizes(tmp_path):
    ddp = load_tool("bench_ddp")
    args = ["configs/dot_reach.yaml", "ppo.num_envs=4", "ppo.minibatch_size=64", "ppo.num_steps=16"]
    cmd = ddp.torchrun_command(args, 2, 3, True, tmp_path / "r")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[5:8] == ["-m", "visppo", "train"] and cmd[8] == "configs/dot_reach.yaml"
    # --split: each process runs half the envs and half the minibatch; 3 iterations of the global rollout
    assert {"ppo.num_envs=2", "ppo.minibatch_size=32", "ppo.total_steps=192", f"run.dir={tmp_path / 'r'}"} <= set(cmd)
    assert any(a.startswith("train.threads=") for a in cmd)
    plain = ddp.torchrun_command([*args, "train.threads=1"], 2, 3, False, tmp_path / "r")
    assert {"ppo.num_envs=4", "ppo.total_steps=384"} <= set(plain) and plain.count("train.threads=1") == 1
    assert ddp.sizes(ddp.load_config(None, ["ppo.num_envs=3"]), 1, True) == (3, ddp.load_config(None).ppo.minibatch_size)
    rows = {1: [{"steps_per_second": "100", "time/collect": "1", "time/values": "0.1", "time/update": "2",
                 "global_step": "128", "iteration": "2"}],
            2: [{"steps_per_second": "150", "time/collect": "1", "time/values": "0.1", "time/update": "2",
                 "global_step": "512", "iteration": "2"}]}
    table = ddp.report(args, [1, 2], rows, 3, 1, True).splitlines()
    assert "same global sizes" in table[0]
    assert table[3].split()[:4] == ["2", "256", "150", "1.50x"]


def test_bench_ddp_times_a_torchrun_of_the_config(capsys):
    """One process under torchrun (gloo), 2 iterations, the first left out as warm-up."""
    code, text, err = call(capsys, "bench_ddp", "configs/dot_reach.yaml", *tiny(), "--nproc", "1",
                           "--iterations", "2")
    assert code == 0, err
    row = text.splitlines()[-1].split()
    assert row[0] == "1" and row[1] == "64" and float(row[2]) > 0 and row[3] == "1.00x", text


def test_bench_ddp_logs_every_iteration_and_finds_its_default_config_from_anywhere(tmp_path, monkeypatch):
    """A config's run.log_every would leave no row after the warm-up; the default config is the
    repository's, not one under the working directory."""
    ddp = load_tool("bench_ddp")
    monkeypatch.chdir(tmp_path)
    assert Path(ddp.DEFAULT_CONFIG).is_file()
    cmd = ddp.torchrun_command([ddp.DEFAULT_CONFIG, "run.log_every=5"], 1, 3, False, tmp_path / "r")
    assert cmd.index("run.log_every=1") > cmd.index("run.log_every=5")


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "1,x"], "--nproc '1,x'"),
    (["--nproc", "0"], "at least 1"),
    (["--iterations", "1"], "--iterations at least 2"),
    (["ppo.num_envs=3", "--split", "--nproc", "2"], "divisible by 2"),
    (["ppo.bogus=1"], "bogus"),
    (["memory.micro_batch_size=128", "--split", "--nproc", "2"], "memory.micro_batch_size (128)"),
])
def test_bench_ddp_refuses_bad_input_with_one_error_line(capsys, args, needle):
    code, text, err = call(capsys, "bench_ddp", *args)
    assert code == 2 and text == ""
    one_error_line(err, needle)


# --------------------------------------------------------------------------- bench_sb3


def test_bench_sb3_reports_the_median_run_and_needs_stable_baselines3(capsys, monkeypatch):
    sb3 = load_tool("bench_sb3")
    line = sb3.report([(100.0, 1.0, 2.0), (300.0, 0.5, 1.0), (200.0, 2.0, 3.0)], -1)
    assert "200 steps/s end to end (runs: 100, 300, 200)" in line and "collect 1.00 s, update 2.00 s" in line
    real = sb3.importlib.util.find_spec
    monkeypatch.setattr(sb3.importlib.util, "find_spec",
                        lambda name, *a: None if name == "stable_baselines3" else real(name, *a))
    code, text, err = call(capsys, "bench_sb3", "--iterations", "1", "--repeats", "1")
    assert code == 2 and text == ""
    one_error_line(err, "pip install stable-baselines3")
    code, _, err = call(capsys, "bench_sb3", "--repeats", "0")
    assert code == 2 and one_error_line(err, "--repeats")


# --------------------------------------------------------------------------- env_speed


def test_env_speed_times_a_task_in_one_process_and_in_async_workers(capsys):
    code, text, err = call(capsys, "env_speed", "--tasks", "Reach", "--image-size", "32", "--steps", "20",
                           "--repeats", "1", "--workers", "2")
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0].startswith("raw env steps/s, 32x32") and lines[1].split() == ["task", "1", "proc", "2", "async"]
    task, single, two = lines[2].split()
    assert task == "Reach" and float(single) > 0 and float(two) > 0


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "at least 1"),
    (["--workers", "2", "0"], "at least 1"),
    (["--tasks", "Nope"], "invalid choice: 'Nope'"),
])
def test_env_speed_refuses_bad_input_with_one_error_line(capsys, args, needle):
    code, text, err = call(capsys, "env_speed", *args)
    assert code == 2 and text == ""
    one_error_line(err, needle)


# --------------------------------------------------------------------------- fit_table, memory_probe


def test_fit_table_probes_each_row_in_fake_mode_without_a_gpu(capsys):
    code, text, err = call(capsys, "fit_table", "--rows", "nature:36", "--amp", "off", "--budget", "1GiB")
    assert code == 0, err
    head, rule, row = text.splitlines()
    assert "micro-batch for 1GiB" in head and rule.startswith("| --- |")
    cells = row.split(" | ")
    assert cells[:3] == ["| nature", "36x36", "off"] and cells[3].endswith("MiB") and int(cells[4]) <= 256


@pytest.mark.parametrize("args, needle", [
    (["--rows", "nature"], "ENCODER:IMAGE_SIZE"),
    (["--budget", "abc"], "'abc' is not a size"),
    (["--rows", "nature:36", "--amp", "bogus"], "train.amp"),
    (["--rows", "nosuch:36"], "nosuch"),
    (["--budget", "1B", "--rows", "nature:36", "--amp", "off"], "nature:36 with amp off: nothing fits"),
])
def test_fit_table_refuses_bad_input_with_one_error_line(capsys, args, needle):
    code, text, err = call(capsys, "fit_table", *args)
    assert code == 2 and text == ""
    one_error_line(err, needle)


def test_memory_probe_is_visppo_probe(tmp_path, capsys):
    out = tmp_path / "probe.json"
    code, text, err = call(capsys, "memory_probe", "configs/dot_reach.yaml", *tiny(), "--device", "cpu",
                           "--budget", "1GiB", "--json", out)
    assert code == 0, err
    found = json.loads(out.read_text())
    assert found["micro_batch_size"] >= 1 and text
    code, text, err = call(capsys, "memory_probe", "configs/nosuch.yaml")
    assert code == 2 and one_error_line(err, "nosuch.yaml")
    code, text, err = call(capsys, "memory_probe", "--budget")
    assert code == 2 and one_error_line(err, "--budget")


# --------------------------------------------------------------------------- baselines


class CountingEnv:
    """Reward = the action's first entry, 3 steps an episode, success when the return is positive;
    records the reset seeds."""

    def __init__(self):
        import gymnasium as gym

        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.seeds, self.t = [], 0

    def reset(self, seed=None):
        self.seeds.append(seed)
        self.t, self.total = 0, 0.0
        return None, {}

    def step(self, action):
        self.t += 1
        self.total += float(action[0])
        return None, float(action[0]), False, self.t == 3, {"is_success": self.total > 0}


def test_baselines_sum_each_episodes_rewards_and_reset_episode_i_with_seed_plus_i():
    baselines = load_tool("baselines")
    env = CountingEnv()
    actions = iter([np.array([a, 0.0]) for a in (0.5, -0.25, 0.5, -1.0, 0.0, 0.25)])
    results = baselines.episode_returns(env, lambda: next(actions), episodes=2, seed=7)
    assert results == [(0.75, True), (-0.75, False)] and env.seeds == [7, 8]
    table = baselines.report({"zero": [(0.0, None), (2.0, None)]})
    assert "| zero | 2 | 1.00 ± 1.00 | 0.00 | 2.00 |  |" in table


def test_baselines_runs_the_configs_env(capsys):
    code, text, err = call(capsys, "baselines", ROOT / "configs" / "dot_reach.yaml", "env.image_size=48",
                           "--episodes", "2")
    assert code == 0, err
    rows = [line for line in text.splitlines() if line.startswith(("| random", "| zero"))]
    assert [row.split(" | ")[1] for row in rows] == ["2", "2"] and all(row.endswith("% |") for row in rows), text


@pytest.mark.parametrize("args, needle", [
    (["--episodes", "0"], "--episodes"),
    (["ppo.bogus=1"], "bogus"),
    (["--episodes", "x"], "invalid int value"),
    (["env.kwargs.bogus=1"], "bogus"),  # the env itself refuses it
])
def test_baselines_refuses_bad_input_with_one_error_line(capsys, args, needle):
    code, text, err = call(capsys, "baselines", ROOT / "configs" / "dot_reach.yaml", *args)
    assert code == 2 and text == ""
    one_error_line(err, needle)

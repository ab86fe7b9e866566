import argparse
import errno
import subprocess
import sys

import pytest
from conftest import one_error_line, tiny_overrides

from visppo.cli import _run, main, parse


def visppo(*args, cwd=None):
    """The real command, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "visppo", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def run_main(capsys, *args) -> tuple[int, str]:
    """The same entry point in-process (fast): exit code and stderr."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err


def test_train_smoke(tmp_path):
    res = visppo("train", *tiny_overrides(tmp_path))
    assert res.returncode == 0, res.stderr
    assert str(tmp_path / "run") in res.stdout + res.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest.pt").is_file()


def test_config_reference_lists_every_section():
    res = visppo("config", "--reference")
    assert res.returncode == 0
    for section in ("env.", "model.", "ppo.", "memory.", "train.", "run."):
        assert section in res.stdout


BAD = {
    "unknown key": (["ppo.nope=1"], "ppo.nope"),
    "wrong type": (["ppo.num_envs=lots"], "ppo.num_envs"),
    "non-positive": (["ppo.num_steps=0"], "ppo.num_steps"),
    "minibatch > rollout": (["ppo.num_envs=2", "ppo.num_steps=8", "ppo.minibatch_size=64"], "ppo.minibatch_size"),
    "micro > minibatch": (["memory.micro_batch_size=100000"], "memory.micro_batch_size"),
    "bad amp": (["train.amp=fp8"], "train.amp"),
    "fp16 on cpu": (["train.amp=fp16", "train.device=cpu"], "fp16"),
    "unknown env": (["env.id=visppo/Nope-v0"], "env.id"),
    "missing config file": (["nope.yaml"], "nope.yaml"),
    "not key=value": (["ppo.num_envs"], "key=value"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_exits_2_with_one_error_line(tmp_path, capsys, name):
    args, needle = BAD[name]
    run_dir = tmp_path / "run"
    code, err = run_main(capsys, "train", *args, f"run.dir={run_dir}", "run.progress=false")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not run_dir.exists(), "bad input must leave no run directory behind"


def test_malformed_yaml_is_refused_by_the_real_command_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo:\n  num_envs: [1,\n")
    res = visppo("train", str(bad))
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "YAML" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_unknown_command_is_an_error_line(capsys):
    code, err = run_main(capsys, "fly")
    assert code == 2 and err.startswith("error: ")


def test_overrides_may_follow_options():
    ns = parse(["probe", "c.yaml", "--budget", "8GiB", "model.encoder_checkpointing=true"])
    assert ns.args == ["c.yaml", "model.encoder_checkpointing=true"] and ns.budget == "8GiB"


def test_a_config_in_a_folder_named_with_an_equals_sign_is_a_config(tmp_path, capsys, monkeypatch):
    """Sweep folders are often named key=value (runs/lr=3e-4): the restart command visppo prints,
    `visppo train RUN/config.yaml run.dir=NEW`, must work for them."""
    folder = tmp_path / "lr=3e-4"
    folder.mkdir()
    (folder / "config.yaml").write_text("ppo:\n  num_envs: 3\n")
    assert main(["config", str(folder / "config.yaml"), "ppo.num_steps=64"]) == 0
    assert "num_envs: 3" in capsys.readouterr().out
    monkeypatch.chdir(folder)  # a file in the working directory whose name has an '='
    (folder / "gamma=0.9.yaml").write_text("ppo:\n  num_envs: 5\n")
    assert main(["config", "gamma=0.9.yaml"]) == 0
    assert "num_envs: 5" in capsys.readouterr().out
    assert main(["config", "gamma=0.9"]) == 2  # not a file: an override, and a bad one
    assert "must name section.key" in capsys.readouterr().err
    assert main(["config", "env.kwargs.note=" + "x" * 300]) == 0  # no valid path (too long): an override


def test_positionals_may_follow_options_in_every_command():
    """eval's env overrides and plot's run directories too, not only the commands' ``args``."""
    ns = parse(["eval", "RUN", "--episodes", "1", "env.image_size=64", "--deterministic", "env.frame_stack=2"])
    assert (ns.command, ns.source, ns.overrides) == ("eval", "RUN", ["env.image_size=64", "env.frame_stack=2"])
    assert ns.episodes == 1 and ns.deterministic and ns.func.__name__ == "cmd_eval"
    ns = parse(["plot", "A", "--smooth", "5", "B"])
    assert ns.runs == ["A", "B"] and ns.smooth == 5
    ns = parse(["train", "--resume", "R", "ppo.total_steps=10"])
    assert ns.args == ["ppo.total_steps=10"] and ns.resume == "R"


def test_unknown_option_names_the_subcommand_help(capsys):
    code, err = run_main(capsys, "probe", "--budget", "8GiB", "--bogus")
    assert code == 2 and err.startswith("error: ") and "--bogus" in err and "visppo probe --help" in err
    code, err = run_main(capsys, "eval", "run", "--bogus")
    assert code == 2 and "unrecognized arguments: --bogus" in err and "visppo eval --help" in err
    code, err = run_main(capsys, "eval", "run", "extra")  # a positional after the run is an env override
    assert code == 2 and "'extra': evaluation overrides change the env only" in err
    code, err = run_main(capsys, "export", "run", "--out", "d", "extra")  # no positional takes it
    assert code == 2 and "unrecognized arguments: extra" in err and "visppo export --help" in err


def test_env_that_cannot_render_is_refused(tmp_path, capsys):
    code, err = run_main(capsys, "train", "env.id=CartPole-v1", "env.pixels=false", f"run.dir={tmp_path / 'r'}")
    assert code == 2 and err.startswith("error: ") and "not an image" in err
    assert not (tmp_path / "r").exists()


def test_unwritable_run_dir_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "file").write_text("")
    code, err = run_main(capsys, "train", f"run.dir={locked / 'file' / 'run'}")
    assert code == 2 and err.startswith("error: run.dir") and "writable" in err


def test_existing_run_dir_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("precious")
    code, err = run_main(capsys, "train", f"run.dir={tmp_path / 'run'}")
    assert code == 2 and "already holds a run" in err
    assert (tmp_path / "run" / "config.yaml").read_text() == "precious"


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    code, err = run_main(capsys, "train", "--resume", str(tmp_path))
    assert code == 2 and err.startswith("error: --resume") and "not a run directory" in err


def test_resume_with_a_corrupt_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "checkpoints" / "latest.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    code, err = run_main(capsys, "train", "--resume", str(run))
    assert code == 2 and err.startswith("error: checkpoint") and "corrupt" in err


def test_resume_refuses_changing_the_maths(tmp_path, capsys):
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 0
    code, err = run_main(capsys, "train", "--resume", str(tmp_path / "run"), "ppo.num_envs=4")
    assert code == 2 and "ppo.num_envs cannot change when resuming" in err
    code, err = run_main(capsys, "train", "--resume", str(tmp_path / "run"))
    assert code == 2 and "already reached" in err
    # a config path, even one holding '=' (a sweep's folder), or a stray word after the overrides
    (tmp_path / "lr=3e-4").mkdir()
    (tmp_path / "lr=3e-4" / "c.yaml").write_text("ppo:\n  num_envs: 2\n")
    for extra in ([str(tmp_path / "lr=3e-4" / "c.yaml")], ["ppo.total_steps=256", "typo"]):
        code, err = run_main(capsys, "train", "--resume", str(tmp_path / "run"), *extra)
        assert code == 2 and "--resume takes the saved config" in err and "cannot change" not in err, err


@pytest.mark.parametrize("command", [["config", "{long}.yaml"], ["train", "--resume", "{long}"], ["eval", "{long}"]])
def test_a_path_with_a_name_too_long_is_bad_input(tmp_path, capsys, command):
    long = str(tmp_path / ("x" * 300))
    code, err = run_main(capsys, *(c.replace("{long}", long) for c in command))
    assert code == 2, err
    one_error_line(err, "too long")


def test_argparse_errors_point_to_the_help_of_the_command_given(capsys):
    code, err = run_main(capsys, "fly")
    assert code == 2 and err.strip().endswith("(see visppo --help)"), err
    code, err = run_main(capsys, "train", "--bogus")
    assert code == 2 and err.strip().endswith("(see visppo train --help)"), err


def test_eval_of_a_missing_checkpoint(tmp_path, capsys):
    code, err = run_main(capsys, "eval", str(tmp_path / "nothing.pt"))
    assert code == 2 and err.startswith("error: ") and "not found" in err and len(err.strip().splitlines()) == 1


def test_eval_of_a_checkpoint_of_another_architecture(tmp_path, capsys):
    import torch

    code, _ = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 0
    ckpt_path = tmp_path / "run" / "checkpoints" / "latest.pt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    ckpt["model"]["actor.0.weight"] = torch.zeros(3, 3)
    torch.save(ckpt, tmp_path / "other.pt")
    code, err = run_main(capsys, "eval", str(tmp_path / "other.pt"), "--episodes", "1")
    assert code == 2 and err.startswith("error: ") and "another architecture" in err
    assert "actor.0.weight" in err and len(err.strip().splitlines()) == 1


def test_eval_with_bad_episodes(tmp_path, capsys):
    code, err = run_main(capsys, "eval", str(tmp_path), "--episodes", "0")
    assert code == 2 and err.startswith("error: --episodes")


@pytest.mark.parametrize("error, verb", [
    (OSError(errno.ENOSPC, "No space left on device", "/runs/r/metrics.csv"), "cannot write"),
    (OSError(errno.EROFS, "Read-only file system", "/runs/r/metrics.csv"), "cannot write"),
    (OSError(errno.EIO, "Input/output error", "/runs/r/metrics.csv"), "cannot use"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/r/metrics.csv"), "cannot use"),
])
def test_the_catch_all_for_file_system_errors_calls_only_write_errors_writes(error, verb, capsys):
    """A permission or I/O error may come from a read: the line does not say it was a write."""
    def command(ns):
        raise error

    assert _run(argparse.Namespace(func=command)) == 1
    line = capsys.readouterr().err.strip()
    assert line == f"error: {verb} /runs/r/metrics.csv: {error.strerror}"

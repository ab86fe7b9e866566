import subprocess
import sys

import pytest

from conftest import tiny_overrides
from visppo.cli import main


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

"""Issue 17's bad inputs: each one `error:` line that says what to change, exit 2, nothing lost."""

import shutil

import pytest
import torch
from conftest import tiny_overrides

from visppo.cli import main
from visppo.config import ConfigError, RunError, load_config


def run_main(capsys, *args) -> tuple[int, str]:
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def one_error_line(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (2 iterations, a checkpoint after each); tests copy it."""
    root = tmp_path_factory.mktemp("finished")
    assert main(["train", *tiny_overrides(root, **{"run.checkpoint_every": 1})]) == 0
    return root / "run"


@pytest.fixture
def run_copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# --------------------------------------------------------------------------- run directories


def test_item2_files_of_a_run_without_config_yaml_are_not_overwritten(run_copy, capsys):
    (run_copy / "config.yaml").unlink()
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", *tiny_overrides(run_copy.parent))
    assert code == 2
    one_error_line(err, "already holds a run", "checkpoints", "metrics.csv")
    assert snapshot(run_copy) == before


def test_item14_a_run_killed_before_its_first_checkpoint_says_how_to_start_again(run_copy, capsys, tmp_path):
    shutil.rmtree(run_copy / "checkpoints")
    code, err = run_main(capsys, "train", "--resume", run_copy)
    assert code == 2
    line = one_error_line(err, "before its first checkpoint", f"visppo train {run_copy / 'config.yaml'} run.dir=")
    assert line  # and the command it gives works:
    cfg = load_config(run_copy / "config.yaml", [f"run.dir={tmp_path / 'again'}"])
    assert cfg.run.dir == str(tmp_path / "again")


def test_item16_resume_from_an_earlier_checkpoint_of_the_run(run_copy, capsys):
    latest = run_copy / "checkpoints" / "latest.pt"
    latest.write_bytes(latest.read_bytes()[:5000])  # truncated
    code, err = run_main(capsys, "train", "--resume", run_copy)
    assert code == 2
    one_error_line(err, "corrupt", f"visppo train --resume {run_copy / 'checkpoints' / 'iter_000002.pt'}")
    latest.write_bytes(b"\x00" * 100)  # garbage
    code, err = run_main(capsys, "train", "--resume", run_copy)
    one_error_line(err, "corrupt", "iter_000002.pt")
    code, err = run_main(capsys, "train", "--resume", run_copy / "checkpoints" / "iter_000001.pt")
    assert code == 0, err
    ckpt = torch.load(run_copy / "checkpoints" / "latest.pt", weights_only=True)
    assert ckpt["iteration"] == 2 and ckpt["global_step"] == 128


def test_item6_non_finite_weights_are_refused_by_resume_and_eval(run_copy, capsys):
    latest = run_copy / "checkpoints" / "latest.pt"
    ckpt = torch.load(latest, weights_only=True)
    name = next(k for k, v in ckpt["model"].items() if v.is_floating_point())
    ckpt["model"][name].fill_(float("nan"))
    torch.save(ckpt, latest)
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "non-finite weights", name, "iter_000002.pt")
    code, err = run_main(capsys, "eval", run_copy, "--episodes", 1, "--deterministic")
    assert code == 2
    one_error_line(err, "non-finite weights")
    assert snapshot(run_copy) == before


def test_item15_divergence_before_any_checkpoint_names_none_and_no_amp_when_off(tmp_path, monkeypatch):
    import visppo.ppo as ppo_module
    from visppo.train import train

    real = ppo_module.ppo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(ppo_module, "ppo_loss", nan_loss)
    with pytest.raises(RunError) as err:
        train(load_config(None, tiny_overrides(tmp_path, **{"train.max_bad_steps": 1})))
    assert "no checkpoint yet" in str(err.value) and "amp" not in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


# --------------------------------------------------------------------------- config values


@pytest.mark.parametrize("override", ["ppo.learning_rate=nan", "ppo.gamma=nan", "ppo.clip_coef=inf",
                                      "model.init_log_std=-inf", "ppo.max_grad_norm=.nan"])
def test_item8_non_finite_floats_are_refused(override):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]} must be a finite number"):
        load_config(None, [override])


def test_item13_whole_numbers_in_float_notation_are_ints(tmp_path):
    cfg = load_config(None, ["ppo.total_steps=2e6", "ppo.num_envs=4.0", "memory.micro_batch_size=1.6e1"])
    assert (cfg.ppo.total_steps, cfg.ppo.num_envs, cfg.memory.micro_batch_size) == (2_000_000, 4, 16)
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  total_steps: 2e6\n  num_steps: 1.28e2\n")
    cfg = load_config(path)
    assert (cfg.ppo.total_steps, cfg.ppo.num_steps) == (2_000_000, 128)
    with pytest.raises(ConfigError, match="ppo.num_envs"):
        load_config(None, ["ppo.num_envs=2.5"])


def test_item18_a_key_given_twice_in_a_section_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  num_envs: 2\n  num_steps: 8\n  num_envs: 4\n")
    with pytest.raises(ConfigError, match="line 4: key 'num_envs' is given twice"):
        load_config(path)
    path.write_text("ppo:\n  num_envs: 2\nppo:\n  num_steps: 8\n")
    with pytest.raises(ConfigError, match="key 'ppo' is given twice"):
        load_config(path)


@pytest.mark.timeout(30)
def test_item11_a_yaml_alias_bomb_is_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nppo:\n  num_envs: *a9\n")
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(path)
    path.write_text("a: &a [*a]\n")  # a list that holds itself
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(path)


def test_item12_a_bad_rollout_device_names_rollout_device(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path), "rollout.device=cuda:3")
    assert code == 2
    line = one_error_line(err, "rollout.device=cuda:3", "1 GPU")
    assert "train.device" not in line
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- faults and other commands


def test_item4_a_dead_worker_is_reported_not_hidden_by_close(tmp_path, monkeypatch):
    import visppo.train as train_module

    real_make = train_module.make_vector_env

    def broken_envs(cfg):
        envs = real_make(cfg)
        real_close = envs.close

        def close():
            real_close()
            raise BrokenPipeError(32, "Broken pipe")  # what closing a dead worker's pipe raises

        envs.close = close
        return envs

    def dead_worker(run):
        raise RunError("env visppo/DotReach-v0: worker 0 (exit code -9) died during step")

    monkeypatch.setattr(train_module, "make_vector_env", broken_envs)
    monkeypatch.setattr(train_module, "collect_rollout", dead_worker)
    with pytest.raises(RunError, match="worker 0"):
        train_module.train(load_config(None, tiny_overrides(tmp_path)))


@pytest.mark.parametrize("args,needle", [
    (["--device", "quantum"], "--device must be cpu, cuda or cuda:N"),
    (["--write-config", "{tmp}"], "is a directory"),
    (["--json", "{tmp}/missing/probe.json"], "does not exist"),
    (["--plot", "{tmp}/missing/probe.png"], "does not exist"),
])
def test_item9_probe_arguments(tmp_path, capsys, args, needle):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, err = run_main(capsys, "probe", *tiny_overrides(), *args)
    assert code == 2
    one_error_line(err, needle)


def test_item10_a_metrics_csv_that_is_not_utf8(run_copy, capsys, tmp_path):
    metrics = run_copy / "metrics.csv"
    metrics.write_bytes(metrics.read_bytes() + b"\xff\xfe\x00garbage\n")
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", "--resume", run_copy / "checkpoints" / "iter_000001.pt")
    assert code == 2
    one_error_line(err, "metrics.csv is not a CSV file visppo wrote")
    code, err = run_main(capsys, "plot", run_copy, "--out", tmp_path / "c.png")
    assert code == 2
    one_error_line(err, "metrics.csv is not a CSV file visppo wrote")
    assert snapshot(run_copy) == before
